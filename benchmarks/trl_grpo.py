"""TRL's `GRPOTrainer` on the work of benchmarks/grpo_step.py, timed step by step (run by that script).

Runs in its own environment (`make install-trl` makes `.venv-trl`); it only uses TRL, which is not a
dependency of posttrain. Usage: `.venv-trl/bin/python benchmarks/trl_grpo.py JOB.json OUT.json`, where
the job (written by grpo_step.py or time_to_accuracy.py) names the model directory, the prompts file and
the settings; with `save_steps`, the model is saved every that many steps (`output_dir/checkpoint-N`).

Per step: wall time from the trainer's step-begin to step-end callbacks, and TRL's own profiling
timings (`ProfilingContext`, normally sent to W&B / MLflow / Trackio, recorded here instead):
`transformers.generate` -> generation, `_calculate_rewards` -> rewards, the rest of `_prepare_inputs`
-> advantages (tokenising, padding, advantages), the rest of the step -> training (forward, backward,
optimizer). TRL has no logprob recomputation here (generation and optimisation are aligned, so the old
logprobs are the current ones) and no refit (one model generates and trains).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from importlib.metadata import version

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.extras import profiling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_reward import last_number_matches  # noqa: E402


def exact_match(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the response, stripped, equals the answer (the posttrain `exact_match` environment)."""
    return [
        float(completion[0]["content"].strip() == str(truth).strip())
        for completion, truth in zip(completions, answer)
    ]


def numeric_match(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the last number in the response equals the answer (`parity_reward.last_number_matches`, the
    reward of grpo_parity.py's posttrain arm; posttrain's `math` environment grades the answer the reply
    commits to, a stricter rule)."""
    return [
        last_number_matches(completion[0]["content"], truth) for completion, truth in zip(completions, answer)
    ]


class StepTimes(TrainerCallback):
    """Wall time of every step, the profiling timings inside it, and the logged completion lengths."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.start = 0.0
        self.profile: dict[str, float] = {}

    def record_profile(self, name: str, seconds: float) -> None:
        name = name.split(".", 1)[1]  # "GRPOTrainer.transformers.generate" -> "transformers.generate"
        self.profile[name] = self.profile.get(name, 0.0) + seconds

    def on_step_begin(self, args, state, control, **kwargs):
        self.profile = {}
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_time = time.perf_counter() - self.start
        self.steps.append({"step": step_time, "profile": dict(self.profile)})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs and self.steps:
            self.steps[-1]["mean_response_length"] = float(logs["completions/mean_length"])


def stage_times(record: dict) -> dict[str, float]:
    profile, step = record["profile"], record["step"]
    generation = profile.get("transformers.generate", 0.0)
    rewards = profile.get("_calculate_rewards", 0.0)
    prepare = profile.get("_prepare_inputs", generation + rewards)
    stages = {
        "generation": generation,
        "rewards": rewards,
        "advantages": prepare - generation - rewards,
        "logprobs": 0.0,
        "training": step - prepare,
        "refit": 0.0,
    }
    stages["other"] = step - sum(stages.values())
    return stages


def main(job_file: str, out_file: str) -> int:
    job = json.loads(open(job_file).read())
    if job["torch_threads"] is not None:  # otherwise torch's own default, as TRL's users run it
        torch.set_num_threads(job["torch_threads"])
    batch = job["num_prompts"] * job["num_generations"]
    micro_batch = job.get("micro_batch_size") or batch  # per_device_train_batch_size; accumulate the rest
    rows = [json.loads(line) for line in open(job["data_file"])]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    optimizer = job["optimizer"]
    config = GRPOConfig(
        output_dir=job["output_dir"],
        use_cpu=job["device"] == "cpu",
        seed=job["seed"],
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=batch
        // micro_batch,  # one optimizer step over the batch, generated at once
        num_generations=job["num_generations"],
        max_completion_length=job["max_completion_length"],
        temperature=job["temperature"],
        top_p=1.0,
        top_k=0,
        beta=job.get("beta", 0.0),
        epsilon=job["epsilon"],
        epsilon_high=job.get("epsilon_high", job["epsilon"]),
        loss_type=job.get("loss_type", "dapo"),  # TRL's default: token mean over the global batch
        scale_rewards=job.get("scale_rewards", "group"),  # TRL's default: (r - group mean) / group std
        mask_truncated_completions=False,
        importance_sampling_level="token",
        num_iterations=1,
        shuffle_dataset=False,
        use_vllm=False,
        learning_rate=optimizer["lr"],
        weight_decay=optimizer["weight_decay"],
        adam_beta1=optimizer["betas"][0],
        adam_beta2=optimizer["betas"][1],
        adam_epsilon=optimizer["eps"],
        optim="adamw_torch",
        lr_scheduler_type=job.get("lr_scheduler_type", "constant"),
        warmup_steps=job.get("warmup_steps", 0),
        max_grad_norm=job["max_grad_norm"],
        max_steps=job["warmup"] + job["steps"],
        logging_steps=1,
        save_strategy="steps" if job.get("save_steps") else "no",  # time_to_accuracy.py grades them
        save_steps=job.get("save_steps") or 500,
        save_only_model=True,
        report_to="none",
        disable_tqdm=True,
        fp16=False,
        dataloader_num_workers=0,
        bf16=job["device"] == "cuda",  # TRL's default; on a CPU fp32 (its bf16 autocast runs 2x slower there)
    )
    timer = StepTimes()
    profiling.ProfilingContext._log_metrics = lambda self, seconds: timer.record_profile(self.name, seconds)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=numeric_match if job["numeric_answers"] else exact_match,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
    )
    trainer.train()
    for record in timer.steps:
        record["stages"] = stage_times(record)
        record["generated_tokens"] = record.get("mean_response_length", float("nan")) * batch
    result = {
        "steps": timer.steps,
        "versions": {
            name: version(name) for name in ("trl", "transformers", "torch", "accelerate", "datasets")
        },
        "torch_threads": torch.get_num_threads(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kB
    }
    with open(out_file, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
