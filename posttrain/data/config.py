"""`DataConfig`: where records come from, their format, templates, length limits and bad-row policy."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config import ConfigError
from posttrain.data.reasoning_gym import check_task, is_reasoning_gym
from posttrain.data.sources import is_file_source, looks_like_hub_name, missing_file
from posttrain.data.tasks import BUILTIN_TASKS

Format = Literal["auto", "messages", "prompt_response", "rl", "preference"]


@dataclass
class DataConfig:
    """Training and validation data (the `data` section)."""

    dataset: str = "arithmetic"
    """built-in task name, a .jsonl/.json/.parquet/.csv file, or a Hugging Face dataset name"""
    val_dataset: str | None = None
    """validation file or dataset (None: val_split, else carved off with val_fraction)"""
    format: Format = "auto"
    """messages | prompt_response | rl | preference (auto: from the row's keys)"""
    split: str = "train"
    """Hugging Face split for training"""
    val_split: str | None = None
    """Hugging Face split for validation"""
    val_fraction: float = 0.05
    """share of rows carved off for validation when none is given"""
    messages_key: str = "messages"
    """column of OpenAI-style messages"""
    prompt_key: str = "prompt"
    """column of the prompt"""
    response_key: str = "response"
    """column of the response (prompt_response)"""
    answer_key: str = "answer"
    """column of the ground-truth answer (rl)"""
    chosen_key: str = "chosen"
    """column of the chosen response (preference)"""
    rejected_key: str = "rejected"
    """column of the rejected response (preference)"""
    image_key: str = "images"
    """column of image paths/bytes (one or a list) shown before the prompt (rl, prompt_response)"""
    task_key: str = "task_name"
    """column naming the task/environment (rl)"""
    tools_key: str = "tools"
    """column of the tool names a row may call (default: all its task's)"""
    task_name: str | None = None
    """task of rows without a task column (rl; null: the one task of `env`, if one)"""
    system_prompt: str | None = None
    """system message; '@path' reads it from a file"""
    few_shot: list[dict[str, str]] | None = None
    """messages between the system message and each prompt, e.g. a worked question and its answer"""
    prompt_template: str | None = None
    """template with {prompt}, e.g. 'Q: {prompt}'; '@path' reads a file"""
    max_length: int = 512
    """most tokens of a sample"""
    overlong: Literal["truncate", "drop"] = "truncate"
    """what to do with longer samples (counted either way)"""
    skip_invalid: bool = False
    """skip and count bad rows instead of stopping with an error"""
    shuffle: bool = True
    """shuffle training data each epoch"""
    seed: int = 42
    """seed of shuffling, splits and built-in tasks"""
    shuffle_seed: int | None = None
    """seed of the training order alone (null: data.seed); the split stays as it is"""
    train_on: Literal["assistant", "last_assistant"] = "assistant"
    """tokens trained on: all assistant turns or only the last"""
    num_train: int | None = None
    """training rows used (built-in tasks: generated)"""
    num_val: int | None = None
    """validation rows used (built-in tasks: generated)"""
    num_digits: int = 2
    """built-in arithmetic, math_words, multiplication: digits per operand"""
    options: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym:<task>: keyword arguments of reasoning_gym.create_dataset (the task's difficulty)"""
    puzzle_size: int = 2
    """built-in sliding_puzzle: board size"""
    puzzle_scramble_moves: int = 2
    """built-in sliding_puzzle: random moves from solved"""

    @property
    def training_order_seed(self) -> int:
        """The seed of the training data's shuffle: `shuffle_seed`, else `seed`."""
        return self.seed if self.shuffle_seed is None else self.shuffle_seed

    def validate(self) -> None:
        self._check_source("dataset", self.dataset)
        if self.val_dataset is not None:
            self._check_source("val_dataset", self.val_dataset)
        if not 0 <= self.val_fraction < 1:
            raise ConfigError("val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        if self.max_length < 2:
            raise ConfigError("max_length", f"must be >= 2, got {self.max_length}")
        template = self.prompt_template
        if template and not template.startswith("@") and "{prompt}" not in template:
            raise ConfigError("prompt_template", f"must contain {{prompt}}, got {template!r}")

    def missing_files(self) -> list[ConfigError]:
        """One error per data file named here that does not exist (checked before a run starts, and by
        `--check-config`); a relative path says where it was looked for."""
        problems = []
        for key, name in (("data.dataset", self.dataset), ("data.val_dataset", self.val_dataset)):
            if name is not None and is_file_source(name) and (problem := missing_file(name)):
                problems.append(ConfigError(key, problem))
        return problems

    @staticmethod
    def _check_source(key: str, name: str) -> None:
        """A built-in task, a data file, or an `org/name` hub dataset; anything else is a typo, caught here
        rather than by a hub lookup."""
        if is_reasoning_gym(name):
            if problem := check_task(name):
                raise ConfigError(key, problem)
            return
        if name in BUILTIN_TASKS or is_file_source(name) or looks_like_hub_name(name):
            return
        guess = difflib.get_close_matches(name, BUILTIN_TASKS, n=1)
        message = (
            f"{name!r} is not a built-in task ({', '.join(BUILTIN_TASKS)}), a .jsonl/.json/.parquet/.csv "
            "file, a Hugging Face dataset name (org/name) or reasoning_gym:<task>"
        )
        raise ConfigError(key, message + (f"; did you mean {guess[0]!r}?" if guess else ""))
