"""The static decode loop (static cache and mask, sampling and stop flags on the device, the host reading them
every few steps) gives the eager loop's tokens and logprobs, and its step reads nothing back to the host."""

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from posttrain.models.build import ModelFromConfig, build_model_dir, load_model, load_tokenizer
from posttrain.workers.generation import decode as decoding
from posttrain.workers.generation import static_decode
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker

MAX_NEW_TOKENS = 12
# Uneven prompt lengths (left padding), each prompt three times (one prefill per distinct prompt).
PROMPTS = [p for p in ["12+34=", "7+8=", "99+1= what is it", "5+55=?"] for _ in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = ModelFromConfig(
        architecture="qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        seed=3,
    )
    return build_model_dir(spec, tmp_path_factory.mktemp("static_decode_model"))


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    return load_model(str(model_dir)).eval(), load_tokenizer(str(model_dir))


def left_padded(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    lengths = torch.tensor([len(i) for i in ids])
    padded = torch.full((len(ids), int(lengths.max())), tokenizer.pad_token_id)
    for row, sequence in enumerate(ids):
        padded[row, : len(sequence)] = torch.tensor(sequence)
    return decoding.right_to_left_padded(padded, lengths, tokenizer.pad_token_id)


def both_loops(model, tokenizer, cfg: GenerationConfig, greedy: bool, sync_every: int):
    left_ids, mask = left_padded(tokenizer, PROMPTS)
    uniforms = decoding.per_sample_uniforms(7, list(range(len(PROMPTS))), cfg.max_new_tokens)
    eager = decoding.decode_batch(
        model, tokenizer, left_ids, mask, cfg, greedy, uniforms, [[]] * len(PROMPTS)
    )
    static = static_decode.static_decode_batch(
        model, tokenizer, left_ids, mask, cfg, greedy, uniforms, sync_every
    )
    return eager, static


def early_stop_tokens(model, tokenizer, greedy: bool) -> list[int]:
    """Tokens that most samples draw in their first half: as stop tokens, part of the batch ends early."""
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[])
    probe, _ = both_loops(model, tokenizer, cfg, greedy, 1)
    early = Counter(token for ids in probe.generated_ids for token in set(ids[1 : MAX_NEW_TOKENS // 2]))
    return [token for token, _ in early.most_common(2)]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("sync_every", [1, 3, 64])
def test_static_loop_decodes_what_the_eager_loop_decodes(
    model_and_tokenizer, monkeypatch, greedy, sync_every
):
    """12 samples of uneven prompts, two stop tokens that end some of them early: the static loop's tokens and
    stop flags equal the eager loop's, logprobs within 1e-5 (the static cache attends over masked columns the
    eager one has not grown yet). Reading the flags every step or every 3, finished rows leave the batch
    (compactions recorded); every 64 (past the end), none leave and the stops are found afterwards."""
    model, tokenizer = model_and_tokenizer
    cfg = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=early_stop_tokens(model, tokenizer, greedy)
    )
    sizes = []
    compact = static_decode.StaticDecoder.compact
    monkeypatch.setattr(
        static_decode.StaticDecoder,
        "compact",
        lambda self, rows, keep: sizes.append(len(keep)) or compact(self, rows, keep),
    )
    eager, static = both_loops(model, tokenizer, cfg, greedy, sync_every)
    lengths = [len(ids) for ids in eager.generated_ids]
    assert min(lengths) < MAX_NEW_TOKENS and any(eager.stopped), lengths
    assert static.generated_ids == eager.generated_ids
    assert static.stopped == eager.stopped
    for got, expected in zip(static.generated_logprobs, eager.generated_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    if sync_every < MAX_NEW_TOKENS:
        assert sizes and sizes == sorted(sizes, reverse=True) and sizes[-1] < len(PROMPTS), sizes
    if sync_every == 64:
        assert sizes == []


def test_without_stop_tokens_every_sample_runs_to_max_new_tokens(model_and_tokenizer):
    """No stop token: every sample has exactly max_new_tokens tokens and is flagged truncated, as eagerly."""
    model, tokenizer = model_and_tokenizer
    eager, static = both_loops(
        model, tokenizer, GenerationConfig(max_new_tokens=5, stop_token_ids=[]), False, 2
    )
    assert [len(ids) for ids in static.generated_ids] == [5] * len(PROMPTS)
    assert static.generated_ids == eager.generated_ids and not any(static.stopped)


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that need a tensor's values on the host: on a GPU each one waits for the
    device. Those are the reads into Python (item, tolist, bool/int/float/index conversion, numpy, cpu),
    ops whose output size depends on the data (nonzero, masked_select, unique, indexing with a bool mask),
    and tensors made from Python data (a host-to-device copy on a GPU). A `.to(device)` of a tensor already
    on the device is not counted: on a CPU it cannot be told from a transfer (the GPU check counts syncs with
    torch.cuda.set_sync_debug_mode instead)."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
    DATA_SHAPED = {"nonzero", "masked_select", "unique", "unique_consecutive", "tensor", "as_tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or name in self.DATA_SHAPED:
            self.reads.append(name)
        elif name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.reads.append("bool index")
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_a_static_step_reads_nothing_back_to_the_host(model_and_tokenizer):
    """Three static steps (choose, record, stop flags, feed through the model) make no host read (counted as
    `HostReads` says), where the eager loop's step makes several (its tokens and logprobs to the host, the
    stop check, transformers' mask builder)."""
    model, tokenizer = model_and_tokenizer
    left_ids, mask = left_padded(tokenizer, PROMPTS)
    cfg = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[5, 9])
    uniforms = decoding.per_sample_uniforms(7, list(range(len(PROMPTS))), MAX_NEW_TOKENS)
    decoder = static_decode.StaticDecoder(model, cfg, False, [5, 9])
    rows = decoder.start(left_ids, mask, uniforms)
    with HostReads() as counted:
        for _ in range(3):
            decoder.run_step(rows)
    assert counted.reads == []
    assert int(decoder.step_index) == 3 and int(decoder.column) == left_ids.shape[1] + 3

    with HostReads() as counted:  # one step of the eager loop
        decoding.decode_batch(
            model, tokenizer, left_ids, mask, GenerationConfig(max_new_tokens=2), False, uniforms, [[]] * 12
        )
    assert counted.reads.count("tolist") >= 2 and "__bool__" in counted.reads, counted.reads


def test_compacted_sizes():
    """CUDA: powers of two, only when smaller than the batch (16 rows, 9 running: none; 8 running: 8; 3: 4;
    1: 1). CPU: the running rows once an eighth has finished (16 rows: 14 running compacts, 15 does not)."""
    assert [decoding.compacted_size(16, n, True) for n in (9, 8, 3, 1)] == [None, 8, 4, 1]
    assert [decoding.compacted_size(16, n, False) for n in (15, 14, 3)] == [None, 14, 3]
    assert decoding.compacted_size(4, 3, False) == 3  # under 8 rows: at the first finished one


def test_the_worker_picks_the_loop_by_config(model_dir):
    """generation.decode_loop: static on the CPU gives the eager loop's outputs; with stop strings the static
    loop does not apply, and asking for it fails naming the key."""
    tokenizer = load_tokenizer(str(model_dir))
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    data = {
        "input_ids": torch.tensor([row + [tokenizer.pad_token_id] * (8 - len(row)) for row in ids]),
        "input_lengths": torch.tensor([len(row) for row in ids]),
    }
    outputs = {}
    for loop in ("eager", "static"):
        cfg = GenerationConfig(max_new_tokens=6, decode_loop=loop)  # packed weights (CPU fp32) in both
        outputs[loop] = HFGenerationWorker(cfg, str(model_dir)).generate(data, seed=3)
    assert torch.equal(outputs["static"]["output_ids"], outputs["eager"]["output_ids"])
    torch.testing.assert_close(outputs["static"]["logprobs"], outputs["eager"]["logprobs"], atol=1e-5, rtol=0)
    cfg = GenerationConfig(max_new_tokens=6, decode_loop="static", stop_strings=["="])
    with pytest.raises(ValueError, match="generation.decode_loop='static' does not cover stop strings"):
        HFGenerationWorker(cfg, str(model_dir)).generate(data)


def test_a_failing_static_loop_falls_back_to_the_eager_loop_once_with_one_warning(
    model_dir, monkeypatch, caplog
):
    """decode_loop auto where the worker picks the static loop (as on a GPU: the decision is forced here, the
    CPU would not take it) and the loop raises (its sync period 0 divides by zero): the outputs are the
    eager loop's, one warning names the cause and the knob, and the next call does not try again."""
    tokenizer = load_tokenizer(str(model_dir))
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    data = {
        "input_ids": torch.tensor([row + [tokenizer.pad_token_id] * (8 - len(row)) for row in ids]),
        "input_lengths": torch.tensor([len(row) for row in ids]),
    }
    eager = HFGenerationWorker(GenerationConfig(max_new_tokens=6, decode_loop="eager"), str(model_dir))
    expected = eager.generate(data, seed=3)
    from posttrain.workers.generation import hf_worker

    monkeypatch.setattr(hf_worker, "use_static_loop", lambda *args: True)
    worker = HFGenerationWorker(GenerationConfig(max_new_tokens=6, decode_sync_every=0), str(model_dir))
    with caplog.at_level("WARNING", logger=hf_worker.__name__):
        first, second = worker.generate(data, seed=3), worker.generate(data, seed=3)
    for outputs in (first, second):
        assert torch.equal(outputs["output_ids"], expected["output_ids"])
    warnings = [r.getMessage() for r in caplog.records if "static decode loop failed" in r.getMessage()]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]
    assert "generation.decode_loop=eager" in warnings[0]


def test_rope_types_that_read_positions_on_the_host_keep_the_eager_loop():
    """A tiny Llama with dynamic NTK rope: asking for the static loop fails naming the rope type; the default
    rope is let in."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(rope: dict) -> torch.nn.Module:
        config = LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            rope_parameters=rope,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config)

    static = GenerationConfig(decode_loop="static")
    assert static_decode.use_static_loop(
        tiny({"rope_type": "default", "rope_theta": 1e4}), static, [[]], False
    )
    dynamic = tiny({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert static_decode.rope_type(dynamic.config) == "dynamic"
    with pytest.raises(ValueError, match="does not cover rope_type 'dynamic'"):
        static_decode.use_static_loop(dynamic, static, [[]], False)
    assert not static_decode.use_static_loop(dynamic, GenerationConfig(), [[]], False)
