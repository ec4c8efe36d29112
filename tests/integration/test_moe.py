"""Mixture-of-experts models end to end on the DTensor worker and the HF generation path: router replay
makes the trainer route every generated token like the bf16 generator did and brings its logprobs closer to
the generator's; an exported MoE loads back in transformers and generates the same greedy tokens.

The worker runs in this process (a 1-rank gloo group), the generator is posttrain's own decode loop on a
bf16 copy of the model, as a generation worker runs it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.models.moe import moe_routers
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.decode import (
    assemble_outputs,
    decode_batch,
    merge_stop_strings,
    per_sample_uniforms,
    right_to_left_padded,
)
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.dtensor import DTensorPolicyWorker

MOE = ModelFromConfig(
    architecture="qwen3_moe",
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_experts=8,
    num_experts_per_token=2,
    expert_intermediate_size=64,
    seed=1,
)
PROMPTS = ["12+34=", "7+8=", "hello ", "99+1="] * 4


@dataclass
class Rollout:
    data: dict[str, torch.Tensor]  # what GRPO trains on: input_ids, lengths, token_mask, routed_experts
    generation_logprobs: torch.Tensor  # [B, T]


def generate(model_dir, precision: str, greedy: bool = False, max_new_tokens: int = 24) -> Rollout:
    """Sample (or greedily decode) PROMPTS with posttrain's decode loop on a `precision` copy."""
    tokenizer = load_tokenizer(model_dir)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, precision=precision, stop_token_ids=[])
    model = load_model(model_dir, dtype=getattr(torch, precision)).eval()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    lengths = torch.tensor([len(x) for x in ids])
    input_ids = torch.full((len(ids), int(lengths.max())), tokenizer.pad_token_id)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
    left_ids, attention_mask = right_to_left_padded(input_ids, lengths, tokenizer.pad_token_id)
    uniforms = per_sample_uniforms(0, list(range(len(ids))), max_new_tokens)
    stops = merge_stop_strings(cfg, None, len(ids))
    state = decode_batch(model, tokenizer, left_ids, attention_mask, cfg, greedy, uniforms, stops)
    out = assemble_outputs(input_ids, lengths, state, tokenizer.pad_token_id)
    positions = torch.arange(out["output_ids"].shape[1])[None]
    token_mask = (positions >= lengths[:, None]) & (positions < out["unpadded_sequence_lengths"][:, None])
    data = {
        "input_ids": out["output_ids"],
        "input_lengths": out["unpadded_sequence_lengths"],
        "token_mask": token_mask.float(),
        "routed_experts": out["routed_experts"],
    }
    return Rollout(data, out["logprobs"])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_model_dir(MOE, tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def bf16_rollout(moe_dir) -> Rollout:
    return generate(moe_dir, "bfloat16")


def trainer_logprobs_and_experts(worker, data) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The worker's logprobs [B, T] and, per MoE layer, the experts its experts modules computed with for
    every position [B, T, k] (read where the experts receive them, after any replay)."""
    used = []
    experts = [router_owner.experts for router_owner in moe_blocks(worker.model)]
    hooks = [e.register_forward_pre_hook(lambda m, args: used.append(args[1])) for e in experts]
    try:
        logprobs = worker.get_logprobs(data)["logprobs"]
    finally:
        for hook in hooks:
            hook.remove()
    batch, width = data["input_ids"].shape
    return logprobs, [u.reshape(batch, width, -1) for u in used]


def moe_blocks(model):
    routers = set(map(id, moe_routers(model)))
    return [m for m in model.modules() if id(getattr(m, "gate", None)) in routers]


def mismatch(generation_logprobs, trainer_logprobs, token_mask) -> tuple[float, float]:
    """(token_mult_prob_error as GRPO logs it: mean exp(|diff|); KL(generator || trainer) estimated on the
    generator's samples with the non-negative k3 estimator: mean(exp(r) - 1 - r), r = train - gen), over
    the generated tokens."""
    mask = token_mask.bool()
    log_ratio = (trainer_logprobs - generation_logprobs)[mask]
    return float(log_ratio.abs().exp().mean()), float((log_ratio.exp() - 1 - log_ratio).mean())


def test_router_replay_routes_every_generated_token_as_the_bf16_generator_did(moe_dir, bf16_rollout):
    """bf16 generation, fp32 training. With replay the trainer's experts equal the generator's at every
    recorded position (all generated tokens but each sample's last, which the generator never fed back);
    without it some (token, layer) pairs differ, and the logprob mismatch is larger."""
    data = bf16_rollout.data
    routed = data["routed_experts"].long()  # [B, T, L, k]
    recorded = (routed >= 0).all(-1).all(-1)  # [B, T]
    expected = data["token_mask"].bool().clone()
    expected[torch.arange(len(PROMPTS)), data["input_lengths"] - 1] = False  # the last token: never fed
    assert torch.equal(recorded, expected)

    results = {}
    for replay in (True, False):
        cfg = PolicyConfig(model_name=str(moe_dir), logprob_batch_size=len(PROMPTS))  # one forward
        cfg.moe.router_replay = replay
        worker = DTensorPolicyWorker(cfg)
        logprobs, used = trainer_logprobs_and_experts(worker, data)
        same = torch.stack(
            [
                (u.sort(-1).values == routed[:, :, layer].sort(-1).values).all(-1)
                for layer, u in enumerate(used)
            ]
        )  # [L, B, T]
        results[replay] = (
            same[:, recorded],
            mismatch(bf16_rollout.generation_logprobs, logprobs, data["token_mask"]),
        )
        worker.shutdown()
    replayed_same, (error_on, kl_on) = results[True]
    own_same, (error_off, kl_off) = results[False]
    print(f"flipped (token, layer) pairs without replay: {1 - own_same.float().mean():.4f}")
    print(f"token_mult_prob_error: replay {error_on:.6f}, no replay {error_off:.6f}")
    print(f"KL(generator || trainer): replay {kl_on:.3e}, no replay {kl_off:.3e}")
    assert bool(replayed_same.all())  # token by token, layer by layer
    assert not bool(own_same.all())  # bf16 really routes some tokens elsewhere
    assert 1.0 < error_on < error_off
    assert 0 < kl_on < kl_off


def test_an_exported_moe_reloads_in_transformers_and_decodes_the_same_greedy_tokens(moe_dir, tmp_path):
    """The worker's HF export (fused expert tensors written in transformers' per-expert layout) loads
    with AutoModelForCausalLM and gives the tokens posttrain's decode loop gives from the source model."""
    from transformers import AutoModelForCausalLM

    worker = DTensorPolicyWorker(PolicyConfig(model_name=str(moe_dir)))
    worker.export_hf(str(tmp_path / "export"))
    worker.shutdown()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    reloaded.generation_config.eos_token_id = None  # like the decode below: no stop token
    ours = generate(moe_dir, "float32", greedy=True, max_new_tokens=12).data
    tokenizer = load_tokenizer(tmp_path / "export")
    for i, prompt in enumerate(PROMPTS[:4]):
        prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        theirs = reloaded.generate(prompt_ids, max_new_tokens=12, do_sample=False)
        length = int(ours["input_lengths"][i])
        assert theirs[0].tolist() == ours["input_ids"][i, :length].tolist()


def sft_batch(rollout: Rollout) -> dict[str, torch.Tensor]:
    return {key: rollout.data[key] for key in ("input_ids", "input_lengths", "token_mask")}


def test_router_losses_add_their_coefficients_times_the_logged_values_to_the_loss(moe_dir, bf16_rollout):
    """The same SFT batch evaluated with both coefficients 0 and with 0.5 / 0.25: the loss grows by exactly
    0.5 x moe_load_balancing_loss + 0.25 x moe_z_loss (as logged), and the expert load sums to the
    step's real tokens x k per layer."""
    from posttrain.algorithms.loss import NLLLoss

    batch = sft_batch(bf16_rollout)
    results = []
    for coefs in ((0.0, 0.0), (0.5, 0.25)):
        cfg = PolicyConfig(model_name=str(moe_dir), train_global_batch_size=16, train_micro_batch_size=8)
        cfg.moe.load_balancing_coef, cfg.moe.z_loss_coef = coefs
        worker = DTensorPolicyWorker(cfg)
        results.append(worker.train(batch, NLLLoss(), eval_mode=True))
        worker.shutdown()
    plain, weighted = results
    added = 0.5 * plain["moe_load_balancing_loss"][0] + 0.25 * plain["moe_z_loss"][0]
    assert weighted["loss"][0] == pytest.approx(plain["loss"][0] + added, rel=1e-5)
    assert plain["moe_load_balancing_loss"][0] == pytest.approx(2.0, abs=0.5)  # k = 2 when balanced
    share_max, share_min = plain["moe_expert_share_max"][0], plain["moe_expert_share_min"][0]
    assert 0 < share_min <= 1 / 8 <= share_max < 1


def test_lora_on_an_moe_trains_its_adapters_and_exports_merged_weights(moe_dir, bf16_rollout, tmp_path):
    """LoRA adapters on the attention projections of a Qwen3-MoE (its experts are fused tensors, not
    linear layers): one SFT step changes the logprobs, the export merges and reloads with them."""
    from posttrain.algorithms.loss import NLLLoss

    batch = sft_batch(bf16_rollout)
    cfg = PolicyConfig(model_name=str(moe_dir), train_global_batch_size=16, train_micro_batch_size=16)
    cfg.lora.enabled, cfg.optimizer.kwargs["lr"] = True, 1e-2
    worker = DTensorPolicyWorker(cfg)
    before = worker.get_logprobs(batch)["logprobs"]
    worker.train(batch, NLLLoss())
    after = worker.get_logprobs(batch)["logprobs"]
    worker.export_hf(str(tmp_path / "export"))
    worker.shutdown()
    assert not torch.allclose(before, after)
    reloaded = DTensorPolicyWorker(PolicyConfig(model_name=str(tmp_path / "export")))
    torch.testing.assert_close(reloaded.get_logprobs(batch)["logprobs"], after, atol=1e-5, rtol=1e-5)
    reloaded.shutdown()
