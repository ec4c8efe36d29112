"""What the agent environment costs: one GRPO run on grpo_step.py's `tiny` workload (2 prompts x 8
generations of up to 64 new tokens, exact-match rewards on 2-digit additions) or, with `--model smollm2`,
its released-SmolLM2 workload (8 prompts x 4 generations of up to 32 tokens), whose steps alternate
between the built-in rollout (the `exact_match` environment's actors) and the same single-turn task played
by an `openai`-client agent (`single_turn` below: one chat completion of the same prompt, the reward by the
same comparison) through the endpoint over the same generation worker. Same weights, data order and
settings; only the rollout path differs; which path goes first alternates pair by pair. Reported: each
path's median step and rollout-stage time and generated tokens per step, and the ratios agent / built-in
of `ratios` (target: at most 1.10).

Run (one invocation; 18 steps, ~4 min on 2 idle cores; SmolLM2 with 4 pairs ~4 min):
  .venv/bin/python benchmarks/agent_overhead.py --pairs 8 --out benchmarks/reference/agent_overhead_cpu.json
  .venv/bin/python benchmarks/agent_overhead.py --model smollm2 --pairs 4 \
      --out benchmarks/reference/agent_overhead_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grpo_step import WORKLOADS, posttrain_config, prepare_model, write_prompts  # noqa: E402
from step_report import machine_description  # noqa: E402

from posttrain.algorithms import grpo  # noqa: E402
from posttrain.environments.agent import AgentTask  # noqa: E402
from posttrain.environments.answers import strip_end_markers  # noqa: E402
from posttrain.utils.timer import Timer  # noqa: E402

WORKLOAD_TEXT = {
    "tiny": "tiny: 2 prompts x 8 generations, up to 64 new tokens, exact match",
    "smollm2": "SmolLM2-135M-Instruct: 8 prompts x 4 generations, up to 32 new tokens, exact match",
}


async def single_turn(client, row) -> float:
    """The built-in task as an agent: one completion of the prompt, scored as `exact_match` scores it."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return float(
        strip_end_markers(reply.choices[0].message.content or "") == str(row["ground_truth"]).strip()
    )


def timed_step(run, envs: dict, workload) -> dict[str, float]:
    """One GRPO step with the rollouts collected through `envs`."""
    run.rollouts.collector.envs = envs
    timer = Timer()
    start = time.perf_counter()
    metrics = grpo.grpo_step(run, timer)
    run.step += 1
    seconds = time.perf_counter() - start
    tokens = metrics["rollout/mean_generated_length"] * workload.num_prompts * workload.num_generations
    rollout = timer.get_timing_metrics(reduction="sum").get("generation", 0.0)
    return {
        "step_s": seconds,
        "rollout_s": rollout,
        "generated_tokens": tokens,
        "reward": metrics["reward_mean"],
    }


def summarize(steps: list[dict]) -> dict[str, float]:
    return {
        "median_step_s": statistics.median(s["step_s"] for s in steps),
        "median_rollout_s": statistics.median(s["rollout_s"] for s in steps),
        "mean_generated_tokens": statistics.fmean(s["generated_tokens"] for s in steps),
        "s_per_1k_generated_tokens": 1000
        * sum(s["step_s"] for s in steps)
        / sum(s["generated_tokens"] for s in steps),
    }


def ratios(arms: dict[str, list[dict]]) -> dict[str, float]:
    """Agent / built-in: the median over pairs of each pair's step-time ratio (the pair's two steps ran
    back to back, so a change of the machine's load between pairs cancels), the ratio of median steps and
    of median rollout stages, and of step time per generated token over all steps (equal work)."""
    builtin, agent = arms["builtin"], arms["agent"]
    summary = {arm: summarize(steps) for arm, steps in arms.items()}
    per_pair = [a["step_s"] / b["step_s"] for a, b in zip(agent, builtin)]
    return {
        "ratio_median_of_pairs": statistics.median(per_pair),
        "ratio_median_step": summary["agent"]["median_step_s"] / summary["builtin"]["median_step_s"],
        "ratio_median_rollout": summary["agent"]["median_rollout_s"] / summary["builtin"]["median_rollout_s"],
        "ratio_per_generated_token": summary["agent"]["s_per_1k_generated_tokens"]
        / summary["builtin"]["s_per_1k_generated_tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6, help="timed (built-in, agent) step pairs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs first")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="the workload")
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.model]
    work_dir = Path(tempfile.mkdtemp(prefix="agent_overhead_"))
    model_dir = prepare_model(args, workload, work_dir)
    data_file = work_dir / "prompts.jsonl"
    write_prompts(data_file, workload, workload.num_prompts * (args.warmup + args.pairs) * 2)
    cfg = posttrain_config(workload, model_dir, data_file, work_dir / "log", "cpu", None)
    load_start = os.getloadavg()
    run = grpo.setup(cfg)
    builtin_envs = run.rollouts.collector.envs
    agent_envs = {task: AgentTask(task, single_turn, 600.0) for task in builtin_envs}
    arms: dict[str, list[dict]] = {"builtin": [], "agent": []}
    try:
        for pair in range(args.warmup + args.pairs):
            order = [("builtin", builtin_envs), ("agent", agent_envs)]
            for arm, envs in order if pair % 2 == 0 else order[::-1]:  # alternating which goes first
                step = timed_step(run, envs, workload)
                if pair >= args.warmup:
                    arms[arm].append(step)
                print(arm, {k: round(v, 3) for k, v in step.items()}, flush=True)
    finally:
        run.rollouts.collector.envs = builtin_envs  # the run shuts its own environments down
        run.shutdown()
    summary = {arm: summarize(steps) for arm, steps in arms.items()}
    end = os.getloadavg()
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {**machine_description("cpu"), "load_average_start": load_start, "load_average_end": end},
        "workload": WORKLOAD_TEXT[args.model],
        "pairs": args.pairs,
        "summary": summary,
        **ratios(arms),
        "steps": arms,
    }
    print(json.dumps({k: v for k, v in result.items() if k == "summary" or k.startswith("ratio")}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
