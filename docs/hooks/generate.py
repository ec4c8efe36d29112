"""MkDocs hook: before each build, write the pages that are generated, never hand-written, into
docs/generated/: the configuration reference (from the typed schema, what `--help-config` prints), the
benchmark and measurement pages (from benchmarks/reference/*.json, with the date and machine of every
figure, and a plot), and the API reference (one page per module of the package, from its docstrings)."""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "generated"
REFERENCE = REPO / "benchmarks" / "reference"


def on_pre_build(config, **kwargs) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "api").mkdir(exist_ok=True)
    write_config_reference()
    write_benchmarks()
    write_measurements()
    write_api_reference()


def write(path: Path, text: str) -> None:
    """Write only when changed, so that `mkdocs serve` does not rebuild in a loop."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


# ------------------------------------------------------------------------------------- configuration
def config_commands() -> dict[str, type]:
    from posttrain.algorithms.dpo import DPOConfig
    from posttrain.algorithms.grpo import GRPOConfig
    from posttrain.algorithms.rm import RMConfig
    from posttrain.algorithms.sft import SFTConfig
    from posttrain.evals.run import EvalConfig

    return {"sft": SFTConfig, "grpo": GRPOConfig, "dpo": DPOConfig, "rm": RMConfig, "eval": EvalConfig}


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_config_reference() -> None:
    from posttrain.config.schema import describe_config

    lines = [
        "# Configuration reference",
        "",
        "Every key of every command's config, with its default and meaning, generated from the typed schema",
        "(the same list `posttrain <command> --config FILE --help-config` prints). Set a key in the YAML file",
        "or on the command line (`a.b=value`); an unknown key is an error naming the closest valid one.",
        "",
    ]
    for command, schema in config_commands().items():
        lines += [f"## `posttrain {command}`", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{key}` | `{cell(default)}` | {cell(text)} |" for key, default, text in describe_config(schema)]
        lines.append("")
    from posttrain.environments.tool_env import ToolEnvironmentConfig

    lines += ["## `env.<task>.kwargs` of `cls: tools`", "", "| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | `{cell(default)}` | {cell(text)} |" for key, default, text in describe_config(ToolEnvironmentConfig)]
    lines.append("")
    write(OUT / "config.md", "\n".join(lines))


# ---------------------------------------------------------------------------------------- benchmarks
def machine_text(data: dict) -> str:
    machine = data.get("machine")
    if isinstance(machine, dict):
        cores = machine.get("cpu_count")
        note = f" ({machine['note']})" if machine.get("note") else ""
        return f"{machine.get('device', '')} {machine.get('processor') or ''} {cores} cores, torch {machine.get('torch')}{note}".strip()
    return f"{machine or data.get('device', '')}, {data.get('cpu_count', '?')} cores, torch {data.get('torch', '?')}"


def percent_or_dash(value: float | None) -> str:
    """A share as a percentage; "—" for a figure not measured (None or NaN)."""
    return "—" if value is None or value != value else f"{value:.1%}"


def grpo_step_section(name: str, data: dict) -> list[str]:
    sides = [side for side, value in data.items()
             if (side.startswith("posttrain") or side == "trl") and isinstance(value, dict)]
    stages = sorted({stage for side in sides for stage in data[side]["stage_time_median_s"]})
    lines = [f"### `{name}`", "", f"Measured {data['date']} on {machine_text(data)}; model "
             f"{data['model'].get('workload', '')} ({data['model'].get('num_parameters', 0) / 1e6:.1f}M parameters); "
             f"{data['work']['num_prompts']} prompts x {data['work']['num_generations']} samples of at most "
             f"{data['work']['max_new_tokens']} new tokens.", ""]
    lines += ["| | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
    lines.append("| step (median s) | " + " | ".join(f"{data[s]['step_time_median_s']:.2f}" for s in sides) + " |")
    for stage in stages:
        lines.append(f"| {stage} (s) | " + " | ".join(f"{data[s]['stage_time_median_s'].get(stage, 0.0):.2f}" for s in sides) + " |")
    lines.append("| generated tokens/s | " + " | ".join(f"{data[s]['generated_tokens_per_s']:.0f}" for s in sides) + " |")
    lines.append("| mean reply length (tokens) | " + " | ".join(f"{data[s]['mean_response_length']:.0f}" for s in sides) + " |")
    if all("padding_share_median" in data[s] for s in sides if s != "trl"):
        lines.append("| padding share of trained positions | " + " | ".join(
            percent_or_dash(data[s].get("padding_share_median")) for s in sides) + " |")
    for group in ("trainer", "generation"):
        if all("peak_rss_bytes" in data[s] for s in sides):
            lines.append(f"| {group} peak RSS (GiB) | " + " | ".join(
                f"{data[s]['peak_rss_bytes'][group] / 2**30:.2f}" for s in sides) + " |")
    if all("floor_s" in data[s] for s in sides):
        lines.append("| compute floor of its own work (s) | " + " | ".join(
            f"{data[s]['floor_s']:.1f}" for s in sides) + " |")
    if any(data[s].get("generation_hidden_share_median") for s in sides):
        lines.append("| generation hidden behind training | " + " | ".join(
            f"{data[s].get('generation_hidden_share_median', 0.0):.0%}" for s in sides) + " |")
    floor = data.get("floor")
    if floor and "training_s" in floor:
        lines += ["", f"Compute floor of the work (FLOPs at the measured fp32 matmul rate, "
                  f"{floor['measured_matmul_gflops']:.0f} GFLOP/s): training {floor['training_tflop']:.2f} TFLOP = "
                  f"{floor['training_s']:.1f} s, generation {floor['generation_tflop']:.2f} TFLOP = "
                  f"{floor['generation_s']:.1f} s."]
    ratios = [f"{key.replace('ratio_', '').replace('_over_', ' / ').replace('_equal_work', ' at equal work')}: "
              f"{value:.2f}" for key, value in data.items()
              if key.startswith("ratio_") and value is not None]
    lines += ["", "Ratios of step times: " + "; ".join(ratios) + ".", ""]
    if data.get("notes"):
        lines += [f"- {note}" for note in data["notes"]] + [""]
    return lines


def train_generate_section(name: str, data: dict) -> list[str]:
    lines = [f"### `{name}`", "", f"Measured {data['date']} on {machine_text(data)}. Matmul peaks: "
             + "; ".join(f"{k} {v['flops'] / 1e9:.0f} GFLOP/s" for k, v in data["peaks"].items()) + ".", "",
             "| size | params (M) | task | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|---|"]
    for row in data["results"]:
        lines.append(f"| {row['size']} | {row['params_m']:.1f} | {row['task']} | {row['tokens_per_s']:,.0f} | "
                     f"{row['tflops']:.3f} | {row['mfu']:.1%} |")
    return lines + [""]


def lora_section(name: str, data: dict) -> list[str]:
    lines = [f"### `{name}`", "", f"LoRA rank {data['rank']}, alpha {data['alpha']}; bytes as measured on the "
             "policy workers (`how: measured`) or counted from the model's shapes (`how: shapes`).", "",
             "| model | how | mode | trainable bytes | optimizer state bytes | refit bytes | refit / full |",
             "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['model']} | {row['how']} | {row['mode']} | {row['trainable_param_bytes']:,} | "
                     f"{row['optimizer_state_bytes']:,} | {row['refit_bytes']:,} | {row['refit_fraction_of_full']:.3f} |")
    return lines + [""]


def vllm_refit_section(name: str, data: dict) -> list[str]:
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}; torch {data['torch']}, vLLM {data['vllm']}.* "
             f"`{data['model']}` ({data['weight_bytes']:,} bytes of weights), median of {data['refits_per_run']} refits "
             f"in each of {data['runs']} alternating runs per mode (`benchmarks/vllm_refit.py`); decode: {data['decode']}.",
             "", "| refit | refit (s) | bytes written to disk per refit | decode tokens/s |", "|---|---|---|---|"]
    for mode, row in data["modes"].items():
        lines.append(f"| {mode} | {row['refit_median_s']:.3f} | {row['disk_bytes_per_refit']:,} | "
                     f"{row['decode_tokens_per_s']:.0f} |")
    return lines + [""]


def refit_nodes_section(name: str, data: dict) -> list[str]:
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}; torch {data['torch']}, Ray {data['ray']}.* "
             f"{data['model']}, median of {data['refits_per_layout']} refits, each after an optimizer step "
             "(`benchmarks/refit_nodes.py`). The nodes are raylets of `ray.cluster_utils.Cluster` on one machine.",
             "", "| layout | nodes | refit (ms) | weight bytes | through the object store |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['layout']} | {row['nodes']} | {row['refit_median_s'] * 1000:.1f} | "
                     f"{row['weight_bytes_per_refit']:,} | {row['object_store_bytes_per_refit']:,} |")
    return lines + [""]


def context_parallel_section(name: str, data: dict) -> list[str]:
    budget = data["budget_bytes_per_rank"] / 2**20
    lines = [f"### `{name}`", "", f"*{data['date']}, {machine_text(data)}.* One SFT step on one sequence of random "
             f"tokens, a tiny Llama ({data['model']['hidden_size']} wide, {data['model']['num_layers']} layers); "
             f"attention: {data['attention']} (`benchmarks/context_parallel.py`). Peak: the resident-set high-water "
             "mark over the step's start, largest rank. Step times are noisy (processes share the cores).",
             "", f"| CP | tokens | peak per rank (MiB) | step (s) | longest within {budget:.0f} MiB |",
             "|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['cp']} | {row['seq_len']:,} | {row['peak_step_bytes_per_rank'] / 2**20:.0f} | "
                     f"{row['step_s']:.2f} | {row['longest_within_budget']:,} |")
    return lines + [""]


def async_curves_section(name: str, data: dict) -> list[str]:
    """Two learning curves (`benchmarks/async_curves.py`): strict validation accuracy by step and wall time."""
    modes = data["modes"]
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}.* `{data['config']}`, {data['steps']} steps "
             "from the same SFT model, the same seed and samples; greedy validation on the held-out questions, a "
             "reply counting when its last number equals the answer (`benchmarks/async_curves.py`).", ""]
    plot = plot_async_curves(name, modes)
    lines += [f"![strict accuracy by wall time and step]({plot})", ""]
    lines += ["| | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    steps = [point["step"] for point in next(iter(modes.values()))["validation"]]
    for index, step in enumerate(steps):
        lines.append(f"| strict accuracy, step {step} (wall s) | " + " | ".join(
            f"{m['validation'][index]['strict_accuracy']:.1%} ({m['validation'][index]['wall_s']:.0f})"
            for m in modes.values()) + " |")
    lines.append("| steps' own time (s) | " + " | ".join(f"{m['steps_time_s']:.0f}" for m in modes.values()) + " |")
    lines.append("| run wall time (s) | " + " | ".join(f"{m['wall_s']:.0f}" for m in modes.values()) + " |")
    if any(m.get("borrowed_threads_s") for m in modes.values()):
        lines.append("| training with lent threads (s) | " + " | ".join(
            f"{m.get('borrowed_threads_s', 0.0):.0f}" for m in modes.values()) + " |")
    lines.append("| mean generated tokens, first / last step | " + " | ".join(
        f"{m['mean_generated_tokens'][0]:.0f} / {m['mean_generated_tokens'][-1]:.0f}" for m in modes.values()) + " |")
    if data.get("sft"):
        lines += ["", f"The SFT start: {data['sft']}."]
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def compare_section(name: str, data: dict) -> list[str]:
    """A regression report (`benchmarks/compare.py`): every figure beside its reference."""
    lines = [f"### `{name}`", "", f"Measured {data['date']} on {data['machine'].get('processor', '')} "
             f"{data['machine'].get('cpu_count', '?')} cores (`benchmarks/compare.py`); references: "
             + "; ".join(f"`{check['reference']}` ({check.get('reference_date')})" for check in data["checks"].values())
             + ".", "", "| check | figure | reference | now | now / reference | |", "|---|---|---|---|---|---|"]
    for check_name, check in data["checks"].items():
        for f in check["figures"]:
            mark = ("**worse**" if f["equal_work"] else "slower (absolute)") if f["worse"] else ""
            lines.append(f"| {check_name} | {f['name']} | {f['reference']:.4g} | {f['value']:.4g} | "
                         f"{f['ratio']:.2f} | {mark} |")
    lines += ["", f"Equal-work figures more than 10% worse: {len(data['regressions'])}."]
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def generic_section(name: str, data: dict) -> list[str]:
    """Any other reference: its date, machine and notes, and its top-level numbers."""
    lines = [f"### `{name}`", "", f"Measured {data.get('date', '?')} on {machine_text(data)}.", ""]
    numbers = {key: value for key, value in data.items() if isinstance(value, (int, float)) and key != "date"}
    if numbers:
        lines += ["| figure | value |", "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in numbers.items()] + [""]
    if data.get("notes"):
        notes = data["notes"] if isinstance(data["notes"], list) else [data["notes"]]
        lines += [f"- {note}" for note in notes] + [""]
    return lines


def gpu_check_section(name: str, data: dict) -> list[str]:
    """The one-GPU check's table (`benchmarks/gpu_check.py`): every row beside its CPU figure."""
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['device_name']}, torch {data['torch']}*, "
             f"{data['steps']['timed']} timed steps per row after {data['steps']['warmup']} untimed.", "",
             "| row | value | unit | MFU | CPU figure | what |", "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        value = "-" if row["value"] is None else f"{row['value']:,.4g}"
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        cpu = "-" if row["cpu_reference"] is None else f"{row['cpu_reference']:,.4g}"
        lines.append(f"| {row['name']} | {value} | {row['unit']} | {mfu} | {cpu} | {row['what']} |")
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def partial_rollouts_section(name: str, data: dict) -> list[str]:
    """Asynchronous GRPO with and without partial rollouts on a long-tail batch (`benchmarks/partial_rollouts.py`)."""
    results, work = data["results"], data["workload"]
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}.* {work['steps']} steps per mode (the first 2 "
             f"untimed), chunks of {work['chunk_tokens']} tokens, {work['grpo.num_prompts_per_step']} x "
             f"{work['grpo.num_generations_per_prompt']} samples of up to {work['generation.max_new_tokens']} new "
             "tokens (`benchmarks/partial_rollouts.py`).", ""]
    keys = [("step_time_mean_s", "mean step time (s)"), ("trainer_idle_fraction", "trainer idle share"),
            ("token_age_mean", "mean token age (steps)"), ("mean_generated_length", "mean reply length"),
            ("longest_reply_mean", "longest sequence per batch"), ("refits_mid_batch", "refits mid-batch"),
            ("tokens_kept_across_refit", "tokens kept across a refit"), ("tokens_discarded", "tokens discarded")]
    lines += ["| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for key, label in keys:
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:g}" if r[key] is not None else "n/a"
                                                  for r in results.values()) + " |")
    return lines + [""]


def finish_plot(figure, axes, name: str) -> str:
    """Grid and legend on each axis, then the figure saved as OUT/<name>.png and closed; its file name."""
    import matplotlib.pyplot as plt

    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(OUT / f"{name}.png", dpi=110)
    plt.close(figure)
    return f"{name}.png"


def plot_async_curves(name: str, modes: dict[str, dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_wall, by_step) = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for mode, run in modes.items():
        points = run["validation"]
        by_wall.plot([p["wall_s"] / 60 for p in points], [p["strict_accuracy"] for p in points], marker="o", label=mode)
        by_step.plot([p["step"] for p in points], [p["strict_accuracy"] for p in points], marker="o", label=mode)
    by_wall.set_xlabel("wall time (min)")
    by_step.set_xlabel("step")
    by_wall.set_ylabel("strict validation accuracy")
    return finish_plot(figure, (by_wall, by_step), name)


def time_to_accuracy_section(name: str, data: dict) -> list[str]:
    """Strict held-out accuracy against training time per arm and seed (`benchmarks/time_to_accuracy.py`)."""
    arms = data["arms"]
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}.* From `{data['sft_model']}` (strict accuracy "
             f"{data['start']['strict_accuracy']:.1%}), greedy on {data['held_out_questions']} held-out questions, a "
             "reply counting when its last number equals the answer; time is each arm's own training time "
             "(`benchmarks/time_to_accuracy.py`).", ""]
    plot = plot_time_to_accuracy(name, data)
    lines += [f"![strict accuracy by training time]({plot})", ""]
    lines += ["| arm | seed | strict accuracy (training s) |", "|---|---|---|"]
    for arm, seeds in arms.items():
        for seed, run in seeds.items():
            points = ", ".join(f"{p['strict_accuracy']:.1%} ({p['train_s']:.0f})" for p in run["points"])
            lines.append(f"| {arm} | {seed} | {points} |")
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def plot_time_to_accuracy(name: str, data: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.4))
    start = data["start"]["strict_accuracy"]
    for index, (arm, seeds) in enumerate(data["arms"].items()):
        for seed_index, run in enumerate(seeds.values()):
            points = [{"train_s": 0.0, "strict_accuracy": start}] + run["points"]
            axis.plot([p["train_s"] / 60 for p in points], [p["strict_accuracy"] for p in points], marker="o",
                      color=f"C{index}", alpha=0.9 if seed_index == 0 else 0.55,
                      label=arm if seed_index == 0 else None)
    axis.set_xlabel("training time (min)")
    axis.set_ylabel("strict held-out accuracy")
    return finish_plot(figure, (axis,), name)


def interval(value: dict) -> str:
    """`+1.2 points [-0.5, +3.0]` from a bootstrap dict of accuracies (value, low, high)."""
    return f"{value['value'] * 100:+.1f} points [{value['low'] * 100:+.1f}, {value['high'] * 100:+.1f}]"


def grpo_parity_section(name: str, data: dict) -> list[str]:
    """posttrain's GRPO beside TRL's, seed for seed (`benchmarks/grpo_parity.py`): accuracy by step with
    95% bootstrap intervals, the curves' differences, and the time each takes to the level both reach."""
    summary, seeds = data["summary"], len(next(iter(data["curves"].values())))
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}.* From `{Path(data['model']).name}`, "
             f"{seeds} seeds per arm, every setting pinned alike (below); greedy on {data['held_out_questions']} "
             "held-out questions, a reply counting when its last number equals the answer; time is each arm's "
             "own training time (`benchmarks/grpo_parity.py`).", ""]
    lines += [f"![strict accuracy by step and by training time]({plot_grpo_parity(name, summary)})", ""]
    arms = list(summary["accuracy_by_step"])
    lines += ["| step | " + " | ".join(arms) + " | difference |", "|---|" + "---|" * (len(arms) + 1)]
    for index, diff in enumerate(summary["difference_by_step"]):
        cells = [summary["accuracy_by_step"][arm][index] for arm in arms]
        lines.append(f"| {diff['step']} | " + " | ".join(
            f"{c['value']:.1%} [{c['low']:.1%}, {c['high']:.1%}]" for c in cells) + f" | {interval(diff)} |")
    margin = summary["margin"] * 100
    for key, what in (("area_difference", "area under the curve (mean accuracy over the steps)"),
                      ("final_difference", "final value")):
        inside = "within" if summary[key]["within_margin"] else "**not** within"
        lines.append(f"\n{what}, {arms[0]} - {arms[1]}: {interval(summary[key])}, {inside} +-{margin:.0f} points.")
    both = summary["highest_level_both_reach"]
    lines.append(f"\nThe highest mean accuracy both reach, {both['accuracy']:.1%}: " + ", ".join(
        f"{arm} after {both[f'{arm}_train_s']:.0f} s" for arm in arms) + " of training.")
    if data.get("on_policy_reward"):
        lines += ["", "The training reward of the replies each arm sampled around each graded step (the same prompts in "
                  "both arms, step for step; the difference paired by seed and step):", "",
                  "| graded step | steps | " + " | ".join(arms) + " | difference |", "|---|---|---|---|---|"]
        lines += [f"| {p['step']} | {p['window'][0]}-{p['window'][1]} | {p['posttrain']:.1%} | {p['trl']:.1%} | "
                  f"{interval(p['difference'])} |" for p in data["on_policy_reward"]]
    lines += ["", "| setting | value |", "|---|---|"] + [f"| {k} | {cell(str(v))} |" for k, v in data["settings"].items()]
    if data.get("samples"):
        lines += ["", "Held-out replies of seed 0, at the start and at the last step (the answer after each):", ""] + [
            f"- {arm}: `{s['prompt']}` -> `{json.dumps(s['response'])[1:-1]}` ({s['ground_truth']})"
            for arm, samples in data["samples"].items() for s in samples]
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def plot_grpo_parity(name: str, summary: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for index, (arm, points) in enumerate(summary["accuracy_by_step"].items()):
        steps = [p["step"] for p in points]
        by_step.plot(steps, [p["value"] for p in points], marker="o", color=f"C{index}", label=arm)
        by_step.fill_between(steps, [p["low"] for p in points], [p["high"] for p in points], color=f"C{index}",
                             alpha=0.2)
        mean = summary["mean_curves"][arm]
        by_time.plot([p["train_s"] / 60 for p in mean], [p["accuracy"] for p in mean], marker="o", color=f"C{index}",
                     label=arm)
    by_step.set_xlabel("step")
    by_step.set_ylabel("strict held-out accuracy")
    by_time.set_xlabel("training time (min, mean over seeds)")
    return finish_plot(figure, (by_step, by_time), name)


def verifier_only_section(name: str, data: dict) -> list[str]:
    """GRPO against rejection-sampling fine-tuning on `constrained_lists` (`benchmarks/verifier_only.py`):
    strict and content grades by step, gains within the time budget, equal time, forgetting, replies."""
    summary = data["summary"]
    arms = list(summary["by_step"])
    seeds = ", ".join(f"{arm} {len(runs)}" for arm, runs in data["runs"].items())
    lines = [f"### `{name}`", "", f"*{data['date']}, {data['machine']}.* From `{Path(data['model']).name}`, seeds "
             f"per arm: {seeds}; greedy on {data['held_out_prompts']} held-out prompts (topics and counts never "
             "trained on): strict = all four constraints met; on topic = the share of a reply's items in the "
             "topic's word list, which the reward never reads (`benchmarks/verifier_only.py`).", ""]
    lines += [f"![strict and on-topic grades by training time]({plot_verifier_only(name, summary)})", ""]
    lines += ["| arm | step | training s (mean) | strict [95%] | items on topic | strict and on topic |",
              "|---|---|---|---|---|---|"]
    for arm in arms:
        for p in summary["by_step"][arm]:
            s = p["strict"]
            lines.append(f"| {arm} | {p['step']} | {p['train_s']:.0f} | {s['value']:.1%} [{s['low']:.1%}, "
                         f"{s['high']:.1%}] | {p['on_topic_share']:.1%} | {p['strict_on_topic']:.1%} |")
    budget = summary["budget_train_s"] / 60
    lines += ["", f"Strict gain from the start within {budget:.0f} minutes of training: " + "; ".join(
        f"{arm} {interval(g['strict_gain'])} at step {g['step']} ({g['train_s']:.0f} s), items on topic "
        + ("n/a" if g["on_topic_share_over_start"] is None else f"{g['on_topic_share_over_start']:.2f}x the start's")
        for arm, g in summary["gain_within_budget"].items()) + "."]
    equal = summary["equal_time"]
    lines += ["", f"At equal training time ({equal['budget_train_s']:.0f} s, the most every arm reaches): " + "; ".join(
        f"{arm} step {equal[arm]['step']}, strict {equal[arm]['strict']['value']:.1%}" for arm in arms) + ". " + "; ".join(
        f"{key.replace('strict_difference_', '').replace('_minus_', ' - ')}: {interval(value)}"
        for key, value in equal.items() if key.startswith("strict_difference")) + "."]
    lines += ["", f"| forgetting, after training | math_words strict (start {data['start_math_words_strict_accuracy']:.1%}) "
              "| KL to the start per reply token |", "|---|---|---|"]
    lines += [f"| {arm} | {f['math_words_strict_accuracy']:.1%} | {f['kl_to_start_per_token']:.4f} |"
              for arm, f in summary["forgetting"].items()]
    lines += ["", "Held-out replies of seed 0, at the start and at the last step:", ""]
    for arm in arms:
        for point in (data["runs"][arm][0]["points"][0], data["runs"][arm][0]["points"][-1]):
            lines += [f"- {arm}, step {point['step']}: `{r['prompt']}` -> `{json.dumps(r['reply'])[1:-1]}`"
                      for r in point["replies"][:2]]
    if data.get("notes"):
        lines += [""] + [f"- {note}" for note in data["notes"]]
    return lines + [""]


def plot_verifier_only(name: str, summary: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (strict, topic) = plt.subplots(1, 2, figsize=(9, 3.4))
    for index, (arm, points) in enumerate(summary["by_step"].items()):
        minutes = [p["train_s"] / 60 for p in points]
        strict.plot(minutes, [p["strict"]["value"] for p in points], marker="o", color=f"C{index}", label=arm)
        strict.fill_between(minutes, [p["strict"]["low"] for p in points], [p["strict"]["high"] for p in points],
                            color=f"C{index}", alpha=0.2)
        topic.plot(minutes, [p["on_topic_share"] for p in points], marker="o", color=f"C{index}", label=arm)
    strict.set_ylabel("strict held-out grade (all four)")
    topic.set_ylabel("share of items on topic")
    for axis in (strict, topic):
        axis.set_xlabel("training time (min, mean over seeds)")
    return finish_plot(figure, (strict, topic), name)


def plot_grpo_steps(files: dict[str, dict]) -> str | None:
    """A bar chart of the GRPO step times, posttrain beside TRL, one group per reference file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, data in files.items() if name.startswith("grpo_step")]
    if not names:
        return None
    figure, axis = plt.subplots(figsize=(8, 3.5))
    width = 0.27
    for offset, side in enumerate(("posttrain", "posttrain_async", "trl")):
        values = [files[n][side]["step_time_median_s"] if isinstance(files[n].get(side), dict) else 0 for n in names]
        axis.bar([i + (offset - 1) * width for i in range(len(names))], values, width, label=side)
    axis.set_xticks(range(len(names)), names, rotation=15, fontsize=7)
    axis.set_ylabel("median step time (s)")
    axis.set_yscale("log")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(OUT / "grpo_step_times.png", dpi=110)
    plt.close(figure)
    return "grpo_step_times.png"


def write_benchmarks() -> None:
    files = {path.stem: json.loads(path.read_text()) for path in sorted(REFERENCE.glob("*.json"))
             if path.stem != "measurements"}
    intro = (REPO / "docs" / "benchmarks-method.md").read_text()
    lines = [intro.rstrip(), "", "## Results", "",
             "Generated from `benchmarks/reference/*.json`: each table names the file, and the date and machine "
             "it was measured on.", ""]
    plot = plot_grpo_steps(files)
    if plot:
        lines += [f"![GRPO step time, posttrain and TRL]({plot})", ""]
    for name, data in files.items():
        if name.startswith("grpo_step"):
            lines += grpo_step_section(name, data)
        elif name.startswith("train_generate"):
            lines += train_generate_section(name, data)
        elif name.startswith("lora_memory"):
            lines += lora_section(name, data)
        elif name.startswith("vllm_refit"):
            lines += vllm_refit_section(name, data)
        elif name.startswith("refit_nodes"):
            lines += refit_nodes_section(name, data)
        elif name.startswith("context_parallel"):
            lines += context_parallel_section(name, data)
        elif name.startswith("async_curves"):
            lines += async_curves_section(name, data)
        elif name.startswith("grpo_parity"):
            lines += grpo_parity_section(name, data)
        elif name.startswith("verifier_only"):
            lines += verifier_only_section(name, data)
        elif name.startswith("time_to_accuracy"):
            lines += time_to_accuracy_section(name, data)
        elif name.startswith("compare"):
            lines += compare_section(name, data)
        elif name.startswith("partial_rollouts"):
            lines += partial_rollouts_section(name, data)
        elif name.startswith("gpu_check"):
            lines += gpu_check_section(name, data)
        else:
            lines += generic_section(name, data)
    write(OUT / "benchmarks.md", "\n".join(lines) + "\n")


def write_measurements() -> None:
    """Learning results and run times quoted by the docs: `benchmarks/reference/measurements.json`."""
    entries = json.loads((REFERENCE / "measurements.json").read_text())["measurements"]
    lines = ["# Measured results", "",
             "Learning results, run times and test-suite times quoted by these docs, each with the date, the "
             "machine and the command it came from (`benchmarks/reference/measurements.json`). Learning "
             "results are graded strictly: exact match or the reply's final answer, on held-out data.", ""]
    for entry in entries:
        lines += [f"## {entry['what']}", "", f"*{entry['date']}, {entry['machine']}.* `{entry['command']}`", ""]
        lines += [f"- {result}" for result in entry["results"]] + [""]
        for table in entry.get("tables", []):
            lines += [table, ""]
    write(OUT / "measurements.md", "\n".join(lines))


# ------------------------------------------------------------------------------------------------ API
def write_api_reference() -> None:
    import posttrain

    modules = sorted(name for _, name, is_package in pkgutil.walk_packages(posttrain.__path__, "posttrain.")
                     if not is_package)
    index = ["# API reference", "", "Generated from the docstrings of every module of the package, by layer "
             "([architecture](../../architecture.md)).", ""]
    for module in modules:
        page = module.replace(".", "-") + ".md"
        write(OUT / "api" / page, f"# `{module}`\n\n::: {module}\n")
        index.append(f"- [`{module}`]({page})")
    write(OUT / "api" / "index.md", "\n".join(index) + "\n")
