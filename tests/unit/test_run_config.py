"""The run's config is a resolved copy: run-dependent values are filled in there, and the validated
config a caller holds stays exactly as it was loaded."""

import copy

import yaml

from posttrain.algorithms.run import prepare_run
from posttrain.algorithms.sft import SFTConfig
from posttrain.config import validate_config


def test_prepare_run_fills_in_a_copy_and_leaves_the_validated_config_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = validate_config(SFTConfig, {"policy": {"model_name": "some/model"}})
    before = copy.deepcopy(cfg)
    run_cfg = prepare_run(cfg, "sft", metric=("val_accuracy", True))
    assert cfg == before
    assert run_cfg.logger.log_dir.startswith("results/sft-")
    assert run_cfg.checkpointing.checkpoint_dir == f"{run_cfg.logger.log_dir}/checkpoints"
    assert (run_cfg.checkpointing.metric_name, run_cfg.checkpointing.higher_is_better) == (
        "val_accuracy",
        True,
    )
    saved = yaml.safe_load((tmp_path / run_cfg.logger.log_dir / "config.yaml").read_text())
    assert saved["logger"]["log_dir"] == run_cfg.logger.log_dir
    assert saved["checkpointing"]["metric_name"] == "val_accuracy"


def test_prepare_run_keeps_what_the_config_chose(tmp_path):
    cfg = validate_config(
        SFTConfig,
        {
            "policy": {"model_name": "some/model"},
            "logger": {"log_dir": str(tmp_path / "run")},
            "checkpointing": {
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "metric_name": "val_loss",
                "higher_is_better": False,
            },
        },
    )
    run_cfg = prepare_run(cfg, "sft", metric=("val_accuracy", True))
    assert run_cfg.logger.log_dir == str(tmp_path / "run")
    assert run_cfg.checkpointing.checkpoint_dir == str(tmp_path / "ckpt")
    assert (run_cfg.checkpointing.metric_name, run_cfg.checkpointing.higher_is_better) == ("val_loss", False)
    assert run_cfg.policy.model_name == "some/model"


def test_validate_changes_nothing():
    """Every section's `validate()` only checks: a config built in Python (its defaults resolved when it is
    constructed: the one task's name, the flat GPU-monitoring alias) is equal before and after they run."""
    import dataclasses

    from posttrain.algorithms import dpo, grpo, rm, sft
    from posttrain.evals.run import EvalConfig, EvalModelConfig
    from posttrain.utils.logger import LoggerConfig

    def sections(cfg):
        yield cfg
        for item in dataclasses.fields(cfg):
            value = getattr(cfg, item.name)
            for one in value.values() if isinstance(value, dict) else [value]:
                if dataclasses.is_dataclass(one):
                    yield from sections(one)

    for schema in (sft.SFTConfig, grpo.GRPOConfig, dpo.DPOConfig, rm.RMConfig, EvalConfig):
        model = {"model": EvalModelConfig(model_name="a_model")} if schema is EvalConfig else {}
        cfg = schema(logger=LoggerConfig(gpu_collection_interval=3.0), **model)
        before = copy.deepcopy(cfg)
        checked = [section.validate() for section in sections(cfg) if hasattr(section, "validate")]
        assert len(checked) >= 5 and cfg == before, schema.__name__
        assert cfg.logger.gpu_monitoring.collection_interval == 3.0
    assert grpo.GRPOConfig().data.task_name == "arithmetic" == EvalConfig().data.task_name
