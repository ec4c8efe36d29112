"""Off-policy knowledge distillation (SFT with a teacher) on real Ray workers: the teacher's top-k
logprobs agree with its own token logprobs over two data-parallel ranks, and a small new student
distilled from the SFT model of the fixtures moves toward it: its KL to the teacher on held-out data falls
far below where it starts and below that of the same student trained on the data alone."""

from pathlib import Path

import pytest
import torch
from run_logs import as_overrides, metrics_by_step

from posttrain.algorithms import sft
from posttrain.config import ConfigError, load_typed_config
from posttrain.data import message_log_to_flat
from posttrain.data.message_log import tokenize_message_log
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.workers.policy import Policy, PolicyConfig

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "kd_tiny.yaml")


def test_topk_logprobs_over_two_ranks_agree_with_token_logprobs(ray_session, arithmetic_sft_model):
    """k = the whole vocabulary: the candidate equal to each next token carries that token's logprob, and
    the top-1 is the most likely token (values sorted)."""
    from posttrain.models.build import load_tokenizer

    tokenizer = load_tokenizer(arithmetic_sft_model)
    logs = [
        tokenize_message_log([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenizer)
        for q, a in [("12+30=", "042"), ("07+05=", "012"), ("55+44=", "099")]
    ]
    data = message_log_to_flat(logs, tokenizer.pad_token_id, train_on="assistant")
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    teacher = Policy(cluster, PolicyConfig(model_name=str(arithmetic_sft_model), logprob_batch_size=2))
    try:
        vocab = len(tokenizer)
        top = teacher.get_topk_logprobs(data, vocab)
        tokens = teacher.get_logprobs(data)["logprobs"]  # [B, T]
    finally:
        teacher.shutdown()
        cluster.shutdown()
    next_ids = data["input_ids"]  # position t of the candidates predicts token t
    at_token = (top["topk_logprobs"] * (top["topk_ids"] == next_ids.unsqueeze(-1))).sum(-1)  # [B, T]
    mask = data["token_mask"].bool()
    torch.testing.assert_close(at_token[mask], tokens[mask], atol=1e-5, rtol=1e-5)
    values = top["topk_logprobs"][mask]  # [N, V]
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    torch.testing.assert_close(values.exp().sum(-1), torch.ones(values.shape[0]), atol=1e-4, rtol=1e-4)


def run_kd(log_dir, teacher_dir, **extra) -> dict[int, dict]:
    values = {
        "logger.log_dir": str(log_dir),
        "logger.tensorboard_enabled": "false",
        "checkpointing.enabled": "false",
        "distillation.teacher.model_name": str(teacher_dir),
        "sft.max_num_steps": 60,
        "sft.val_period": 30,
        "sft.max_val_samples": 128,
        "sft.export_final_model": "false",
        "cluster.num_cpus_per_worker": 0.5,
        **extra,
    }
    cfg = load_typed_config(sft.SFTConfig, CONFIG, as_overrides(values))
    run = sft.setup(cfg)
    try:
        sft.sft_train(run)
    finally:
        run.shutdown()
    return metrics_by_step(log_dir)


def test_a_distilled_student_moves_toward_its_teacher(arithmetic_sft_model, tmp_path):
    """60 steps of 64 examples, a new 2-layer student of width 32 (configs/kd_tiny.yaml: the teacher's
    top-20 only, no answers from the data). Its held-out KL to the teacher falls to under a third of the
    first step's (measured 4.2 -> 0.83), below that of the same student trained on the data's answers
    alone (SFT, the KL only measured: 0.85), and it learns the data about as well without seeing an answer
    (held-out NLL 1.26 vs SFT's 1.28)."""
    distilled = run_kd(tmp_path / "kd", arithmetic_sft_model)
    alone = run_kd(
        tmp_path / "sft",
        arithmetic_sft_model,
        **{"distillation.loss.kd_weight": 0.0, "distillation.loss.nll_weight": 1.0},
    )
    first, end, control = (
        distilled[1]["train/kd_loss"],
        distilled[60]["val/kd_loss"],
        alone[60]["val/kd_loss"],
    )
    nll, control_nll = distilled[60]["val/nll_loss"], alone[60]["val/nll_loss"]
    print(f"KL to the teacher: step 1 {first:.3f}, step 60 {end:.3f}; SFT {control:.3f}")
    print(f"held-out NLL at step 60: distilled {nll:.3f}, SFT {control_nll:.3f}")
    assert end < first / 3
    assert end < control
    assert nll < 1.1 * control_nll
    assert 0.5 < distilled[1]["train/teacher_topk_mass"] <= 1.0 + 1e-6
    assert distilled[1]["timing/teacher_topk"] > 0


def test_distillation_settings_are_checked_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_typed_config(sft.SFTConfig, CONFIG, ["distillation.teacher.model_name=null"])
    assert error.value.key == "distillation.teacher.model_name"
    with pytest.raises(ConfigError) as error:
        load_typed_config(sft.SFTConfig, CONFIG, ["policy.sequence_packing.enabled=true"])
    assert error.value.key == "policy.backend"
