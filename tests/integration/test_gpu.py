"""The CUDA paths, on real Ray workers holding the GPU (skipped without one): FSDP2 over NCCL trains like
the CPU backend, colocated CUDA generation agrees with the trainer's logprobs and refits, bf16 mixed
precision trains, checkpoints round-trip on the device, and a short GRPO run works on the GPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_grpo import run_grpo
from test_hf_generation import PROMPTS, make_prompt_batch, prompt_ids, reference_greedy, unpadded_outputs
from test_policy import NUM_STEPS, make_train_data, policy_config

from posttrain.algorithms.loss import NLLLoss
from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import GenerationConfig, HFGeneration
from posttrain.workers.policy import Policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelFromConfig(hidden_size=64, num_layers=2, num_attention_heads=2, intermediate_size=128)
    return build_model_dir(cfg, tmp_path_factory.mktemp("gpu_model"))


def make_policy(model_dir, num_gpus: float, **overrides) -> tuple[RayVirtualCluster, Policy]:
    cluster = RayVirtualCluster(
        ClusterConfig(workers_per_node=1, num_cpus_per_worker=1.0, num_gpus_per_worker=num_gpus)
    )
    return cluster, Policy(cluster, policy_config(model_dir, **overrides))


def train_losses(model_dir, num_gpus: float, **overrides) -> tuple[torch.Tensor, list[float], list[dict]]:
    """Initial logprobs, NUM_STEPS losses and the workers' description of one policy."""
    cluster, policy = make_policy(model_dir, num_gpus, **overrides)
    try:
        data = make_train_data()
        logprobs = policy.get_logprobs(data)["logprobs"]
        losses = [policy.train(data, NLLLoss())["loss"][0] for _ in range(NUM_STEPS)]
        return logprobs, losses, policy.describe()
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_nccl_policy_on_the_gpu_trains_like_the_cpu_policy(ray_session, model_dir):
    cpu_logprobs, cpu_losses, cpu_ranks = train_losses(model_dir, num_gpus=0.0)
    gpu_logprobs, gpu_losses, gpu_ranks = train_losses(model_dir, num_gpus=1.0)
    assert cpu_ranks[0]["backend"] == "gloo" and cpu_ranks[0]["device"] == "cpu"
    assert gpu_ranks[0]["backend"] == "nccl" and gpu_ranks[0]["device"].startswith("cuda")
    torch.testing.assert_close(gpu_logprobs, cpu_logprobs, atol=1e-4, rtol=0)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    assert gpu_losses[-1] < gpu_losses[0]


def test_bf16_mixed_precision_trains_close_to_fp32(ray_session, model_dir):
    _, fp32_losses, _ = train_losses(model_dir, num_gpus=1.0)
    _, bf16_losses, _ = train_losses(model_dir, num_gpus=1.0, precision="bfloat16")
    assert bf16_losses == pytest.approx(fp32_losses, rel=3e-2)
    assert bf16_losses[-1] < bf16_losses[0]


def test_checkpoint_round_trip_on_the_gpu_reproduces_logprobs(ray_session, model_dir, tmp_path):
    cluster, policy = make_policy(model_dir, num_gpus=1.0)
    try:
        data = make_train_data()
        policy.train(data, NLLLoss())
        policy.save_checkpoint(tmp_path / "ckpt")
        saved = policy.get_logprobs(data)["logprobs"]
        policy.train(data, NLLLoss())
        assert not torch.equal(policy.get_logprobs(data)["logprobs"], saved)
        policy.load_checkpoint(tmp_path / "ckpt")
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], saved, atol=0, rtol=0)
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_colocated_cuda_generation_agrees_with_training_and_refits(ray_session, model_dir, tmp_path):
    """Generation and training share the GPU (half each). Sampled tokens' logprobs agree with the trainer's
    (mean exp|delta| <= 1.01, fp32); after a training step and a refit, greedy decoding equals decoding
    with the trained weights exported and run on the CPU."""
    cluster, policy = make_policy(model_dir, num_gpus=1.0)
    generation = HFGeneration(
        cluster, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, colocated=True), str(model_dir)
    )
    try:
        tokenizer = load_tokenizer(model_dir)
        prompts = make_prompt_batch(tokenizer, PROMPTS)
        out = generation.generate(prompts, seed=0)
        rows = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        training = policy.get_logprobs(rows)["logprobs"]
        positions = torch.arange(out["output_ids"].shape[1])[None]
        generated = (positions >= prompts["input_lengths"][:, None]) & (
            positions < rows["input_lengths"][:, None]
        )
        error = torch.exp((training - out["logprobs"]).abs())[generated].mean()
        assert 1.0 <= float(error) <= 1.01

        policy.train(make_train_data(), NLLLoss())
        generation.update_weights(policy.get_weights())
        greedy = generation.generate(prompts, greedy=True)
        policy.export_hf(tmp_path / "trained")
        model = load_model(tmp_path / "trained").eval()
        expected = [
            reference_greedy(model, prompt_ids(prompts, i), MAX_NEW_TOKENS, tokenizer.eos_token_id)
            for i in range(len(PROMPTS))
        ]
        assert unpadded_outputs(greedy) == expected
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def test_a_short_grpo_run_on_the_gpu_keeps_logprobs_consistent(ray_session, tmp_path):
    steps = run_grpo(
        tmp_path,
        **{"grpo.max_num_steps": 3, "cluster.num_gpus_per_worker": 1.0, "cluster.num_cpus_per_worker": 1.0},
    )
    for step in (1, 2, 3):
        assert 1.0 <= steps[step]["train/token_mult_prob_error"] <= 1.01
        assert steps[step]["timing/generation"] > 0 and steps[step]["timing/training"] > 0


def test_offload_frees_the_gpu_and_onload_resumes_training_unchanged(ray_session, model_dir):
    """Colocated generation needs the memory: offload moves weights and optimizer state to the CPU; after
    onload the next steps equal those of a policy that never left the GPU."""
    _, reference_losses, _ = train_losses(model_dir, num_gpus=1.0)
    cluster, policy = make_policy(model_dir, num_gpus=1.0)
    try:
        data = make_train_data()
        losses = [policy.train(data, NLLLoss())["loss"][0]]
        on_device = policy.describe()[0]["memory_allocated"]
        policy.offload()
        # fp32 weights + Adam's two moments leave (gradients are already freed); cuBLAS workspaces stay.
        state_bytes = 3 * 4 * sum(p.numel() for p in load_model(model_dir).parameters())
        assert on_device - policy.describe()[0]["memory_allocated"] >= state_bytes
        policy.onload()
        losses += [policy.train(data, NLLLoss())["loss"][0] for _ in range(NUM_STEPS - 1)]
        assert losses == pytest.approx(reference_losses, rel=1e-5)
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("option", ["cpu_offload", "activation_checkpointing"])
def test_memory_saving_options_train_like_the_default(ray_session, model_dir, option):
    _, reference_losses, _ = train_losses(model_dir, num_gpus=1.0)
    _, losses, _ = train_losses(model_dir, num_gpus=1.0, **{option: True})
    assert losses == pytest.approx(reference_losses, rel=1e-5)


def decode_both_loops(model, tokenizer, cfg: GenerationConfig, greedy: bool):
    """The eager and the static loop on PROMPTS x 3 samples, left-padded on the model's device."""
    from posttrain.workers.generation import decode
    from posttrain.workers.generation.static_decode import static_decode_batch

    prompts = make_prompt_batch(tokenizer, [p for p in PROMPTS for _ in range(3)])
    left_ids, mask = decode.right_to_left_padded(
        prompts["input_ids"], prompts["input_lengths"], tokenizer.pad_token_id
    )
    uniforms = decode.per_sample_uniforms(5, list(range(len(left_ids))), cfg.max_new_tokens)
    eager = decode.decode_batch(model, tokenizer, left_ids, mask, cfg, greedy, uniforms, [[]] * len(left_ids))
    static = static_decode_batch(model, tokenizer, left_ids, mask, cfg, greedy, uniforms, 2)
    return eager, static


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_static_decode_with_cuda_graphs_decodes_what_the_eager_loop_decodes(model_dir, greedy):
    """On the GPU (fp32) the static loop, its steps replayed as CUDA graphs (a new one each time finished
    rows leave), gives the eager loop's tokens and stop flags and logprobs within 1e-4; with the second
    token most samples draw as a stop token, some samples end early."""
    model, tokenizer = load_model(model_dir).cuda().eval(), load_tokenizer(model_dir)
    probe, _ = decode_both_loops(
        model, tokenizer, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[]), greedy
    )
    first = Counter(ids[1] for ids in probe.generated_ids)
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[first.most_common(1)[0][0]])
    eager, static = decode_both_loops(model, tokenizer, cfg, greedy)
    assert (
        any(eager.stopped) and static.generated_ids == eager.generated_ids and static.stopped == eager.stopped
    )
    for got, expected in zip(static.generated_logprobs, eager.generated_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


@torch.inference_mode()
def test_replayed_static_steps_make_no_host_sync(model_dir):
    """Under torch.cuda.set_sync_debug_mode("error") a step that waits for the device raises: the static
    loop's replayed steps run through, the eager loop's first step (its tokens to the host) raises."""
    from posttrain.workers.generation import decode
    from posttrain.workers.generation.static_decode import StaticDecoder

    model, tokenizer = load_model(model_dir).cuda().eval(), load_tokenizer(model_dir)
    prompts = make_prompt_batch(tokenizer, PROMPTS)
    left_ids, mask = decode.right_to_left_padded(
        prompts["input_ids"], prompts["input_lengths"], tokenizer.pad_token_id
    )
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[1])
    uniforms = decode.per_sample_uniforms(0, list(range(len(PROMPTS))), MAX_NEW_TOKENS)
    decoder = StaticDecoder(model, cfg, False, [1])
    rows = decoder.start(left_ids, mask, uniforms)
    decoder.run_step(rows)  # eager warm-up and capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            decoder.run_step(rows)
        with pytest.raises(RuntimeError, match="synchroniz"):
            decode.decode_batch(model, tokenizer, left_ids, mask, cfg, False, uniforms, [[]] * len(PROMPTS))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(decoder.step_index) == 6


def test_colocated_device_refit_is_the_next_generation(ray_session, model_dir, tmp_path):
    """One policy rank and its generation worker on one GPU: the policy's weights go into a flat buffer in the
    GPU's memory that the generation worker opens through CUDA IPC (the handle carries no file). Sampled
    logprobs of the static loop agree with the trainer's (mean exp|delta| <= 1.01); after a training step and
    the same buffer rewritten, greedy decoding equals the trained weights exported and decoded on the CPU."""
    from posttrain.distributed.shared_weights import SharedWeights

    cluster, policy = make_policy(model_dir, num_gpus=1.0)
    gen_cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, colocated=True, decode_loop="static")
    generation = HFGeneration(cluster, gen_cfg, str(model_dir))
    try:
        tokenizer = load_tokenizer(model_dir)
        prompts = make_prompt_batch(tokenizer, PROMPTS)
        handle = policy.share_weights(on_device=True)
        assert isinstance(handle, SharedWeights) and handle.cuda_ipc is not None and handle.path == ""
        generation.update_weights(handle)
        out = generation.generate(prompts, seed=0)
        rows = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        positions = torch.arange(out["output_ids"].shape[1])[None]
        generated = (positions >= prompts["input_lengths"][:, None]) & (
            positions < rows["input_lengths"][:, None]
        )
        error = torch.exp((policy.get_logprobs(rows)["logprobs"] - out["logprobs"]).abs())[generated].mean()
        assert 1.0 <= float(error) <= 1.01

        policy.train(make_train_data(), NLLLoss())
        assert policy.share_weights(on_device=True) == handle  # the same buffer, rewritten in place
        generation.update_weights(handle)
        greedy = generation.generate(prompts, greedy=True)
        policy.export_hf(tmp_path / "trained")
        model = load_model(tmp_path / "trained").eval()
        expected = [
            reference_greedy(model, prompt_ids(prompts, i), MAX_NEW_TOKENS, tokenizer.eos_token_id)
            for i in range(len(PROMPTS))
        ]
        assert unpadded_outputs(greedy) == expected
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()
