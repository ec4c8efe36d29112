"""DCP checkpoints of an FSDP2 model on a real 2-process gloo group: exact resume, reshard 2 -> 1, HF export,
RNG state, and write errors that name the path."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from tiny_model import TINY
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.utils.native_checkpoint import (
    CheckpointWriteError,
    export_checkpoint_to_hf,
    export_hf,
    load_checkpoint,
    load_rng_state,
    save_checkpoint,
    save_rng_state,
)

WORLD_SIZE = 2
FULL = StateDictOptions(full_state_dict=True)  # the full tensors on every rank


# -- the training setup shared by the workers and the single-process checks -----------------------------


def make_training(model_dir: Path, shard: bool):
    """Model (FSDP2-sharded per layer and at the root when `shard`), AdamW and a linear LR decay."""
    model = load_model(model_dir)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=10)
    return model, optimizer, scheduler


def batch_for(step: int, rank: int) -> torch.Tensor:
    """A fixed batch of token ids per (step, rank), independent of the global RNG."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(4, 100, (2, 12), generator=generator)  # [B=2, T=12]


def train_step(model, optimizer, scheduler, step: int, rank: int) -> float:
    input_ids = batch_for(step, rank)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    mean_loss = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
    return mean_loss.item()


def flat_optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """The optimizer state as `param_fqn/key` -> full tensor (gathered across ranks)."""
    state = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    return {
        f"{name}/{key}": torch.as_tensor(value).clone()
        for name, per in state.items()
        for key, value in per.items()
    }


def rng_draws() -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(1).item()]


# -- the 2-rank worker ------------------------------------------------------------------------------------


def distributed_worker(rank: int, port: int, model_dir: str, work_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        run_resume_scenario(rank, Path(model_dir), Path(work_dir))
    finally:
        dist.destroy_process_group()


def run_resume_scenario(rank: int, model_dir: Path, work_dir: Path) -> None:
    checkpoint = work_dir / "checkpoint"
    model, optimizer, scheduler = make_training(model_dir, shard=True)
    for step in range(2):
        train_step(model, optimizer, scheduler, step, rank)
    save_checkpoint(
        model, optimizer, scheduler, checkpoint, load_tokenizer(model_dir), extra_state={"step": 2}
    )
    saved_weights = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    saved_optim = flat_optimizer_tensors(model, optimizer)
    saved_lr = scheduler.get_last_lr()
    loss_after_save = train_step(model, optimizer, scheduler, 2, rank)

    extra_state = load_checkpoint(model, optimizer, scheduler, checkpoint)
    loaded_weights = get_model_state_dict(model, options=FULL)
    loaded_optim = flat_optimizer_tensors(model, optimizer)
    loss_after_load = train_step(model, optimizer, scheduler, 2, rank)

    # Same draws from every RNG after restoring this rank's state; ranks draw differently.
    random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)
    save_rng_state(checkpoint, rank)
    draws = rng_draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    load_rng_state(checkpoint, rank)

    export_hf(model, load_tokenizer(model_dir), work_dir / "exported", model.config)
    final_weights = get_model_state_dict(model, options=FULL)
    if rank == 0:
        save_file(saved_weights, str(work_dir / "saved_weights.safetensors"))
        save_file(saved_optim, str(work_dir / "saved_optim.safetensors"))
        save_file(dict(final_weights), str(work_dir / "final_weights.safetensors"))
    report = {
        "weights_equal": all(torch.equal(saved_weights[k], loaded_weights[k]) for k in saved_weights),
        "optim_equal": saved_optim.keys() == loaded_optim.keys()
        and all(torch.equal(saved_optim[k], loaded_optim[k]) for k in saved_optim),
        "loss_after_save": loss_after_save,
        "loss_after_load": loss_after_load,
        "extra_state": extra_state,
        "draws": draws,
        "draws_after_load": rng_draws(),
        "saved_lr": saved_lr,
    }
    (work_dir / f"report_{rank}.json").write_text(json.dumps(report))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Run the 2-rank scenario once; the tests below read what it left behind."""
    work_dir = tmp_path_factory.mktemp("native_ckpt")
    model_dir = build_model_dir(ModelFromConfig(**TINY, seed=5), work_dir / "base")
    mp.spawn(
        distributed_worker, args=(free_port(), str(model_dir), str(work_dir)), nprocs=WORLD_SIZE, join=True
    )
    reports = [json.loads((work_dir / f"report_{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    return work_dir, model_dir, reports


# -- tests ---------------------------------------------------------------------------------------------


def test_load_restores_sharded_weights_and_optimizer_state_on_every_rank(scenario):
    _, _, reports = scenario
    for report in reports:
        assert report["weights_equal"] and report["optim_equal"]
        assert report["extra_state"] == {"step": 2}


def test_step_after_load_repeats_the_loss_of_the_step_after_save(scenario):
    _, _, reports = scenario
    for report in reports:
        assert report["loss_after_load"] == report["loss_after_save"]
    # The saved state is not the initial one: a linear decay over 10 steps, 2 taken: 1e-2 * (1 - 0.9 * 2/10).
    assert reports[0]["saved_lr"] == pytest.approx([8.2e-3])


def test_checkpoint_of_two_ranks_loads_in_one_process_without_a_process_group(scenario):
    work_dir, model_dir, _ = scenario
    model, optimizer, scheduler = make_training(model_dir, shard=False)
    assert load_checkpoint(model, optimizer, scheduler, work_dir / "checkpoint") == {"step": 2}
    saved_weights = load_file(work_dir / "saved_weights.safetensors")
    assert all(torch.equal(saved_weights[k], v) for k, v in model.state_dict().items())
    saved_optim = load_file(work_dir / "saved_optim.safetensors")
    assert flat_optimizer_tensors(model, optimizer).keys() == saved_optim.keys()
    assert all(torch.equal(saved_optim[k], v) for k, v in flat_optimizer_tensors(model, optimizer).items())
    assert scheduler.get_last_lr() == pytest.approx([8.2e-3])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(8.2e-3)


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids).logits  # [B, T, V]


def test_export_from_sharded_model_reproduces_its_logits(scenario):
    work_dir, _, _ = scenario
    reference = load_model(work_dir / "base")
    reference.load_state_dict(load_file(work_dir / "final_weights.safetensors"))
    exported = load_model(work_dir / "exported")
    input_ids = batch_for(7, 0)
    assert torch.allclose(logits_of(exported, input_ids), logits_of(reference, input_ids), atol=1e-6, rtol=0)
    assert load_tokenizer(work_dir / "exported").eos_token_id == 2


def test_export_of_a_checkpoint_dir_reproduces_the_saved_logits(scenario, tmp_path):
    work_dir, _, _ = scenario
    out_dir = export_checkpoint_to_hf(work_dir / "checkpoint", tmp_path / "hf")
    reference = load_model(work_dir / "base")
    reference.load_state_dict(load_file(work_dir / "saved_weights.safetensors"))
    input_ids = batch_for(8, 1)
    assert torch.allclose(
        logits_of(load_model(out_dir), input_ids), logits_of(reference, input_ids), atol=1e-6, rtol=0
    )
    assert sorted(p.name for p in out_dir.glob("*.safetensors")) == ["model.safetensors"]


def test_rng_state_of_each_rank_restores_its_draws(scenario):
    _, _, reports = scenario
    for report in reports:
        assert report["draws_after_load"] == report["draws"]
    assert reports[0]["draws"] != reports[1]["draws"]


def test_rng_state_restores_draws_in_a_single_process(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # leaves numpy with a cached gaussian, which must survive too
    save_rng_state(tmp_path, rank=0)
    expected = rng_draws() + [float(np.random.randn())]
    load_rng_state(tmp_path, rank=0)
    assert rng_draws() + [float(np.random.randn())] == expected


def test_save_into_a_path_blocked_by_a_file_names_the_path(tmp_path):
    model_dir = build_model_dir(ModelFromConfig(**TINY), tmp_path / "base")
    model, optimizer, scheduler = make_training(model_dir, shard=False)
    blocked = tmp_path / "ckpt"
    blocked.mkdir()
    (blocked / "model").write_text("in the way")
    with pytest.raises(CheckpointWriteError, match=str(blocked / "model")):
        save_checkpoint(model, optimizer, scheduler, blocked)
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    with pytest.raises(CheckpointWriteError, match=str(not_a_dir / "ckpt")):
        save_checkpoint(model, optimizer, scheduler, not_a_dir / "ckpt")


def test_missing_checkpoint_is_named_in_the_error(tmp_path):
    model_dir = build_model_dir(ModelFromConfig(**TINY), tmp_path / "base")
    model, optimizer, scheduler = make_training(model_dir, shard=False)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        load_checkpoint(model, optimizer, scheduler, tmp_path / "nowhere")
