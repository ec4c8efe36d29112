"""Reward-model environment: a trained scalar-head model scores each finished conversation and the score
is the reward (single turn: every sample terminates). Lets GRPO run RLHF with a learned reward."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.distributed.worker_group import assigned_device
from posttrain.environments.answers import END_MARKERS
from posttrain.environments.interface import EnvironmentInterface, EnvironmentReturn, Message
from posttrain.models.build import load_tokenizer


def strip_end_markers(text: str, markers: tuple[str, ...]) -> str:
    """`text` without trailing end-of-turn markers (only at the end; the rest is left as generated, its
    whitespace included): the chat template adds the reward model's own end marker, so a kept one would
    appear twice."""
    markers = tuple(marker for marker in markers if marker)
    while markers and text.endswith(markers):
        text = text[: -len(next(marker for marker in markers if text.endswith(marker)))]
    return text


def pick_device(device: str) -> torch.device:
    """ "auto": the GPU this actor was given, else the CPU (an actor without a GPU share stays on the CPU)."""
    if device == "auto":
        return assigned_device()
    return torch.device(device)


class RewardModelEnvironment(EnvironmentInterface):
    """Scores conversations with a Hugging Face sequence classifier with one label (e.g. `posttrain rm`'s
    `hf_model`): each conversation is rendered with the reward model's chat template, tokenized, and the
    score at its last token is the reward. Loaded once, inside the environment's Ray actor."""

    def __init__(
        self, model_dir: str, batch_size: int = 32, max_length: int | None = None, device: str = "auto"
    ) -> None:
        from transformers import AutoModelForSequenceClassification

        if batch_size < 1:
            raise ValueError(f"reward_model environment: batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.max_length = batch_size, max_length
        self.device = pick_device(device)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, dtype=torch.float32
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model environment: {model_dir} has {self.model.config.num_labels} labels, expected 1"
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self.end_markers = tuple({*END_MARKERS, self.tokenizer.eos_token or ""} - {""})

    def tokenize(self, message_log: list[Message]) -> list[int]:
        """The conversation as the reward model saw it in training: its chat template, then its tokenizer."""
        messages = [{"role": m["role"], "content": m["content"]} for m in message_log]
        for message in messages:
            if message["role"] == "assistant":
                message["content"] = strip_end_markers(message["content"], self.end_markers)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_length is not None:
            token_ids = token_ids[-self.max_length :]  # keep the end: the response is what is scored
        return token_ids

    @torch.no_grad()
    def score(self, message_logs: list[list[Message]]) -> torch.Tensor:
        """Scalar scores [B] (fp32, on CPU), computed `batch_size` conversations at a time."""
        sequences = [self.tokenize(log) for log in message_logs]
        starts = range(0, len(sequences), self.batch_size)
        scores = [self._score_batch(sequences[i : i + self.batch_size]) for i in starts]
        return torch.cat(scores) if scores else torch.zeros(0)

    def _score_batch(self, sequences: list[list[int]]) -> torch.Tensor:
        pad_id = self.model.config.pad_token_id
        lengths = torch.tensor([len(s) for s in sequences])  # [b]
        input_ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)  # [b, T]
        for i, sequence in enumerate(sequences):
            input_ids[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask = (
            torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        ).long()  # [b, T]
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        logits = self.model(**inputs).logits  # [b, 1]
        return logits.float().squeeze(-1).cpu()  # [b]

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        return EnvironmentReturn.final(metadata, self.score(message_logs))
