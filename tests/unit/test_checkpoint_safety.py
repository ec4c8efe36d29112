"""Loading a checkpoint never runs code from it: a crafted DCP `.metadata` and a crafted optimizer entry
(pickles whose __reduce__ writes a marker file) are refused by every load path: resume, `posttrain export`
and `posttrain eval` of a checkpoint directory; the marker is never written."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from posttrain.algorithms.run import restore_run
from posttrain.evals.run import EvalModelConfig, materialize_model
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.native_checkpoint import (
    MODEL_DIR,
    OPTIM_DIR,
    export_checkpoint_to_hf,
    load_checkpoint,
    save_checkpoint,
)
from posttrain.utils.safe_dcp import SafeFileSystemReader, UnsafeCheckpointError

TINY = ModelFromConfig(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64)
REPO = Path(__file__).resolve().parents[2]


class WritesMarker:
    """Unpickling this calls exec(), which writes `marker`: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


def training_objects(model_dir: Path):
    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return build_model_dir(TINY, tmp_path_factory.mktemp("safety") / "base")


def run_checkpoint(base_model: Path, run_dir: Path) -> Path:
    """A finalized run checkpoint step_1/{training_info.json, policy/...} with a valid manifest."""
    manager = CheckpointManager({"checkpoint_dir": str(run_dir / "checkpoints")})
    tmp = manager.init_tmp_checkpoint(1, {"step": 1})
    model, optimizer, scheduler = training_objects(base_model)
    save_checkpoint(model, optimizer, scheduler, tmp / "policy", tokenizer=load_tokenizer(base_model))
    return tmp


def craft_metadata(policy_dir: Path, marker: Path) -> None:
    """Rewrite model/.metadata as real DCP metadata carrying the payload in a field."""
    metadata = SafeFileSystemReader(policy_dir / MODEL_DIR).read_metadata()
    metadata.planner_data = WritesMarker(marker)
    with open(policy_dir / MODEL_DIR / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def craft_optimizer_entry(policy_dir: Path, base_model: Path, marker: Path) -> None:
    """Re-save optim/ with the payload as a param group's learning rate (a pickled non-tensor entry)."""
    model, optimizer, _ = training_objects(base_model)
    state = get_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["lr"] = WritesMarker(marker)
    shutil.rmtree(policy_dir / OPTIM_DIR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process is intended
        dcp.save(state, checkpoint_id=policy_dir / OPTIM_DIR, no_dist=True)


def make_malicious(kind: str, base_model: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """(run checkpoint step_1 with a valid manifest, marker path, kind) with one crafted file."""
    marker = tmp_path / "marker"
    tmp = run_checkpoint(base_model, tmp_path / "run")
    if kind == "metadata":
        craft_metadata(tmp / "policy", marker)
    else:
        craft_optimizer_entry(tmp / "policy", base_model, marker)
    CheckpointManager({"checkpoint_dir": str(tmp.parent)}).finalize_checkpoint(tmp)  # attackers can hash too
    return tmp.parent / "step_1", marker, kind


@pytest.fixture(params=["metadata", "optimizer_entry"])
def malicious(request, base_model, tmp_path):
    return make_malicious(request.param, base_model, tmp_path)


@pytest.fixture
def malicious_metadata(base_model, tmp_path):
    """Export and eval read only the model weights (model/.metadata), never the optimizer."""
    return make_malicious("metadata", base_model, tmp_path)


def test_the_crafted_files_do_run_code_under_plain_pickle(base_model, tmp_path):
    """Control: the payload is real; DCP's stock reader executes it."""
    marker = tmp_path / "marker"
    tmp = run_checkpoint(base_model, tmp_path / "run")
    craft_metadata(tmp / "policy", marker)
    dcp.FileSystemReader(tmp / "policy" / MODEL_DIR).read_metadata()
    assert marker.read_text() == "code ran"


def test_resume_load_refuses_the_crafted_checkpoint(malicious, base_model):
    step_dir, marker, kind = malicious
    model, optimizer, scheduler = training_objects(base_model)
    expected = (
        "refusing to load builtins.exec"
        if kind == "metadata"
        else "param_groups.0.lr: refusing to load exec "
    )
    with pytest.raises(UnsafeCheckpointError, match=expected):
        load_checkpoint(model, optimizer, scheduler, step_dir / "policy")
    assert not marker.exists()


class LocalPolicy:
    """The worker's resume path in this process: native load_checkpoint into a real model."""

    def __init__(self, base_model: Path) -> None:
        self.objects = training_objects(base_model)

    def load_checkpoint(self, path: str) -> None:
        load_checkpoint(*self.objects, path)


def test_restore_run_refuses_the_crafted_checkpoint(malicious, base_model):
    step_dir, marker, _ = malicious
    manager = CheckpointManager({"checkpoint_dir": str(step_dir.parent)})
    assert manager.get_resume_checkpoint_path() == step_dir  # the manifest matches: loading must refuse
    with pytest.raises(UnsafeCheckpointError):
        restore_run(manager, {"policy": LocalPolicy(base_model)})
    assert not marker.exists()


def test_export_and_eval_refuse_a_crafted_metadata_file(malicious_metadata, tmp_path):
    step_dir, marker, _ = malicious_metadata
    with pytest.raises(UnsafeCheckpointError, match="refusing to load builtins.exec"):
        export_checkpoint_to_hf(step_dir / "policy", tmp_path / "hf")
    with pytest.raises(UnsafeCheckpointError):
        materialize_model(EvalModelConfig(model_name=str(step_dir)), tmp_path / "scratch")
    assert not marker.exists()


def test_posttrain_export_command_refuses_a_crafted_checkpoint(malicious_metadata, tmp_path):
    step_dir, marker, _ = malicious_metadata
    result = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "export", str(step_dir), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode != 0
    assert "refusing to load builtins.exec" in result.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_an_intact_checkpoint_still_loads_and_exports(base_model, tmp_path):
    tmp = run_checkpoint(base_model, tmp_path / "run")
    model, optimizer, scheduler = training_objects(base_model)
    load_checkpoint(model, optimizer, scheduler, tmp / "policy")
    assert optimizer.param_groups[0]["lr"] == 1e-3
    out_dir = export_checkpoint_to_hf(tmp / "policy", tmp_path / "hf")
    assert (out_dir / "model.safetensors").is_file()


def test_a_checkpoint_saved_without_optimizer_loads_weights_and_warns(base_model, tmp_path):
    """checkpointing.save_optimizer=false: no optim/ directory; loading restores the weights and says that
    the optimizer starts fresh."""
    model, _, scheduler = training_objects(base_model)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_checkpoint(model, None, scheduler, tmp_path / "policy")
    assert not (tmp_path / "policy" / OPTIM_DIR).exists()
    fresh, optimizer, fresh_scheduler = training_objects(base_model)
    with pytest.warns(UserWarning, match="holds no optimizer state"):
        load_checkpoint(fresh, optimizer, fresh_scheduler, tmp_path / "policy")
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert optimizer.state == {}
