"""Checks of a run's config that span sections or look outside it (the data, the model path), made
before any worker starts; each failure is a ConfigError naming the key to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import ConfigError
from posttrain.data import DataConfig
from posttrain.data.sources import looks_like_hub_name
from posttrain.distributed.virtual_cluster import ClusterConfig
from posttrain.workers.policy.config import PolicyConfig, check_parallel_sizes


def check_loop_lengths(loop_cfg: Any) -> None:
    """A loop that would not train (max_num_steps / max_num_epochs < 1) or validate (val_global_batch_size
    < 1); keys are relative to the loop's section."""
    steps = getattr(loop_cfg, "max_num_steps", None)
    if steps is not None and steps < 1:
        raise ConfigError("max_num_steps", f"must be >= 1 (or null where epochs decide), got {steps}")
    for key in (
        "max_num_epochs",
        "val_global_batch_size",
        "num_prompts_per_step",
        "num_generations_per_prompt",
    ):
        value = getattr(loop_cfg, key, 1)
        if value is not None and value < 1:
            raise ConfigError(key, f"must be >= 1, got {value}")


def check_parallelism(policy_cfg: PolicyConfig, cluster_cfg: ClusterConfig) -> None:
    """The policy's model-parallel size must divide the cluster's workers (see check_parallel_sizes)."""
    check_parallel_sizes(
        policy_cfg,
        cluster_cfg.num_nodes * cluster_cfg.workers_per_node,
        "cluster.num_nodes x cluster.workers_per_node",
    )


def check_batch_fits(num_records: int, batch_size: int, key: str, value: int, dataset: str) -> None:
    """One step must not need more records (`batch_size`, set by `key`=`value`) than the data has."""
    if batch_size > num_records:
        raise ConfigError(
            key,
            f"{value} needs {batch_size} training records per step, but data.dataset={dataset} "
            f"has {num_records} usable ones",
        )


def check_model_exists(key: str, name: str) -> None:
    """`name` must be an existing path or a plausible hub name (`org/model`, or one word); a
    `<run dir>/hf_model` path names the command of configs/ that writes it."""
    local = name.startswith((".", "/")) or Path(Path(name).parts[0]).is_dir()  # under a local folder
    if Path(name).exists() or (looks_like_hub_name(name) and not local):
        return
    message = f"{name} does not exist (nor is it a Hugging Face hub name)"
    command = command_writing(Path(name))
    raise ConfigError(key, message + (f"; `{command}` writes it" if command else ""))


def command_writing(model_dir: Path, configs_dir: Path = Path("configs")) -> str | None:
    """`posttrain <algo> --config configs/X.yaml` for the config of configs/ whose log_dir holds
    `model_dir` as its exported hf_model."""
    if model_dir.name != "hf_model" or not configs_dir.is_dir():
        return None
    for config in sorted(configs_dir.glob("*.yaml")):
        text = config.read_text(errors="replace")
        if f"log_dir: {model_dir.parent.as_posix()}\n" in text:
            return f"posttrain {config.stem.split('_')[0]} --config {config.as_posix()}"
    return None


def missing_run_files(policy_cfg: PolicyConfig, data_cfg: DataConfig) -> list[ConfigError]:
    """One error per missing input of a training run: its data files and its model's directories."""
    return data_cfg.missing_files() + missing_model_files("policy", policy_cfg)


def missing_model_files(section: str, model_cfg: PolicyConfig) -> list[ConfigError]:
    """One error per missing model or tokenizer directory of the model section `section` (a policy, a
    critic, a teacher); none for a model built from a config."""
    if model_cfg.model is not None and model_cfg.model.from_config is not None:
        return []
    problems = []
    for key, name in (("model_name", model_cfg.model_name), ("tokenizer_name", model_cfg.tokenizer_name)):
        try:
            if name:
                check_model_exists(f"{section}.{key}", name)
        except ConfigError as error:
            problems.append(error)
    return problems
