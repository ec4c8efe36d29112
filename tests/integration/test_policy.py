"""Training backend invariants on real Ray actors and FSDP2 over gloo: splits of a batch do not change
the update (1 vs 2 workers, 2x4 vs 8x1 micro-batches, packed vs padded rows, rows in order vs by length),
logprobs follow the batch-key contract of distributed/batched_data_dict.py, and checkpoints / exports /
reference weights reproduce logprobs."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_model import TINY
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from posttrain.algorithms.loss import NLLLoss, ValueLoss, ValueLossConfig
from posttrain.algorithms.preference_loss import BradleyTerryLoss
from posttrain.config import validate_config
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.policy.config import DynamicBatchingConfig, PolicyConfig, SequencePackingConfig
from posttrain.workers.policy.handle import Policy
from posttrain.workers.policy.microbatches import build_packed_row, unpack_row_logprobs
from posttrain.workers.policy.token_logprobs import compute_token_logprobs

NUM_ROWS, SEQ_LEN, NUM_STEPS = 8, 12, 3


# ----------------------------------------------------------------------------------------------------
# Pure helpers (no Ray)
# ----------------------------------------------------------------------------------------------------


def test_token_logprobs_follow_contract_with_temperature():
    """Vocab 2, logits [0, ln 3] at every position, temperature 1: p(1) = 3/4, p(0) = 1/4.
    Tokens [0, 1, 0]: position 0 -> 0, position 1 -> ln(3/4), position 2 -> ln(1/4).
    Temperature 2 halves the logits: p(1) = sqrt3/(1+sqrt3), so position 1 -> ln(sqrt3/(1+sqrt3))."""
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))]] * 3])  # [1, 3, 2]
    input_ids = torch.tensor([[0, 1, 0]])
    logprobs = compute_token_logprobs(logits, input_ids)
    expected = torch.tensor([[0.0, torch.log(torch.tensor(0.75)), torch.log(torch.tensor(0.25))]])
    torch.testing.assert_close(logprobs, expected)
    root3 = 3.0**0.5
    hot = compute_token_logprobs(logits, input_ids, temperature=2.0)
    torch.testing.assert_close(hot[0, 1], torch.log(torch.tensor(root3 / (1 + root3))))


def test_token_logprobs_gradient_equals_autograd_of_log_softmax():
    """The hand-written backward (onehot - softmax) * grad / temperature against finite differences (fp64
    gradcheck) and against autograd through log_softmax + gather; fp32 logits keep an fp32 result."""
    torch.manual_seed(0)
    input_ids = torch.randint(0, 11, (2, 5))
    for temperature in (1.0, 0.7):
        logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda x, t=temperature: compute_token_logprobs(x, input_ids, t), (logits,)
        )
        weights = torch.randn(2, 5, dtype=torch.float64)
        (grad,) = torch.autograd.grad(
            (compute_token_logprobs(logits, input_ids, temperature) * weights).sum(), logits
        )
        composed = (
            (logits[:, :-1] / temperature).log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        )
        (expected,) = torch.autograd.grad((composed * weights[:, 1:]).sum(), logits)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    assert compute_token_logprobs(torch.randn(1, 3, 4), torch.tensor([[0, 1, 2]])).dtype == torch.float32


def test_packed_row_masks_across_sequences_and_unpacks():
    """Two sequences of lengths 2 and 3: positions [0,1,0,1,2]; token 2 (start of the second) sees only
    itself; unpacking puts row logprobs back with zeros at each start and past each length."""
    input_ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    packed = build_packed_row(input_ids, [2, 3])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert packed.attention_mask[0, 0, 2].tolist() == [False, False, True, False, False]
    assert packed.attention_mask[0, 0, 4].tolist() == [False, False, True, True, True]
    row_logprobs = torch.tensor([[0.0, -1.0, -2.0, -3.0, -4.0]])
    unpacked = unpack_row_logprobs(row_logprobs, [2, 3], 3)
    assert unpacked.tolist() == [[0.0, -1.0, 0.0], [0.0, -3.0, -4.0]]


# ----------------------------------------------------------------------------------------------------
# Real workers
# ----------------------------------------------------------------------------------------------------


def make_train_data(num_rows: int = NUM_ROWS, seq_len: int = SEQ_LEN) -> BatchedDataDict:
    """Right-padded random rows of lengths 5..12, trained on every real token but the first; row 3 masked."""
    generator = torch.Generator().manual_seed(1)
    input_lengths = torch.randint(5, seq_len + 1, (num_rows,), generator=generator)  # [B]
    real = torch.arange(seq_len).unsqueeze(0) < input_lengths.unsqueeze(1)  # [B, T]
    input_ids = torch.randint(4, 100, (num_rows, seq_len), generator=generator) * real  # [B, T]
    token_mask = real.long()
    token_mask[:, 0] = 0
    sample_mask = torch.ones(num_rows)
    sample_mask[3] = 0.0
    return BatchedDataDict(
        input_ids=input_ids, input_lengths=input_lengths, token_mask=token_mask, sample_mask=sample_mask
    )


def direct_logprobs(model_dir, data: BatchedDataDict) -> torch.Tensor:
    """The contract computed by hand from a plain single-process forward: [B, T]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids, lengths = data["input_ids"], data["input_lengths"]
    real = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, T]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=real).logits  # [B, T, V]
    expected = torch.zeros(input_ids.shape)
    for row in range(input_ids.shape[0]):
        for t in range(1, int(lengths[row])):
            expected[row, t] = torch.log_softmax(logits[row, t - 1], dim=-1)[input_ids[row, t]]
    return expected


def policy_config(model_dir, **overrides) -> PolicyConfig:
    base = dict(
        model_name=str(model_dir),
        train_global_batch_size=NUM_ROWS,
        train_micro_batch_size=2,
        logprob_batch_size=3,
        max_grad_norm=0.5,
        optimizer={"name": "AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.01}},
        seed=0,
    )
    base.update(overrides)
    return validate_config(PolicyConfig, base)


class Run:
    """A policy on its own cluster, or with `host` in the worker processes of another run's policy (as many
    workers: no start-up of its own); `train()` runs NUM_STEPS global batches and keeps what tests compare."""

    def __init__(self, model_dir, num_workers: int, init_reference_model=False, host=None, **overrides):
        cluster_cfg = ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5)
        self.cluster = host.cluster if host else RayVirtualCluster(cluster_cfg)
        self.owns_cluster = host is None
        cfg = policy_config(model_dir, **overrides)
        host_group = host.policy.worker_group if host else None
        self.policy = Policy(self.cluster, cfg, init_reference_model, host=host_group)
        self.data = make_train_data()

    def train(self, ray_session) -> Run:
        self.initial_logprobs = self.policy.get_logprobs(self.data)["logprobs"]
        self.steps = [self.policy.train(self.data, NLLLoss()) for _ in range(NUM_STEPS)]
        self.losses = [step["loss"][0] for step in self.steps]
        self.grad_norms = [step["grad_norm"][0] for step in self.steps]
        self.weights = ray_session.get(self.policy.get_weights(only_changed=False))
        return self

    def shutdown(self) -> None:
        self.policy.shutdown()
        if self.owns_cluster:
            self.cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelFromConfig(**TINY)
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def runs(ray_session, model_dir):
    """Eight trainings of the same data from the same weights, differing only in how the batch is split.
    Three worker processes in all: the other runs live in the processes of the first one- and two-worker
    runs (`host`), each with a model of its own."""
    packing = SequencePackingConfig(enabled=True, max_tokens_per_bin=24)
    dynamic = DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=24, sequence_length_round=4)
    one, two = Run(model_dir, 1, init_reference_model=True), Run(model_dir, 2)
    built = {
        "one_worker_2x4": one,
        "two_workers_2x4": two,
        "one_worker_8x1": Run(model_dir, 1, host=one, train_micro_batch_size=8),
        "one_worker_packed": Run(model_dir, 1, host=one, sequence_packing=packing),
        "two_workers_tensor_parallel": Run(model_dir, 2, host=two, tensor_parallel_size=2),
        "two_workers_dynamic": Run(model_dir, 2, host=two, dynamic_batching=dynamic),
        "one_worker_activation_checkpointing": Run(model_dir, 1, host=one, activation_checkpointing=True),
        "one_worker_in_order": Run(model_dir, 1, host=one, length_bucketing=False),
    }
    for run in built.values():
        run.train(ray_session)
    yield built
    for run in reversed(built.values()):
        run.shutdown()


def assert_same_training(run, baseline, atol: float = 1e-5) -> None:
    assert run.losses == pytest.approx(baseline.losses, abs=atol)
    assert run.grad_norms == pytest.approx(baseline.grad_norms, abs=atol)
    assert run.weights.keys() == baseline.weights.keys()
    for name, tensor in baseline.weights.items():
        torch.testing.assert_close(run.weights[name], tensor, atol=atol, rtol=0, msg=name)


def test_training_changes_weights_and_lowers_loss(runs):
    baseline = runs["one_worker_2x4"]
    assert baseline.losses[2] < baseline.losses[0]
    assert all(norm > 0 for norm in baseline.grad_norms)


def test_one_and_two_workers_give_equal_losses_and_parameters(runs):
    assert_same_training(runs["two_workers_2x4"], runs["one_worker_2x4"])


def test_tensor_parallel_pair_equals_one_worker(runs):
    """Row-parallel projections all-reduce partial sums in another order; Adam's normalised steps (lr 1e-2)
    turn that fp32 rounding of tiny gradients into weight differences of ~1e-5, hence 5e-5 here."""
    assert_same_training(runs["two_workers_tensor_parallel"], runs["one_worker_2x4"], atol=5e-5)


def test_microbatches_2x4_equal_8x1(runs):
    baseline, single = runs["one_worker_2x4"], runs["one_worker_8x1"]
    assert baseline.steps[0]["num_microbatches"] == [4.0]
    assert single.steps[0]["num_microbatches"] == [1.0]
    assert_same_training(single, baseline)


def test_length_bucketing_computes_fewer_positions_and_trains_alike(runs):
    """Rows of lengths [10, 8, 9, 5, 12, 6, 8, 10] (68 tokens) in micro-batches of 2: in order, each pair
    padded to its longer row computes 20 + 18 + 24 + 20 = 82 positions a step; longest first, (12, 10),
    (10, 9), (8, 8), (6, 5) compute 24 + 20 + 16 + 12 = 72. The update is the same."""
    in_order, bucketed = runs["one_worker_in_order"], runs["one_worker_2x4"]
    assert in_order.data["input_lengths"].tolist() == [10, 8, 9, 5, 12, 6, 8, 10]
    assert in_order.steps[0]["num_computed_tokens"] == [82.0]
    assert bucketed.steps[0]["num_computed_tokens"] == [72.0]
    assert bucketed.steps[0]["num_real_tokens"] == in_order.steps[0]["num_real_tokens"] == [68.0]
    torch.testing.assert_close(bucketed.initial_logprobs, in_order.initial_logprobs, atol=1e-5, rtol=0)
    assert_same_training(bucketed, in_order)


def test_packed_rows_equal_padded_rows_in_logprobs_and_gradients(runs):
    baseline, packed = runs["one_worker_2x4"], runs["one_worker_packed"]
    torch.testing.assert_close(packed.initial_logprobs, baseline.initial_logprobs, atol=1e-5, rtol=0)
    assert packed.steps[0]["num_microbatches"][0] < NUM_ROWS  # several sequences did share a row
    assert_same_training(packed, baseline)


def test_dynamic_batching_on_two_workers_equals_fixed_microbatches(runs):
    dynamic = runs["two_workers_dynamic"]
    torch.testing.assert_close(
        dynamic.initial_logprobs, runs["one_worker_2x4"].initial_logprobs, atol=1e-5, rtol=0
    )
    assert_same_training(dynamic, runs["one_worker_2x4"])


def test_logprobs_match_a_direct_single_process_forward(runs, model_dir):
    run = runs["two_workers_2x4"]
    expected = direct_logprobs(model_dir, run.data)
    torch.testing.assert_close(run.initial_logprobs, expected, atol=1e-5, rtol=0)
    assert (run.initial_logprobs[:, 0] == 0).all()


def test_reference_logprobs_come_from_the_initial_weights(runs):
    run = runs["one_worker_2x4"]
    reference = run.policy.get_reference_policy_logprobs(run.data)["reference_policy_logprobs"]
    current = run.policy.get_logprobs(run.data)["logprobs"]
    torch.testing.assert_close(reference, run.initial_logprobs, atol=0, rtol=0)
    assert not torch.allclose(current, run.initial_logprobs, atol=1e-3)


def test_get_weights_sends_only_changed_tensors(runs, ray_session):
    run = runs["one_worker_8x1"]
    assert ray_session.get(run.policy.get_weights(only_changed=True)) == {}
    run.policy.train(run.data, NLLLoss())
    changed = ray_session.get(run.policy.get_weights(only_changed=True))
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert set(changed) <= set(run.weights)


def test_save_then_load_reproduces_logprobs_exactly(runs, tmp_path):
    run = runs["two_workers_2x4"]
    run.policy.save_checkpoint(tmp_path / "ckpt")
    saved = run.policy.get_logprobs(run.data)["logprobs"]
    run.policy.train(run.data, NLLLoss())
    assert not torch.equal(run.policy.get_logprobs(run.data)["logprobs"], saved)
    run.policy.load_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(run.policy.get_logprobs(run.data)["logprobs"], saved, atol=0, rtol=0)


def test_export_then_from_pretrained_reproduces_logprobs(runs, tmp_path):
    run = runs["two_workers_2x4"]
    run.policy.export_hf(tmp_path / "hf")
    logprobs = run.policy.get_logprobs(run.data)["logprobs"]
    torch.testing.assert_close(direct_logprobs(tmp_path / "hf", run.data), logprobs, atol=1e-5, rtol=0)


def test_evaluate_reports_loss_without_changing_weights(runs, ray_session):
    run = runs["one_worker_packed"]
    before = copy.deepcopy(ray_session.get(run.policy.get_weights(only_changed=False)))
    metrics = run.policy.evaluate(run.data, NLLLoss())
    after = ray_session.get(run.policy.get_weights(only_changed=False))
    assert metrics["loss"][0] > 0
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_reward_model_scores_ignore_padding_and_order_and_bradley_terry_training_separates_pairs(
    runs, model_dir
):
    """On 2 workers (in the processes of the two-worker run's policy)."""
    host = runs["two_workers_2x4"].policy.worker_group
    cfg = policy_config(model_dir, model_kind="reward_model", train_micro_batch_size=2)
    policy = Policy(host.cluster, cfg, host=host)
    try:
        data = make_train_data()
        data["sample_mask"] = torch.ones(NUM_ROWS)  # rows (2i, 2i+1) are (chosen, rejected) pairs
        scores = policy.get_scores(data)["scores"]  # [B]
        order = list(reversed(range(NUM_ROWS)))
        wider = data.select_indices(order)
        wider["input_ids"] = torch.nn.functional.pad(wider["input_ids"], (0, 5), value=7)  # junk past lengths
        wider["token_mask"] = torch.nn.functional.pad(wider["token_mask"], (0, 5))
        torch.testing.assert_close(policy.get_scores(wider)["scores"], scores.flip(0), atol=1e-5, rtol=0)
        losses = [policy.train(data, BradleyTerryLoss())["loss"][0] for _ in range(NUM_STEPS)]
        assert losses[-1] < losses[0]
    finally:
        policy.shutdown()


def test_value_model_starts_at_zero_learns_returns_and_exports_values_aligned_with_logprobs(
    runs, model_dir, tmp_path
):
    """A PPO critic on 2 workers (in the processes of the two-worker run's policy, as GRPO hosts it on
    CPUs): a new head predicts 0 everywhere; value-loss steps toward returns of 1 on the trained tokens
    lower the loss; the exported model's head at position t - 1 is the value at t (the state before token
    t), with 0 at position 0 and past each length."""
    host = runs["two_workers_2x4"].policy.worker_group
    policy = Policy(host.cluster, policy_config(model_dir, model_kind="value_model"), host=host)
    try:
        data = make_train_data()
        assert torch.equal(policy.get_values(data)["values"], torch.zeros(NUM_ROWS, SEQ_LEN))
        data["returns"] = data["token_mask"].float()  # [B, T]
        data["prev_values"] = torch.zeros(NUM_ROWS, SEQ_LEN)
        loss_fn = ValueLoss(ValueLossConfig(value_clip=None))
        losses = [policy.train(data, loss_fn)["loss"][0] for _ in range(NUM_STEPS)]
        assert losses[0] == pytest.approx(0.5) and losses[-1] < 0.5 * losses[0]  # 0.5 * (0 - 1)^2 at first
        values = policy.get_values(data)["values"]  # [B, T]
        policy.export_hf(str(tmp_path / "critic"))
    finally:
        policy.shutdown()
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    lengths = data["input_lengths"]
    real = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, T]
    with torch.no_grad():
        head = model(input_ids=data["input_ids"], attention_mask=real).logits.squeeze(-1)  # [B, T]
    expected = torch.zeros(NUM_ROWS, SEQ_LEN)
    for row in range(NUM_ROWS):
        expected[row, 1 : lengths[row]] = head[row, : lengths[row] - 1]
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)


def test_activation_checkpointing_recomputes_to_the_same_update(runs):
    assert_same_training(runs["one_worker_activation_checkpointing"], runs["one_worker_2x4"])


def test_cpu_workers_describe_their_device_and_backend(runs):
    ranks = runs["two_workers_2x4"].policy.describe()
    assert [(r["device"], r["backend"], r["world_size"]) for r in ranks] == [("cpu", "gloo", 2)] * 2
