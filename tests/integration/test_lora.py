"""LoRA (peft) on real FSDP2 workers: only the adapter trains and refits, 1 and 2 workers agree, the
reference policy is the base model with the adapter disabled, adapter-only checkpoints resume exactly,
and exports (PEFT adapter, merged model) reproduce the trained policy's logprobs."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from test_policy import make_train_data as policy_train_data
from tiny_model import TINY
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.algorithms.loss import NLLLoss
from posttrain.algorithms.preference_loss import BradleyTerryLoss
from posttrain.cli import main as posttrain_main
from posttrain.config import validate_config
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.models.lora import ADAPTER_DIR, AdapterWeights
from posttrain.utils.safe_dcp import read_metadata_safely
from posttrain.workers.generation import GenerationConfig, HFGeneration
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.handle import Policy

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

NUM_ROWS, SEQ_LEN = 8, 12
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "dropout": 0.0}
# Qwen2, hidden 32, 2 layers, MLP 64, rank 4 on q,k,v,o (32 -> 32) and gate, up (32 -> 64), down (64 -> 32):
# r * (in + out) = 4 * 64 = 256 for each attention projection, 4 * 96 = 384 for each MLP one, so a layer has
# 4 * 256 + 3 * 384 = 2176 adapter parameters and the model 4352: 17,408 bytes in fp32.
ADAPTER_BYTES = 4352 * 4
NUM_ADAPTER_TENSORS = 2 * 7 * 2  # layers x modules x (A, B)


def make_train_data() -> BatchedDataDict:
    """test_policy's rows (lengths 5..12, every real token but the first trained) with no row masked out."""
    data = policy_train_data(NUM_ROWS, SEQ_LEN)
    data["sample_mask"] = torch.ones(NUM_ROWS)
    return data


def direct_logprobs(model: torch.nn.Module, data: BatchedDataDict) -> torch.Tensor:
    """log p(token t | < t) from a plain single-process forward of `model`, 0 at position 0 and padding."""
    input_ids, lengths = data["input_ids"], data["input_lengths"]
    real = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, T]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=real).logits.float()  # [B, T, V]
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)) * real  # [B, T]


def start_policy(model_dir, num_workers: int, init_reference_model: bool = False, **overrides):
    cfg = validate_config(
        PolicyConfig,
        dict(
            model_name=str(model_dir),
            train_global_batch_size=NUM_ROWS,
            train_micro_batch_size=2,
            logprob_batch_size=4,
            max_grad_norm=1.0,
            seed=0,
            lora=LORA,
            optimizer={"name": "AdamW", "kwargs": {"lr": 2e-2, "weight_decay": 0.0}},
            **overrides,
        ),
    )
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
    return cluster, Policy(cluster, cfg, init_reference_model)


def train_losses(policy: Policy, data: BatchedDataDict, num_steps: int) -> list[float]:
    return train_losses_of(policy, data, NLLLoss(), num_steps)


def train_losses_of(policy: Policy, data: BatchedDataDict, loss_fn, num_steps: int) -> list[float]:
    return [policy.train(data, loss_fn)["loss"][0] for _ in range(num_steps)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelFromConfig(**TINY)
    return build_model_dir(cfg, tmp_path_factory.mktemp("lora_base"))


@pytest.fixture(scope="module")
def lora(ray_session, model_dir, tmp_path_factory):
    """One LoRA policy on 1 worker (2 steps, checkpoint, 2 steps) and one on 2 workers (4 steps, then it
    loads that checkpoint and trains the same 2 steps again). What the tests compare is recorded here."""
    out = tmp_path_factory.mktemp("lora_run")
    data = make_train_data()
    one_cluster, one = start_policy(model_dir, 1, init_reference_model=True)
    two_cluster, two = start_policy(model_dir, 2)
    found = {"data": data, "policy": one, "checkpoint": out / "step_2", "out": out}
    found["footprint"] = one.memory_footprint()[0]
    found["one_losses"] = train_losses(one, data, 2)
    one.save_checkpoint(str(found["checkpoint"] / "policy"))
    found["checkpoint_logprobs"] = one.get_logprobs(data)["logprobs"]
    found["one_losses"] += train_losses(one, data, 2)
    found["two_losses"] = train_losses(two, data, 4)
    two.load_checkpoint(str(found["checkpoint"] / "policy"))
    found["resumed_losses"] = train_losses(two, data, 2)
    found["payload"] = ray_session.get(one.get_weights(only_changed=False))
    found["refit_bytes"] = one.last_weights_bytes()
    found["footprint_after"] = one.memory_footprint()[0]
    found["trained_logprobs"] = one.get_logprobs(data)["logprobs"]
    found["reference_logprobs"] = one.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
    one.export_hf(str(out / "hf_model"))
    two.shutdown()
    two_cluster.shutdown()
    yield found
    one.shutdown()
    one_cluster.shutdown()


def test_lora_trains_only_the_adapter_and_the_optimizer_holds_only_its_state(lora):
    """Trainable bytes = the 17,408 adapter bytes derived above; AdamW keeps exp_avg and exp_avg_sq
    (2 x 17,408) and a 4-byte step per adapter tensor (28): 34,928 bytes, none for the frozen base."""
    footprint = lora["footprint"]
    assert footprint["trainable_param_bytes"] == ADAPTER_BYTES
    assert footprint["param_bytes"] > 5 * ADAPTER_BYTES
    assert footprint["optimizer_state_bytes"] == 0  # before the first step
    assert lora["footprint_after"]["optimizer_state_bytes"] == 2 * ADAPTER_BYTES + 4 * NUM_ADAPTER_TENSORS
    losses = lora["one_losses"]
    assert losses[-1] < losses[0] - 0.1


def test_lora_one_and_two_workers_give_the_same_losses(lora):
    assert lora["two_losses"] == pytest.approx(lora["one_losses"], abs=1e-5)


def test_lora_checkpoint_holds_the_adapter_and_resumes_like_the_uninterrupted_run(lora):
    policy_dir = lora["checkpoint"] / "policy"
    model_keys = read_metadata_safely(policy_dir / "model" / ".metadata").state_dict_metadata.keys()
    assert len(model_keys) == NUM_ADAPTER_TENSORS and all(".lora_" in key for key in model_keys)
    optim_keys = read_metadata_safely(policy_dir / "optim" / ".metadata").state_dict_metadata.keys()
    assert optim_keys and all(".lora_" in key for key in optim_keys if key.startswith("state."))
    # Saved after step 2 on 1 worker, loaded into 2 workers that had trained on: steps 3 and 4 again.
    assert lora["resumed_losses"] == pytest.approx(lora["one_losses"][2:], abs=1e-5)


def test_reference_logprobs_with_the_adapter_disabled_equal_the_base_model(lora, model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = direct_logprobs(base, lora["data"])
    torch.testing.assert_close(lora["reference_logprobs"], expected, atol=1e-5, rtol=0)
    assert (lora["trained_logprobs"] - expected).abs().max() > 0.1  # the adapter did change the policy


def test_refit_sends_only_the_adapter(lora):
    payload = lora["payload"]
    assert isinstance(payload, AdapterWeights)
    assert len(payload.tensors) == NUM_ADAPTER_TENSORS
    assert all(".lora_A." in name or ".lora_B." in name for name in payload.tensors)
    assert payload.num_bytes == lora["refit_bytes"] == ADAPTER_BYTES


def test_hf_generation_applies_the_adapter_to_its_resident_base(lora, model_dir, ray_session):
    """Logprobs of the sampled tokens under the refitted generation workers equal the policy's."""
    generation = HFGeneration(None, GenerationConfig(max_new_tokens=6, colocated=False), str(model_dir))
    try:
        generation.update_weights(ray_session.put(lora["payload"]))
        prompts = BatchedDataDict(
            input_ids=lora["data"]["input_ids"][:, :4], input_lengths=torch.full((NUM_ROWS,), 4)
        )
        outputs = generation.generate(prompts, seed=3)
    finally:
        generation.shutdown()
    sequences = BatchedDataDict(
        input_ids=outputs["output_ids"], input_lengths=outputs["unpadded_sequence_lengths"]
    )
    policy_logprobs = lora["policy"].get_logprobs(sequences)["logprobs"]
    generated = outputs["logprobs"] != 0
    torch.testing.assert_close(outputs["logprobs"][generated], policy_logprobs[generated], atol=1e-5, rtol=0)


def assert_exports_reproduce(checkpoint, out, model_dir, data, checkpoint_logprobs, final_logprobs) -> None:
    """`posttrain export` of `checkpoint` as a PEFT adapter (on the base model) and `--merge`d give the
    checkpoint's logprobs; the run's end-of-run `hf_model` (merged, adapter beside it) gives the final
    ones."""
    assert posttrain_main(["export", str(checkpoint), str(out / "adapter")]) == 0
    assert posttrain_main(["export", str(checkpoint), str(out / "merged"), "--merge"]) == 0
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    torch.testing.assert_close(direct_logprobs(with_adapter, data), checkpoint_logprobs, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(direct_logprobs(merged, data), checkpoint_logprobs, atol=1e-5, rtol=0)
    final = AutoModelForCausalLM.from_pretrained(out / "hf_model", dtype=torch.float32).eval()
    torch.testing.assert_close(direct_logprobs(final, data), final_logprobs, atol=1e-5, rtol=0)
    assert (out / "hf_model" / ADAPTER_DIR / "adapter_config.json").is_file()


def test_export_writes_a_peft_adapter_and_a_merged_model_equal_to_the_policy(lora, model_dir):
    assert_exports_reproduce(
        lora["checkpoint"],
        lora["out"],
        model_dir,
        lora["data"],
        lora["checkpoint_logprobs"],
        lora["trained_logprobs"],
    )


@pytest.fixture(scope="module")
def lora_tp(lora, model_dir, ray_session, tmp_path_factory):
    """The 1-worker run of `lora` again with tensor_parallel_size=2 (2 workers, one model split in two): 4
    steps with a checkpoint after 2, its refit payload, reference logprobs and end-of-run export; then it
    loads the 1-worker run's step-2 checkpoint and trains steps 3 and 4 again."""
    out = tmp_path_factory.mktemp("lora_tp")
    data = lora["data"]
    cluster, policy = start_policy(model_dir, 2, init_reference_model=True, tensor_parallel_size=2)
    found = {"out": out, "checkpoint": out / "step_2"}
    try:
        found["footprints"] = policy.memory_footprint()
        found["losses"] = train_losses(policy, data, 2)
        policy.save_checkpoint(str(found["checkpoint"] / "policy"))
        found["losses"] += train_losses(policy, data, 2)
        found["payload"] = ray_session.get(policy.get_weights(only_changed=False))
        found["refit_bytes"] = policy.last_weights_bytes()
        found["trained_logprobs"] = policy.get_logprobs(data)["logprobs"]
        found["reference_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_policy_logprobs"]
        policy.export_hf(str(out / "hf_model"))
        policy.load_checkpoint(str(lora["checkpoint"] / "policy"))
        found["resumed_losses"] = train_losses(policy, data, 2)
    finally:
        policy.shutdown()
        cluster.shutdown()
    return found


def test_lora_tensor_parallel_pair_trains_like_one_worker_and_refits_full_adapters(lora, lora_tp):
    """q,k,v,gate,up: base and B column-parallel, A replicated; o,down: base and A row-parallel, B
    replicated. Same losses and logprobs as one worker; the payload holds the full (gathered) adapter."""
    # Each rank holds A whole and half of B for q, k, v (4x32 + 32x4/2 = 192 each) and gate, up (4x32 +
    # 64x4/2 = 256 each), half of A and B whole for o (4x32/2 + 32x4 = 192) and down (4x64/2 + 32x4 = 256):
    # 1536 per layer, 3072 x 4 bytes = 12,288 of the 17,408 adapter bytes.
    assert [footprint["trainable_param_bytes"] for footprint in lora_tp["footprints"]] == [12_288, 12_288]
    assert lora_tp["losses"] == pytest.approx(lora["one_losses"], abs=1e-5)
    torch.testing.assert_close(lora_tp["trained_logprobs"], lora["trained_logprobs"], atol=1e-5, rtol=0)
    payload, expected = lora_tp["payload"], lora["payload"]
    assert isinstance(payload, AdapterWeights) and payload.tensors.keys() == expected.tensors.keys()
    assert payload.num_bytes == lora_tp["refit_bytes"] == ADAPTER_BYTES
    for name, tensor in expected.tensors.items():
        assert payload.tensors[name].shape == tensor.shape and payload.tensors[name].dtype == tensor.dtype
        torch.testing.assert_close(payload.tensors[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_lora_tensor_parallel_reference_and_export(lora_tp, lora, model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = direct_logprobs(base, lora["data"])
    torch.testing.assert_close(lora_tp["reference_logprobs"], expected, atol=1e-5, rtol=0)
    final = AutoModelForCausalLM.from_pretrained(lora_tp["out"] / "hf_model", dtype=torch.float32).eval()
    torch.testing.assert_close(
        direct_logprobs(final, lora["data"]), lora_tp["trained_logprobs"], atol=1e-5, rtol=0
    )


def test_lora_checkpoints_move_between_tensor_parallel_layouts(lora, lora_tp, model_dir):
    """The 1-worker step-2 checkpoint resumes at TP 2 with the uninterrupted losses; the TP 2 step-2
    checkpoint holds the full adapter tensors, so `posttrain export` (one process) reproduces the 1-worker
    policy at step 2."""
    assert lora_tp["resumed_losses"] == pytest.approx(lora["one_losses"][2:], abs=1e-5)
    policy_dir = lora_tp["checkpoint"] / "policy"
    model_keys = read_metadata_safely(policy_dir / "model" / ".metadata").state_dict_metadata.keys()
    assert len(model_keys) == NUM_ADAPTER_TENSORS and all(".lora_" in key for key in model_keys)
    out = lora_tp["out"]
    assert posttrain_main(["export", str(lora_tp["checkpoint"]), str(out / "adapter")]) == 0
    assert posttrain_main(["export", str(lora_tp["checkpoint"]), str(out / "merged"), "--merge"]) == 0
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    data, expected = lora["data"], lora["checkpoint_logprobs"]
    torch.testing.assert_close(direct_logprobs(with_adapter, data), expected, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(direct_logprobs(merged, data), expected, atol=1e-5, rtol=0)


def test_grpo_with_lora_refits_the_adapter_only_and_generation_matches_training(ray_session, tmp_path):
    """Step 1 generates with the initial weights (no refit); step 2's refit is the rank-4 adapter of the
    same 32-wide 2-layer model as above (17,408 bytes), and the generation workers' logprobs of the
    sampled tokens then match the trainer's (token_mult_prob_error ~ 1)."""
    from test_grpo import run_grpo

    steps = run_grpo(
        tmp_path,
        **{
            "grpo.max_num_steps": 2,
            "grpo.val_period": 0,
            "policy.lora.enabled": "true",
            "policy.lora.rank": 4,
            "policy.lora.alpha": 8,
        },
    )
    assert steps[1]["train/refit_bytes"] == 0
    assert steps[2]["train/refit_bytes"] == ADAPTER_BYTES
    assert 1.0 <= steps[2]["train/token_mult_prob_error"] <= 1.001


def test_reward_model_with_lora_trains_its_score_head_and_exports_merged(ray_session, model_dir, tmp_path):
    """The fresh `score` head trains in full (modules_to_save) beside the adapters; the merged export of
    the adapter-only checkpoint scores like the policy."""
    cluster, policy = start_policy(model_dir, 1, model_kind="reward_model")
    try:
        data = make_train_data()  # rows (2i, 2i + 1) are (chosen, rejected) pairs
        losses = train_losses_of(policy, data, BradleyTerryLoss(), 3)
        policy.save_checkpoint(str(tmp_path / "step_3" / "policy"))
        scores = policy.get_scores(data)["scores"]
        trainable = policy.memory_footprint()[0]["trainable_param_bytes"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    assert losses[-1] < losses[0]
    assert trainable == ADAPTER_BYTES + 32 * 4  # the adapters and the 1 x 32 score head
    assert posttrain_main(["export", str(tmp_path / "step_3"), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    lengths = data["input_lengths"]
    real = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths.unsqueeze(1)).long()
    pad_id = merged.config.pad_token_id
    input_ids = torch.where(real.bool(), data["input_ids"], torch.full_like(data["input_ids"], pad_id))
    with torch.no_grad():
        merged_scores = merged(input_ids=input_ids, attention_mask=real).logits.squeeze(-1)
    torch.testing.assert_close(merged_scores, scores, atol=1e-5, rtol=0)
