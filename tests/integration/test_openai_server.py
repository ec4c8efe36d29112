"""The OpenAI-compatible endpoint (`posttrain serve`), driven by the real `openai` client on loopback over a
tiny model: token-exact completions (the ids and logprobs a direct generate call gives with the same
seed), concurrent requests batched into one generate call, and serve-env's refusals."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from posttrain.cli import build_parser
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.openai_server import Batcher, CompletionServer

MESSAGES = [{"role": "user", "content": "12+34="}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    spec = ModelFromConfig(architecture="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, seed=3)
    model_dir = build_model_dir(spec, tmp_path_factory.mktemp("openai_model"))
    worker = HFGenerationWorker(GenerationConfig(max_new_tokens=8, top_k=None), str(model_dir))
    batcher = Batcher(worker, worker.pad_id, batch_wait_s=0.2)
    server = CompletionServer(batcher, worker.tokenizer, "tiny", max_tokens=8)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-on-loopback", max_retries=0)
    yield server, worker, client
    server.shutdown()
    server.server_close()


def direct(worker, prompt_ids: list[int], n: int, seed: int, greedy: bool = False) -> dict:
    data = {"input_ids": torch.tensor([prompt_ids] * n), "input_lengths": torch.tensor([len(prompt_ids)] * n)}
    return worker.generate(data, greedy=greedy, seed=seed)


def test_a_chat_completion_is_token_exact_with_its_logprobs(served):
    """n=2, seed 5: each choice's token_ids and logprobs are those of generate() on the chat-templated prompt
    (the response's prompt_token_ids) with the same seed; the text is their decoding."""
    server, worker, client = served
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, seed=5, max_tokens=6, logprobs=True
    )
    prompt_ids = response.model_extra["prompt_token_ids"]
    assert prompt_ids == worker.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = direct(worker, prompt_ids, 2, seed=5)
    for row, choice in enumerate(response.choices):
        ids = choice.model_extra["token_ids"]
        end = len(prompt_ids) + len(ids)
        assert ids == expected["output_ids"][row, len(prompt_ids) : end].tolist() and 1 <= len(ids) <= 6
        logprobs = [item.logprob for item in choice.logprobs.content]
        assert logprobs == pytest.approx(expected["logprobs"][row, len(prompt_ids) : end].tolist(), abs=1e-6)
        assert choice.message.content == worker.tokenizer.decode(ids, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_a_greedy_text_completion_equals_greedy_generation(served):
    server, worker, client = served
    response = client.completions.create(model="tiny", prompt="7+8=", temperature=0, max_tokens=5)
    prompt_ids = worker.tokenizer("7+8=", add_special_tokens=False)["input_ids"]
    expected = direct(worker, prompt_ids, 1, seed=0, greedy=True)
    ids = response.choices[0].model_extra["token_ids"]
    assert ids == expected["output_ids"][0, len(prompt_ids) : len(prompt_ids) + len(ids)].tolist()


def test_concurrent_requests_are_batched_into_one_generate_call(served):
    """Eight requests with the same settings inside the batch window: all answered, in fewer batches."""
    server, worker, client = served
    before = server.batcher.num_batches

    def ask(seed: int) -> int:
        return len(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4).choices)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == [1] * 8
    assert server.batcher.num_batches - before < 8


def test_bad_requests_are_4xx_naming_the_problem(served):
    server, _, client = served
    url = f"{server.url}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    bad_json = requests.post(url, data="{not json", headers=headers, timeout=10)
    assert bad_json.status_code == 400 and "not JSON" in bad_json.json()["error"]["message"]
    for body, message in (
        ({"messages": MESSAGES, "n": 0}, "n must be an integer in [1, 64]"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "not served: top_logprobs"),
        ({"messages": []}, "messages must be a non-empty list"),
    ):
        answer = requests.post(url, data=json.dumps(body), headers=headers, timeout=10)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, top_p=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_streamed_chat_completion_is_the_whole_reply_in_one_event(served):
    """stream=True with seed 5: the `openai` client's stream yields one chunk whose delta holds the same
    text and token ids as the non-streamed call with that seed, then ends; `/v1/completions` does not
    stream."""
    server, _, client = served
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, seed=5, max_tokens=6)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=5, max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert len(chunks) == 1 and chunks[0].object == "chat.completion.chunk"
    (choice,) = chunks[0].choices
    assert choice.delta.content == whole.choices[0].message.content
    assert choice.model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert choice.finish_reason == whole.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="not served: stream"):
        client.completions.create(model="tiny", prompt="12+34=", max_tokens=2, stream=True)


def test_beyond_loopback_a_key_is_required_and_checked(served):
    server, worker, _ = served
    with pytest.raises(ValueError, match="beyond loopback"):
        CompletionServer(server.batcher, worker.tokenizer, "tiny", host="0.0.0.0")
    keyed = CompletionServer(server.batcher, worker.tokenizer, "tiny", token="secret-key")
    threading.Thread(target=keyed.serve_forever, daemon=True).start()
    try:
        wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        right = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="secret-key", max_retries=0)
        assert right.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
    finally:
        keyed.shutdown()
        keyed.server_close()


def test_the_serve_command_takes_a_model_directory():
    args = build_parser().parse_args(["serve", "--model", "results/x/hf_model", "--port", "0"])
    assert (args.model, args.port, args.host) == ("results/x/hf_model", 0, "127.0.0.1")
