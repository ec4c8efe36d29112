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
