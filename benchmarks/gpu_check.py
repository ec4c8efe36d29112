"""One-command GPU check (`make gpu-check`): a handful of measurements on one GPU in a few minutes, printed as
one table and written to `benchmarks/reference/gpu_check_<device>.json`.

Rows:
- `grpo_tiny`, `grpo_0.5b`: one posttrain GRPO step (median of the timed steps, after warm-up) of
  `grpo_step.py`'s `tiny` and `0.5b` workloads (seeded random weights, bf16, generation colocated), run
  through that benchmark's own `run_posttrain`;
- `train_mfu_1b`: bf16 training of a 1.07B Qwen2 shape (hidden 2048, 16 layers, MLP 8192; NLL on random
  rows, `train_generate.py`'s `bench_train` and workload): tokens/s, and MFU = tokens/s x 6 x matmul
  parameters / the GPU's dense bf16 peak, looked up by the GPU's name (H100 / H200 SXM: 989 TFLOP/s);
  attention FLOPs are not counted, so this MFU is a little below the one `train_generate.py` reports;
- `moe_ep`: training tokens/s of a tiny `qwen3_moe` model with `policy.expert_parallel_size` = 1 (one
  GPU holds every expert); skipped, saying why, where this tree's model builder or policy config lacks
  them.
- `decode_tiny`, `decode_0.5b`: the HF backend's decode loops on those workloads' models and batch shapes
  (`decode_profile.py`): tokens/s of the eager and the static loop (CUDA graphs), and a torch.profiler
  profile of a decode step of each (host-side vs kernel ms per step, host syncs per step counted under
  torch.cuda.set_sync_debug_mode), kept in the row's `profile`; the value is the static loop's ms a step.
The GRPO rows run with the defaults, that is on a GPU the static decode loop and the refit through a flat
buffer in the GPU's memory shared by CUDA IPC; their note gives the refit seconds and the generation
seconds per token position (generation / max_new_tokens).
Each row shows the same workload's CPU figure where `benchmarks/reference/` holds one (GRPO steps: the
`grpo_step` JSON of that workload measured on a CPU; training: `train_generate_cpu.json` at that size).

`--dry-run` runs on the CPU: every row at a toy size for one timed step (fp32, no MFU: a CPU has no
peak in the table), the same code paths, and writes the JSON to a temporary file; it checks the plan,
not the GPU.

Run: make gpu-check   or   .venv/bin/python benchmarks/gpu_check.py [--dry-run] [--rows a,b] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, imported by name

import decode_profile  # noqa: E402
import grpo_step  # noqa: E402
import torch  # noqa: E402
import train_generate  # noqa: E402

from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "benchmarks" / "reference"
# Dense bf16 peaks (no sparsity) by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))
ROWS = ("decode_tiny", "decode_0.5b", "grpo_tiny", "grpo_0.5b", "train_mfu_1b", "moe_ep")

TOY_MODEL = ModelFromConfig(
    hidden_size=64, num_layers=2, num_attention_heads=2, intermediate_size=128, tokenizer="byte", seed=0
)
MODEL_1B = ModelFromConfig(
    hidden_size=2048,
    num_layers=16,
    num_attention_heads=32,
    intermediate_size=8192,
    max_position_embeddings=1024,
)
TOY_TRAIN = train_generate.Workload(
    train_rows=4, train_micro_batch=2, seq_len=32, gen_prompts=2, prompt_len=8, new_tokens=8
)


@dataclass
class Row:
    """One line of the table."""

    name: str
    what: str
    value: float | None = None  # the measurement on this device
    unit: str = ""
    mfu: float | None = None
    cpu_reference: float | None = None  # the same workload's figure on a CPU, same unit
    note: str = ""
    seconds: float = 0.0  # wall time of the row
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # GRPO rows: median seconds per stage
    profile: dict = dataclasses.field(default_factory=dict)  # decode rows: decode_profile.measure's result


@dataclass
class Plan:
    """What the check runs: the device, the timed steps and every row's sizes."""

    device: str
    dry_run: bool
    warmup: int
    steps: int
    grpo_workloads: dict[str, grpo_step.Workload]
    train_model: ModelFromConfig
    train_work: train_generate.Workload


def make_plan(args: argparse.Namespace) -> Plan:
    """The full-size plan on CUDA; with `dry_run` the toy sizes on the CPU, one timed step each."""
    if args.dry_run:
        toy = {
            name: dataclasses.replace(
                grpo_step.WORKLOADS[name], num_prompts=2, num_generations=2, max_new_tokens=4, model=TOY_MODEL
            )
            for name in ("tiny", "0.5b")
        }
        return Plan("cpu", True, 0, 1, toy, TOY_MODEL, TOY_TRAIN)
    workloads = {name: grpo_step.WORKLOADS[name] for name in ("tiny", "0.5b")}
    return Plan("cuda", False, 1, args.steps, workloads, MODEL_1B, train_generate.WORKLOADS["cuda"])


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`; None when it is not in the table (or a CPU)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def model_flops_utilization(tokens_per_s: float, params: int, peak_flops: float | None) -> float | None:
    """Training MFU: tokens/s x 6 FLOPs per parameter and token (forward 2, backward 4) / the peak."""
    return tokens_per_s * 6 * params / peak_flops if peak_flops else None


def cpu_reference_step_time(workload_name: str) -> tuple[float | None, str]:
    """The median GRPO step time of `workload_name` measured on a CPU, from `benchmarks/reference/`."""
    for path in sorted(REFERENCE_DIR.glob("grpo_step*.json")):
        report = json.loads(path.read_text())
        machine, model = report.get("machine", {}), report.get("model", {})
        if (
            machine.get("device") == "cpu"
            and model.get("workload") == workload_name
            and "posttrain" in report
        ):
            return float(report["posttrain"]["step_time_median_s"]), path.name
    return None, f"no CPU reference for workload {workload_name}"


def cpu_reference_train(hidden_size: int, num_layers: int) -> tuple[float | None, str]:
    """Training tokens/s of the same shape on a CPU, from `train_generate_cpu.json`."""
    path = REFERENCE_DIR / "train_generate_cpu.json"
    if not path.exists():
        return None, "no train_generate_cpu.json"
    for result in json.loads(path.read_text())["results"]:
        shape = train_generate.SIZES.get(result["size"], {})
        if result["task"] == "train" and shape.get("hidden_size") == hidden_size:
            if shape.get("num_layers") == num_layers:
                return float(result["tokens_per_s"]), path.name
    return None, f"no CPU training reference at hidden {hidden_size} x {num_layers} layers"


# ------------------------------------------------------------------------------------------------ rows
def grpo_row(plan: Plan, name: str, work_dir: Path) -> Row:
    workload = plan.grpo_workloads[name]
    model_dir = build_model_dir(workload.model, work_dir / f"grpo_{name}")
    data_file = work_dir / f"prompts_{name}.jsonl"
    grpo_step.write_prompts(data_file, workload, workload.num_prompts * (plan.warmup + plan.steps))
    args = argparse.Namespace(device=plan.device, threads=None, warmup=plan.warmup, steps=plan.steps)
    steps, _ = grpo_step.run_posttrain(args, workload, model_dir, data_file, work_dir, "sync")
    step_s = sorted(s["step"] for s in steps)[len(steps) // 2]
    stages = {
        stage: round(sorted(s["stages"][stage] for s in steps)[len(steps) // 2], 3)
        for stage in steps[0]["stages"]
    }
    reference, source = cpu_reference_step_time(name)
    shape = (
        f"{workload.num_prompts}x{workload.num_generations} samples, <= {workload.max_new_tokens} new tokens"
    )
    busiest = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])[:3])
    row = Row(f"grpo_{name}", f"GRPO step ({shape}; median s: {busiest})", step_s, "s/step", None, reference)
    per_position_ms = 1e3 * stages.get("generation", 0.0) / workload.max_new_tokens
    row.note = (
        f"refit {stages.get('refit', 0.0):.3f} s, generation {per_position_ms:.1f} ms/position; {source}"
    )
    row.stages = stages
    return row


def decode_row(plan: Plan, name: str) -> Row:
    """The eager and static decode loops on workload `name` (`decode_profile.measure`)."""
    model = None if not plan.dry_run else TOY_MODEL
    result = decode_profile.measure(name, plan.device, 32, 1 if plan.dry_run else 3, model)
    eager, static = result["profile"]["eager"], result["profile"]["static"]
    what = (
        f"decode {result['rows']} rows x {result['new_tokens']} tokens: static loop "
        f"{result['static_over_eager']:.2f}x the eager tokens/s"
    )
    note = (
        f"eager {eager['wall_ms_per_step']:.2f} ms/step ({eager['kernel_ms_per_step']:.2f} in kernels, "
        f"{eager['host_syncs_per_step']} syncs), static {static['kernel_ms_per_step']:.2f} ms in kernels, "
        f"{static['host_syncs_per_step']} syncs"
    )
    return Row(f"decode_{name}", what, static["wall_ms_per_step"], "ms/step", note=note, profile=result)


def train_row(plan: Plan, name: str, model: ModelFromConfig, work_dir: Path, peak: float | None) -> Row:
    """Training tokens/s of `model` through `train_generate.bench_train`; MFU against `peak`."""
    model_dir = build_model_dir(model, work_dir / name)
    seconds = train_generate.bench_train(model_dir, plan.device, plan.train_work, plan.steps)
    tokens_per_s = plan.train_work.train_rows * plan.train_work.seq_len / sorted(seconds)[len(seconds) // 2]
    params = train_generate.matmul_params(model, len(load_tokenizer(model_dir)))
    mfu = model_flops_utilization(tokens_per_s, params, peak)
    reference, source = cpu_reference_train(model.hidden_size, model.num_layers)
    work = plan.train_work
    what = f"train {params / 1e6:,.4g}M matmul params, {work.train_rows}x{work.seq_len} tokens"
    note = source if peak or not plan.dry_run else f"{source}; no MFU: no bf16 peak known for the CPU"
    return Row(name, what, tokens_per_s, "tokens/s", mfu, reference, note)


def moe_available() -> str | None:
    """None when this tree builds `qwen3_moe` models and has `policy.expert_parallel_size`; else why not."""
    from posttrain.models.build import ARCHITECTURES
    from posttrain.workers.policy import PolicyConfig

    missing = []
    if "qwen3_moe" not in ARCHITECTURES:
        missing.append("posttrain.models.build has no architecture 'qwen3_moe'")
    if "expert_parallel_size" not in {f.name for f in dataclasses.fields(PolicyConfig)}:
        missing.append("PolicyConfig has no expert_parallel_size")
    return "; ".join(missing) or None


def moe_row(plan: Plan, work_dir: Path, peak: float | None) -> Row:
    """A tiny MoE model trained with every expert on the one device (expert_parallel_size 1)."""
    reason = moe_available()
    if reason is not None:
        return Row("moe_ep", "tiny MoE training, expert parallel", note=f"not available: {reason}")
    model = dataclasses.replace(TOY_MODEL, architecture="qwen3_moe", tokenizer="char")
    row = train_row(plan, "moe_ep", model, work_dir, peak)
    row.what = f"tiny MoE training, expert_parallel_size 1 ({row.what})"
    return row


# ---------------------------------------------------------------------------------------------- report
def device_label(device: str) -> str:
    """`h100`, `h200`, ... from the GPU's name (`cpu` for a dry run)."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(0)
    return next((key.lower() for key, _ in PEAK_BF16_FLOPS if key in name), name.lower().replace(" ", "_"))


def format_table(rows: list[Row]) -> str:
    lines = [f"{'row':<14}{'value':>12} {'unit':<9}{'MFU':>7}{'CPU ref':>11}  what; note"]
    for r in rows:
        value = "skipped" if r.value is None else f"{r.value:,.3f}" if r.value < 100 else f"{r.value:,.0f}"
        mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
        ref = "-" if r.cpu_reference is None else f"{r.cpu_reference:,.3g}"
        lines.append(f"{r.name:<14}{value:>12} {r.unit:<9}{mfu:>7}{ref:>11}  {r.what}; {r.note}")
    return "\n".join(lines)


def run_rows(plan: Plan, names: list[str], work_dir: Path, on_row: Callable[[list[Row]], None]) -> list[Row]:
    """Every row in turn; `on_row` gets the rows so far after each (the JSON is rewritten: a run cut short
    keeps what it measured). A row that raises is recorded with its error and the next row runs."""
    peak = peak_bf16_flops(torch.cuda.get_device_name(0)) if plan.device == "cuda" else None
    makers: dict[str, Callable[[], Row]] = {
        "decode_tiny": lambda: decode_row(plan, "tiny"),
        "decode_0.5b": lambda: decode_row(plan, "0.5b"),
        "grpo_tiny": lambda: grpo_row(plan, "tiny", work_dir),
        "grpo_0.5b": lambda: grpo_row(plan, "0.5b", work_dir),
        "train_mfu_1b": lambda: train_row(plan, "train_mfu_1b", plan.train_model, work_dir, peak),
        "moe_ep": lambda: moe_row(plan, work_dir, peak),
    }
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            row = makers[name]()
        except Exception as error:  # noqa: BLE001 - one broken row must not cost the others' numbers
            traceback.print_exc()
            row = Row(name, "failed", note=f"error: {type(error).__name__}: {error}"[:300])
        row.seconds = round(time.perf_counter() - start, 1)
        print(format_table([row]).splitlines()[1], flush=True)
        rows.append(row)
        on_row(rows)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, one step per row")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (GPU run)")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON output: a file, or a directory to write gpu_check_<device>.json into (default: "
        "reference/gpu_check_<device>.json)",
    )
    args = parser.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device visible to torch: run on a GPU machine, or pass --dry-run")
    return args


def main(argv: list[str] | None = None) -> int:
    from posttrain.distributed.virtual_cluster import start_local_ray

    args = parse_args(argv)
    plan = make_plan(args)
    label = device_label(plan.device)
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or not out.suffix):  # a folder that comes back from the GPU machine
        out = out / f"gpu_check_{label}.json"
    if out is None:
        out = (
            Path(tempfile.mkdtemp()) / "gpu_check_cpu.json"
            if plan.dry_run
            else REFERENCE_DIR / f"gpu_check_{label}.json"
        )
    start = time.perf_counter()

    def write_report(rows: list[Row]) -> None:
        report = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": label,
            "device_name": torch.cuda.get_device_name(0) if plan.device == "cuda" else platform.processor(),
            "dry_run": plan.dry_run,
            "torch": torch.__version__,
            "steps": {"warmup": plan.warmup, "timed": plan.steps},
            "wall_s": round(time.perf_counter() - start, 1),
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    # logical CPUs: the policy's bundle (the machine's cores, posttrain's default) plus the environments'
    start_local_ray((os.cpu_count() or 2) + 2, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        rows = run_rows(plan, args.rows, Path(tmp), write_report)
    import ray

    ray.shutdown()
    print(format_table(rows))
    failed = [r.name for r in rows if r.note.startswith("error:")]
    print(f"wrote {out} ({round(time.perf_counter() - start, 1)} s)")
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
