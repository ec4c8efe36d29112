"""An OpenAI-compatible endpoint over a generation backend: `POST /v1/chat/completions` and `/v1/completions`,
`GET /v1/models`, served with serve-env's limits (a token beyond loopback, body size, concurrent requests, bad
JSON answered with a 4xx). Concurrent requests are batched: a request waits up to `batch_wait_s` for others
with the same sampling settings, and each batch is one `generate` call. Every choice carries the token ids it
was sampled as (`token_ids`, with `prompt_token_ids` on the response) and each token's logprob, so a trainer
never has to re-tokenize text. `posttrain serve --model DIR` runs it on a model directory (a checkpoint's
export or any Hugging Face model) with the Hugging Face or vLLM backend in-process.

Served: messages (the model's chat template; `tools` passed to it and Hermes `<tool_call>` replies returned
as `tool_calls`), prompt (text or token ids), n, temperature, top_p, max_tokens, stop, logprobs, seed;
`stream` on chat completions, sent whole as one event per choice. Not served: streaming of
`/v1/completions`, `top_logprobs`, penalties, `logit_bias`, `response_format` (answered 400)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from posttrain.data.tool_calls import parse_hermes
from posttrain.environments.server import (
    BadRequest,
    EnvironmentHandler,
    JsonServer,
    ServerLimits,
    add_server_arguments,
    serve_until_interrupted,
    server_limits,
    server_token,
)
from posttrain.workers.generation.config import GenerationConfig

UNSERVED = ["top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "response_format"]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The settings a batch shares."""

    temperature: float
    top_p: float
    max_tokens: int
    greedy: bool
    seed: int | None


class Batcher:
    """Collects prompts from concurrent requests and decodes each group of equal `Sampling` as one batch on
    `generation` (an object with `cfg` and `generate(data, greedy, seed)`, e.g. an HFGenerationWorker).
    A batch goes when no request has joined it for `batch_wait_s` (at most 50 such waits), or at once when
    every live episode has a request waiting (`live`: the agent rollouts' count of running episodes)."""

    def __init__(
        self,
        generation: Any,
        pad_id: int,
        batch_wait_s: float = 0.01,
        fixed_sampling: bool = False,
        base_seed: int = 0,
    ) -> None:
        self.generation, self.pad_id, self.batch_wait_s = generation, pad_id, batch_wait_s
        self.fixed_sampling = fixed_sampling  # training: the run's settings, whatever is asked; one group
        self.base_seed = base_seed  # fixed sampling: batch k samples with seed base_seed + k
        self.ready = threading.Condition()  # guards `pending` and `live`; notified on every change
        self.pending: dict[Sampling | None, list[tuple[list[int], list[str], int, int, Future]]] = {}
        self.live: int | None = None
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="openai-batch")  # one generate at a time
        self.num_batches = 0

    def submit(self, prompts: list[list[int]], stop: list[str], sampling: Sampling, order: int = 0) -> list:
        """Futures of each prompt's result; a batch is decoded in `order` (an episode's index: the same
        requests sample the same tokens whatever order they arrived in), then in order of arrival."""
        futures = [Future() for _ in prompts]
        key = None if self.fixed_sampling else sampling  # fixed: one group, each request's budget its own
        with self.ready:
            first = key not in self.pending
            items = [(ids, stop, sampling.max_tokens, order, future) for ids, future in zip(prompts, futures)]
            self.pending.setdefault(key, []).extend(items)
            self.ready.notify_all()
        if first:
            self.decoder.submit(self._decode, key)
        return futures

    def episode_done(self) -> None:
        """One live episode ended: the requests of the others need not wait for it."""
        with self.ready:
            self.live = (self.live or 1) - 1
            self.ready.notify_all()

    def _decode(self, key: Sampling | None) -> None:
        with self.ready:  # let concurrent requests join the batch
            for _ in range(50):
                waiting = sum(len(items) for items in self.pending.values())
                if (self.live is not None and waiting >= self.live) or not self.ready.wait(self.batch_wait_s):
                    break
            batch = sorted(self.pending.pop(key, []), key=lambda item: item[3])
        if not batch:
            return
        try:
            results = self._generate(batch, key)
        except Exception as error:  # every waiting request learns of it
            for *_, future in batch:
                future.set_exception(error)
            return
        for (*_, future), result in zip(batch, results):
            future.set_result(result)

    def _generate(self, batch: list[tuple], sampling: Sampling | None) -> list[dict]:
        prompts, stops, budgets, *_ = (list(column) for column in zip(*batch))
        lengths = torch.tensor([len(ids) for ids in prompts])
        input_ids = torch.full((len(prompts), int(lengths.max())), self.pad_id, dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, : len(ids)] = torch.tensor(ids)
        data = {"input_ids": input_ids, "input_lengths": lengths, "stop_strings": stops}
        if self.fixed_sampling:  # the run's settings; a request's max_tokens lowers its own budget
            data["max_new_tokens"] = torch.tensor(budgets)
            out = self.generation.generate(data, greedy=False, seed=self.base_seed + self.num_batches)
        else:
            base = self.generation.cfg
            self.generation.cfg = dataclasses.replace(
                base,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_tokens,
            )
            try:
                out = self.generation.generate(data, greedy=sampling.greedy, seed=sampling.seed or 0)
            finally:
                self.generation.cfg = base
        self.num_batches += 1
        ends = (lengths + torch.as_tensor(out["generation_lengths"]).cpu()).tolist()
        return [
            {
                "token_ids": out["output_ids"][row, start:end].tolist(),
                "logprobs": out["logprobs"][row, start:end].tolist(),
                "truncated": bool(out["truncated"][row]),
            }
            for row, (start, end) in enumerate(zip(lengths.tolist(), ends))
        ]


class CompletionServer(JsonServer):
    """The endpoint (see the module docstring) over `batcher`, named `model_name` to clients."""

    def __init__(
        self,
        batcher: Batcher,
        tokenizer: Any,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: ServerLimits | None = None,
        max_tokens: int = 256,
        weight_version: int = 0,
    ) -> None:
        super().__init__(CompletionHandler, host, port, token, limits, "serve")
        self.batcher, self.tokenizer, self.model_name = batcher, tokenizer, model_name
        self.max_tokens, self.weight_version = max_tokens, weight_version
        self.episodes: dict[str, Episode] = {}  # agent rollouts: the trajectory of each episode id

    def chat(self, body: dict[str, Any], episode: str | None = None) -> dict[str, Any]:
        if episode is None:
            return self._chat(body, None)
        if episode not in self.episodes:
            raise BadRequest(f"no episode {episode!r}", 404)
        with self.episodes[episode].lock:  # one call of an episode at a time: its trajectory is a sequence
            return self._chat(body, self.episodes[episode])

    def _chat(self, body: dict[str, Any], episode: Episode | None) -> dict[str, Any]:
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise BadRequest("messages must be a non-empty list of objects")
        tools = body.get("tools")
        prompt = episode.continued_prompt(messages, self.tokenizer) if episode is not None else None
        try:
            if prompt is None:
                prompt = self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
                )
        except Exception as error:  # a message the template cannot render
            raise BadRequest(f"messages: the chat template cannot render them: {error}") from None
        if episode is not None and body.get("n", 1) != 1:
            raise BadRequest("n must be 1 in an episode (its trajectory is one sequence)")
        choices, usage, results = self._complete(list(prompt), body, episode.index if episode else 0)
        if episode is not None:
            episode.record(messages, list(prompt), results[0], self.tokenizer)
        for choice in choices:
            text = choice.pop("text")
            parsed = parse_hermes(text) if tools else None
            message = {"role": "assistant", "content": parsed.content if parsed else text}
            if parsed is not None and parsed.calls:
                message["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                    }
                    for call in parsed.calls
                ]
                choice["finish_reason"] = "tool_calls"
            choice["message"] = message
        if episode is not None and not episode.closed:  # continued by the reply as returned (calls parsed)
            episode.sent[-1] = plain(choices[0]["message"])
        return self._response("chat.completion", prompt, choices, usage)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise BadRequest("not served: stream (on /v1/completions)")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt)):
            raise BadRequest("prompt must be a string or a non-empty list of token ids")
        choices, usage, _ = self._complete(prompt, body)
        return self._response("text_completion", prompt, choices, usage)

    def _complete(self, prompt: list[int], body: dict, order: int = 0) -> tuple[list[dict], dict, list[dict]]:
        """Sample n completions of `prompt` with the request's settings (one batch with other requests):
        the choices, the usage and the batcher's results."""
        unserved = [key for key in UNSERVED if body.get(key)]
        if unserved:
            raise BadRequest(f"not served: {', '.join(unserved)}")
        n, sampling, stop = request_settings(body, self.max_tokens)
        futures = self.batcher.submit([prompt] * n, stop, sampling, order)
        results = [future.result() for future in futures]
        choices = []
        for index, result in enumerate(results):
            text = self.tokenizer.decode(result["token_ids"], skip_special_tokens=True)
            choice = {
                "index": index,
                "text": text,
                "finish_reason": "length" if result["truncated"] else "stop",
                "token_ids": result["token_ids"],
                "weight_version": self.weight_version,
            }
            if body.get("logprobs"):
                tokens = [self.tokenizer.decode([i]) for i in result["token_ids"]]
                choice["logprobs"] = {
                    "content": [
                        {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                        for tok, lp in zip(tokens, result["logprobs"])
                    ]
                }
            choices.append(choice)
        generated = sum(len(r["token_ids"]) for r in results)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": generated}
        usage["total_tokens"] = len(prompt) + generated
        return choices, usage, results

    def _response(self, kind: str, prompt: list[int], choices: list[dict], usage: dict) -> dict[str, Any]:
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
            "prompt_token_ids": list(prompt),
        }


class Episode:
    """One agent episode's trajectory, built from the endpoint's own token ids: the first call's prompt and
    reply, then for each call that sends the conversation back with exactly one new message after the last
    reply (a tool result, a user turn), that message's tokens (`tokenize_observation`, the rules of
    posttrain's own multi-turn rollouts) and the new reply. A call that does not continue it (an edited or
    dropped turn, several new messages) is counted in `resequenced` and the trajectory stops growing."""

    def __init__(self, index: int = 0) -> None:
        self.index = index  # the episode's place in its rollout: its requests' place in a batch
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []  # messages with token_ids (assistant: and generation_logprobs)
        self.sent: list[dict[str, Any]] = []  # the messages the agent sent, then the reply as returned
        self.resequenced, self.closed = 0, False

    def continued_prompt(self, messages: list[dict], tokenizer: Any) -> list[int] | None:
        """The prompt ids of a call that continues the trajectory (None: render it anew)."""
        if not self.log or self.closed:
            return None
        if len(messages) != len(self.sent) + 1 or [plain(m) for m in messages[:-1]] != self.sent:
            self.resequenced += 1
            self.closed = True
            return None
        from posttrain.experience.rollouts import flat_token_ids, tokenize_observation

        new = tokenize_observation(tokenizer, self.log, plain(messages[-1]))
        self.log.append({**plain(messages[-1]), "token_ids": torch.tensor(new, dtype=torch.long)})
        return flat_token_ids(self.log).tolist()

    def record(self, messages: list[dict], prompt: list[int], result: dict, tokenizer: Any) -> None:
        if self.closed:
            return
        if not self.log:  # the first call's messages, its whole prompt's ids on the first of them
            empty = torch.zeros(0, dtype=torch.long)
            ids_of = [torch.tensor(prompt, dtype=torch.long)] + [empty] * (len(messages) - 1)
            self.log = [{**plain(m), "token_ids": ids} for m, ids in zip(messages, ids_of)]
        ids = result["token_ids"]
        self.log.append(
            {
                "role": "assistant",
                "content": tokenizer.decode(ids, skip_special_tokens=False),
                "token_ids": torch.tensor(ids, dtype=torch.long),
                "generation_logprobs": torch.tensor(result["logprobs"], dtype=torch.float32),
            }
        )
        reply = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        self.sent = [plain(m) for m in messages] + [reply]


def plain(message: dict) -> dict:
    """A message as role and content only (None content: empty)."""
    return {"role": message.get("role"), "content": message.get("content") or ""}


def episode_path(path: str) -> tuple[str | None, str]:
    """(episode id, route) of `/e/<id>/v1/...`; (None, path) otherwise."""
    if path.startswith("/e/"):
        episode, _, rest = path[3:].partition("/")
        return episode, "/" + rest
    return None, path


def request_settings(body: dict[str, Any], default_max_tokens: int) -> tuple[int, Sampling, list[str]]:
    """(n, the batch's sampling settings, stop strings) of a request body; BadRequest naming the field."""
    n = body.get("n", 1)
    temperature = body.get("temperature", 1.0)
    top_p = body.get("top_p", 1.0)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    seed = body.get("seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    checks = [
        ("n", isinstance(n, int) and 1 <= n <= 64, "an integer in [1, 64]"),
        ("temperature", isinstance(temperature, (int, float)) and 0 <= temperature <= 2, "in [0, 2]"),
        ("top_p", isinstance(top_p, (int, float)) and 0 < top_p <= 1, "a number in (0, 1]"),
        ("max_tokens", isinstance(max_tokens, int) and max_tokens >= 1, "an integer >= 1"),
        ("seed", seed is None or isinstance(seed, int), "an integer"),
        ("stop", isinstance(stop, list) and all(isinstance(s, str) for s in stop), "a string or strings"),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise BadRequest(f"{name} must be {expected}")
    greedy = temperature == 0
    sampling = Sampling(float(temperature) if not greedy else 1.0, float(top_p), max_tokens, greedy, seed)
    return n, sampling, stop


class CompletionHandler(EnvironmentHandler):
    """serve-env's checks (Host, token, content type, body size, JSON) with the OpenAI routes; no client-id
    header is asked for (the OpenAI client sends none)."""

    server: CompletionServer
    needs_client_id = False

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            model = {"id": self.server.model_name, "object": "model", "owned_by": "posttrain"}
            self._reply(200, {"object": "list", "data": [model]})
        else:
            super().do_GET()

    def do_POST(self) -> None:
        routes = {"/v1/chat/completions": self.server.chat, "/v1/completions": self.server.completion}
        episode, path = episode_path(self.path)
        refusal = self._refusal() or (None if path in routes else (404, f"no route {self.path}"))
        if refusal is not None:
            self._reply(refusal[0], {"error": {"message": refusal[1], "type": "invalid_request_error"}})
            return
        try:
            body = self._read_json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            answer = routes[path](body, episode) if episode else routes[path](body)
            if body.get("stream"):
                self._reply_events(stream_events(answer))
            else:
                self._reply(200, answer)
        except BadRequest as error:
            self._reply(error.status, {"error": {"message": str(error), "type": "invalid_request_error"}})
        except Exception as error:  # generation failed: say so rather than drop the connection
            message = f"generation failed: {type(error).__name__}: {error}"[:500]
            self._reply(500, {"error": {"message": message, "type": "server_error"}})


def stream_events(completion: dict[str, Any]) -> list[dict]:
    """A chat completion as `chat.completion.chunk` events, one per choice whose delta is the whole message
    (tool calls numbered by `index`)."""
    events, chunk = [], {**completion, "object": "chat.completion.chunk"}
    for choice in completion["choices"]:
        delta = choice.pop("message")
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
        events.append({**chunk, "choices": [{**choice, "delta": delta}]})
    return events


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `posttrain serve` options."""
    parser.add_argument("--model", required=True, help="a model directory (a run's hf_model, an export)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request sets none")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="generation backend")
    parser.add_argument(
        "--vllm-memory", type=float, default=0.5, help="vLLM's share of GPU memory (of CPU memory on a CPU)"
    )
    add_server_arguments(parser, 8000, "POSTTRAIN_SERVE_TOKEN")


def main(args: argparse.Namespace) -> int:
    limits = server_limits(args)
    cfg = GenerationConfig(backend=args.backend, top_k=None, vllm_gpu_memory_utilization=args.vllm_memory)
    if args.backend == "vllm":
        from posttrain.workers.generation.vllm_worker import VllmGenerationWorker as Worker
    else:
        from posttrain.workers.generation.hf_worker import HFGenerationWorker as Worker
    worker = Worker(cfg, args.model)
    batcher = Batcher(worker, worker.pad_id)
    token = server_token(args.host, args.token_env)
    server = CompletionServer(
        batcher, worker.tokenizer, args.model, args.host, args.port, token, limits, args.max_tokens
    )
    print(f"serving {args.model} at {server.url}/v1 (OpenAI API; Ctrl-C stops)", flush=True)
    return serve_until_interrupted(server)
