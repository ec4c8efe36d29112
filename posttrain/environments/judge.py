"""Rewards from a judge model: each finished reply is shown to a generative model with a rubric, and the
score it writes is the reward (single turn: every sample terminates).

The judge is either any OpenAI-compatible chat endpoint (`url`: `POST {url}/v1/chat/completions`, as
served by vLLM, SGLang, llama.cpp or a hosted API; the key, if any, from the environment variable named by
`api_key_env`) or a local Hugging Face causal LM (`model_dir`), loaded once inside the environment's Ray
actor, which is then the judge's own worker (`env.<task>.num_workers` of them, each with
`env.<task>.num_cpus`).

Per sample: the rubric (`rubric`, a `str.format` template with `{prompt}`, `{response}` and `{reference}`:
the first user message, the last assistant message and `metadata[ground_truth_key]` or "(none)") is sent as
one user message; the judge's reply is parsed with `score_pattern` (the last match's first group), and the
reward is (score - min_score) / (max_score - min_score), in [0, 1]. HTTP calls run `max_concurrency` at a
time; each is retried `retries` times (`backoff_s` apart) on a refused connection, a timeout
(`timeout_s`) or an HTTP 5xx/429.

Failures never stop the run. A reply without a score in range (a parse failure) and a judge that could not
be reached score 0 and are counted in `num_errors` (the rollout's `env_errors`); the environment also
keeps the counts by kind (`counts`) and logs the first failures with the judge's words.

A judge can be gamed as surely as a verifier: a policy learns what the judge likes (length, confident
tone, the rubric's own words, a "Score: 10" written into its reply). Keep a strict grader on validation
(`grpo.val_grader`) wherever the task has a checkable answer, read the validation samples, and watch the
gap between reward and strict grade that the run warns about.
"""

from __future__ import annotations

import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
import torch

from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, Message
from posttrain.environments.reward_model import pick_device

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You grade answers to questions.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\n"
    "Is the answer correct and does it agree with the reference? Rate it from 0 (wrong) to 10 (correct and "
    "clear). End with a line of the form 'Score: N'."
)
DEFAULT_SCORE_PATTERN = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"
RETRY_STATUS = {429, 500, 502, 503, 504}


class JudgeUnavailable(RuntimeError):
    """The judge did not answer (after its retries)."""


def rubric_fields(message_log: list[Message], metadata: dict[str, Any], ground_truth_key: str) -> dict:
    """{prompt, response, reference} of one conversation for the rubric template."""
    prompt = next((m["content"] for m in message_log if m["role"] == "user"), "")
    response = next((m["content"] for m in reversed(message_log) if m["role"] == "assistant"), "")
    reference = metadata.get(ground_truth_key)
    return {"prompt": prompt, "response": response, "reference": "(none)" if reference is None else reference}


def parse_score(text: str, pattern: re.Pattern, min_score: float, max_score: float) -> float | None:
    """The reward in [0, 1] from the last score `pattern` finds in `text`; None if there is none or it is
    out of [min_score, max_score]."""
    matches = pattern.findall(text)
    if not matches:
        return None
    last = matches[-1]
    try:
        score = float(last[0] if isinstance(last, tuple) else last)
    except ValueError:
        return None
    if not min_score <= score <= max_score:
        return None
    return (score - min_score) / (max_score - min_score)


class HTTPJudge:
    """An OpenAI-compatible chat-completions endpoint."""

    def __init__(self, url: str, model: str, timeout_s: float, retries: int, backoff_s: float, **sampling):
        self.endpoint = url.rstrip("/") + "/v1/chat/completions"
        self.model, self.timeout_s, self.retries, self.backoff_s = model, timeout_s, retries, backoff_s
        self.sampling = sampling
        self.headers = {}
        self.session = requests.Session()

    def use_key(self, key: str | None) -> None:
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def complete(self, prompt: str) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], **self.sampling}
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s)
            try:
                reply = self.session.post(
                    self.endpoint, json=body, headers=self.headers, timeout=self.timeout_s
                )
            except requests.Timeout:
                problem = f"no answer within {self.timeout_s} s"
                continue
            except requests.ConnectionError as error:
                problem = f"cannot connect: {error}"
                continue
            if reply.status_code in RETRY_STATUS:
                problem = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code != 200:
                raise JudgeUnavailable(f"{self.endpoint}: HTTP {reply.status_code}: {reply.text[:200]}")
            try:
                return reply.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as error:
                raise JudgeUnavailable(
                    f"{self.endpoint}: not a chat completion: {reply.text[:200]!r}"
                ) from error
        raise JudgeUnavailable(f"{self.endpoint}: {problem} ({self.retries + 1} tries)")


class LocalJudge:
    """A Hugging Face causal LM in this process: its chat template, greedy decoding (transformers'
    `generate`), `batch_size` prompts at a time."""

    def __init__(self, model_dir: str, max_new_tokens: int, batch_size: int, device: str) -> None:
        from transformers import AutoModelForCausalLM

        from posttrain.models.build import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.padding_side = "left"
        self.device = pick_device(device)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        )
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    @torch.no_grad()
    def complete_all(self, prompts: list[str]) -> list[str]:
        replies: list[str] = []
        for start in range(0, len(prompts), self.batch_size):
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts[start : start + self.batch_size]
            ]
            inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            output = self.model.generate(
                **inputs.to(self.device),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )  # [b, prompt + new]
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            replies += self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return replies


class JudgeEnvironment(EnvironmentInterface):
    """Scores each reply by asking a judge model with a rubric (see the module docstring)."""

    def __init__(
        self,
        url: str | None = None,
        model_dir: str | None = None,
        model: str = "judge",
        rubric: str = DEFAULT_RUBRIC,
        score_pattern: str = DEFAULT_SCORE_PATTERN,
        min_score: float = 0.0,
        max_score: float = 10.0,
        ground_truth_key: str = "ground_truth",
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        max_concurrency: int = 8,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        api_key_env: str = "OPENAI_API_KEY",
        batch_size: int = 16,
        device: str = "auto",
    ) -> None:
        if (url is None) == (model_dir is None):
            raise ValueError("judge environment: give exactly one of url (an HTTP endpoint) or model_dir")
        if not max_score > min_score:
            raise ValueError(f"judge environment: max_score {max_score} must exceed min_score {min_score}")
        missing = [field for field in ("{prompt}", "{response}") if field not in rubric]
        if missing:
            raise ValueError(f"judge environment: the rubric does not contain {', '.join(missing)}")
        self.rubric, self.pattern = rubric, re.compile(score_pattern)
        self.min_score, self.max_score = min_score, max_score
        self.ground_truth_key, self.max_concurrency = ground_truth_key, max_concurrency
        self.counts = {"scored": 0, "parse_failures": 0, "unavailable": 0}
        if url is not None:
            self.judge: HTTPJudge | LocalJudge = HTTPJudge(
                url, model, timeout_s, retries, backoff_s, max_tokens=max_new_tokens, temperature=temperature
            )
            self.judge.use_key(os.environ.get(api_key_env))
        else:
            self.judge = LocalJudge(model_dir, max_new_tokens, batch_size, device)

    def _ask(self, prompts: list[str]) -> list[str | JudgeUnavailable]:
        """The judge's reply to each prompt, or the error that kept it from answering."""
        if isinstance(self.judge, LocalJudge):
            return list(self.judge.complete_all(prompts))

        def ask_one(prompt: str) -> str | JudgeUnavailable:
            try:
                return self.judge.complete(prompt)
            except JudgeUnavailable as error:
                return error

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            return list(pool.map(ask_one, prompts))

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        prompts = [
            self.rubric.format(**rubric_fields(log_, meta, self.ground_truth_key))
            for log_, meta in zip(message_logs, metadata)
        ]
        rewards, num_errors = [], 0
        for reply, meta in zip(self._ask(prompts), metadata):
            if isinstance(reply, JudgeUnavailable):
                reward, kind = None, "unavailable"
                detail = str(reply)
            else:
                reward = parse_score(reply, self.pattern, self.min_score, self.max_score)
                kind, detail = (
                    ("scored", "") if reward is not None else ("parse_failures", repr(reply[-200:]))
                )
            self.counts[kind] += 1
            if reward is None:
                num_errors += 1
                if self.counts[kind] <= 3:
                    log.warning("judge %s on sample %s: %s", kind.replace("_", " "), meta.get("idx"), detail)
            rewards.append(0.0 if reward is None else reward)
        batch_size = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(batch_size)],
            metadata=metadata,
            next_stop_strings=[None] * batch_size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(batch_size, dtype=torch.bool),
            answers=[None] * batch_size,
            num_errors=num_errors,
        )
