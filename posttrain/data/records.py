"""Rows (files, Hugging Face datasets, built-in tasks) -> records with tokenized message logs, cut or
skipped to fit `data.max_input_seq_length`, split into training and validation."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from posttrain.data.config import DataConfig
from posttrain.data.message_log import message_log_length, tokenize_message_log
from posttrain.data.reasoning_gym import is_reasoning_gym, reasoning_gym_rows
from posttrain.data.sources import DataError, Row, SkipCounter, is_file_source, read_file, read_hf_dataset
from posttrain.data.tasks import BUILTIN_TASKS, builtin_rows
from posttrain.data.tool_calls import ToolPrompt, add_tool_prompt

DatumSpec = dict[str, Any]
_LOG_KEYS = ("message_log", "chosen_message_log", "rejected_message_log")


def _text_or_file(value: str | None) -> str | None:
    if value and value.startswith("@"):
        return Path(value[1:]).read_text()
    return value


def detect_format(row: dict, cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.messages_key in row:
        return "messages"
    if cfg.chosen_key in row and cfg.rejected_key in row:
        return "preference"
    if cfg.response_key in row:
        return "prompt_response"
    return "rl"


def _value(row: dict, key: str) -> Any:
    """`row[key]`, None when absent, null or NaN (an empty CSV or Parquet cell)."""
    value = row.get(key)
    return None if isinstance(value, float) and value != value else value


def _require(row: dict, key: str, fmt: str) -> Any:
    """`row[key]`; a missing value is a ValueError naming the field, the format (`fmt`, which says when it
    was guessed) and the keys the row has."""
    if _value(row, key) is None:
        raise ValueError(f"missing field {key!r} (format {fmt}; row keys: {sorted(row)})")
    return row[key]


def _prompt_messages(row: dict, cfg: DataConfig, fmt: str) -> list[dict]:
    """[system], few-shot, user: the prompt (templated), after the row's images (`image_key`) if any."""
    prompt = str(_require(row, cfg.prompt_key, fmt))
    template = _text_or_file(cfg.prompt_template)
    system = _text_or_file(cfg.system_prompt)
    messages = [{"role": "system", "content": system}] if system else []
    messages += [dict(message) for message in cfg.few_shot or []]
    text = template.format(prompt=prompt) if template else prompt
    images = row.get(cfg.image_key)
    if images is not None and not isinstance(images, list):
        images = [images]
    if images:
        return messages + [
            {
                "role": "user",
                "content": [{"type": "image", "image": image} for image in images]
                + [{"type": "text", "text": text}],
            }
        ]
    return messages + [{"role": "user", "content": text}]


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer: Any) -> int:
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _clip_contents(messages: list[dict], cfg: DataConfig, tokenizer: Any) -> list[dict]:
    """Cut every message to the characters that can make `max_length` tokens (max_length x the longest
    token of the vocabulary) before tokenizing: a 10 MB row is never tokenized whole. A cut message still
    has more than `max_length` tokens, so `fit_length` truncates or drops it and counts it."""
    limit = cfg.max_length * _longest_token_chars(tokenizer)
    return [
        {**m, "content": m["content"][:limit]}
        if isinstance(m["content"], str) and len(m["content"]) > limit
        else m
        for m in messages
    ]


def row_to_record(
    row: dict,
    cfg: DataConfig,
    tokenizer: Any,
    idx: int,
    processor: Any = None,
    base_dir: str | None = None,
    tool_prompts: dict[str, ToolPrompt] | None = None,
) -> DatumSpec:
    """One row -> one record in the row's format (errors are KeyError/ValueError; the caller adds where).
    `processor` (a vision-language model's) turns the rows' images into patches; `base_dir` is where
    relative image paths are looked up first. `tool_prompts` (by task) declare tools in rl prompts."""
    fmt = detect_format(row, cfg)
    shown = fmt if cfg.format != "auto" else f"{fmt}, guessed from the row's keys: set data.format if wrong"
    tokenize = functools.partial(tokenize_message_log, processor=processor, base_dir=base_dir)
    record: DatumSpec = {
        "idx": idx,
        "task_name": row.get(cfg.task_key) or cfg.task_name,
        "extra_env_info": {},
    }
    if fmt == "messages":
        messages = _require(row, cfg.messages_key, shown)
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(f"{cfg.messages_key!r} must be a list of {{role, content}} messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{cfg.messages_key!r} has no assistant turn: nothing to train on")
        record["message_log"] = tokenize(_clip_contents(messages, cfg, tokenizer), tokenizer)
    elif fmt == "prompt_response":
        messages = _prompt_messages(row, cfg, shown) + [
            {"role": "assistant", "content": str(_require(row, cfg.response_key, shown))}
        ]
        record["message_log"] = tokenize(_clip_contents(messages, cfg, tokenizer), tokenizer)
    elif fmt == "rl":
        prompt = _clip_contents(_prompt_messages(row, cfg, shown), cfg, tokenizer)
        tool_prompt = (tool_prompts or {}).get(record["task_name"])
        if tool_prompt is None and row.get(cfg.tools_key) is not None:
            raise ValueError(f"{cfg.tools_key!r} is set but task {record['task_name']!r} has no tools")
        template_kwargs = {}
        if tool_prompt is not None:
            names = row.get(cfg.tools_key)
            tool_prompt = tool_prompt.select(names, f"column {cfg.tools_key!r}")
            prompt, template_kwargs = add_tool_prompt(prompt, tool_prompt, tokenizer)
            record["stop_strings"] = list(tool_prompt.stop_strings) or None
        record["message_log"] = tokenize(prompt, tokenizer, add_generation_prompt=True, **template_kwargs)
        answer = _value(row, cfg.answer_key)  # optional: the environments say whether they need it
        record["extra_env_info"] = {
            **other_columns(row, cfg),
            "ground_truth": None if answer is None else str(answer),
            **(row.get("metadata") or {}),
        }
        if tool_prompt is not None and row.get(cfg.tools_key) is not None:
            record["extra_env_info"]["tools"] = [t["function"]["name"] for t in tool_prompt.tools]
    elif fmt == "preference":
        prompt = _prompt_messages(row, cfg, shown)
        for side, key in (("chosen", cfg.chosen_key), ("rejected", cfg.rejected_key)):
            response = [{"role": "assistant", "content": str(_require(row, key, shown))}]
            record[f"{side}_message_log"] = tokenize(
                _clip_contents(prompt + response, cfg, tokenizer), tokenizer
            )
        record["message_log"] = record["chosen_message_log"]
    else:
        raise ValueError(f"unknown data.format {fmt!r}")
    record["length"] = max(message_log_length(record[key]) for key in _LOG_KEYS if key in record)
    return record


def other_columns(row: dict, cfg: DataConfig) -> dict[str, Any]:
    """The columns of an rl row that an environment may use besides its ground truth (a reward function
    receives them as keyword arguments): all but the prompt, images, task, tools, answer and metadata."""
    used = {cfg.prompt_key, cfg.image_key, cfg.task_key, cfg.tools_key, cfg.answer_key, "metadata"}
    return {key: value for key, value in row.items() if key not in used}


def fit_length(record: DatumSpec, cfg: DataConfig, counter: SkipCounter) -> DatumSpec | None:
    """Truncate the last message of each log to `max_length`, or drop the record (both counted)."""
    if record["length"] <= cfg.max_length:
        return record
    if cfg.overlong == "drop":
        counter.dropped += 1
        return None
    for key in [key for key in _LOG_KEYS if key in record]:
        log = record[key]
        excess = message_log_length(log) - cfg.max_length
        if excess > 0:
            if (
                excess >= len(log[-1]["token_ids"]) or "pixel_values" in log[-1]
            ):  # never cut an image's tokens
                counter.dropped += 1  # nothing sensible is left after cutting the last message
                return None
            log[-1] = {**log[-1], "token_ids": log[-1]["token_ids"][:-excess]}
    record["length"] = cfg.max_length
    counter.truncated += 1
    return record


def rows_to_records(
    rows: list[Row],
    cfg: DataConfig,
    tokenizer: Any,
    counter: SkipCounter,
    processor: Any = None,
    tool_prompts: dict[str, ToolPrompt] | None = None,
) -> list[DatumSpec]:
    records = []
    for row in rows:
        try:
            if "_invalid" in row.values:
                raise ValueError(f"expected an object, got {row.values['_invalid']!r}")
            record = row_to_record(
                row.values,
                cfg,
                tokenizer,
                idx=len(records),
                processor=processor,
                base_dir=row.base_dir,
                tool_prompts=tool_prompts,
            )
        except Exception as error:  # a template that cannot render a role raises from jinja
            counter.bad_row(row.where, str(error))
            continue
        record["where"] = row.where  # named by errors about the row found later (`check_record_tasks`)
        record = fit_length(record, cfg, counter)
        if record is not None:
            records.append(record)
    return records


def _read_rows(cfg: DataConfig, counter: SkipCounter) -> tuple[list[Row], list[Row] | None]:
    """(training rows, validation rows or None when they must be carved off)."""
    if is_reasoning_gym(cfg.dataset):
        num_train, num_val = cfg.num_train or 4096, cfg.num_val or 256
        train, val = reasoning_gym_rows(cfg.dataset, cfg.options, num_train, num_val, cfg.seed)
        return (
            [Row(r, f"{cfg.dataset} train row {i}") for i, r in enumerate(train)],
            [Row(r, f"{cfg.dataset} val row {i}") for i, r in enumerate(val)],
        )
    if cfg.dataset in BUILTIN_TASKS:
        train, val = builtin_rows(
            cfg.dataset,
            cfg.num_train,
            cfg.num_val,
            cfg.seed,
            cfg.num_digits,
            cfg.puzzle_size,
            cfg.puzzle_scramble_moves,
        )
        return (
            [Row(r, f"{cfg.dataset} train row {i}") for i, r in enumerate(train)],
            [Row(r, f"{cfg.dataset} val row {i}") for i, r in enumerate(val)],
        )
    train_rows = _read_source(cfg, "dataset", cfg.split, counter)
    if cfg.val_dataset:
        return train_rows, _read_source(cfg, "val_dataset", cfg.val_split or cfg.split, counter)
    if cfg.val_split and not is_file_source(cfg.dataset):
        return train_rows, read_hf_dataset(cfg.dataset, cfg.val_split)
    return train_rows, None


def _read_source(cfg: DataConfig, key: str, split: str, counter: SkipCounter) -> list[Row]:
    """The rows of `data.<key>` (`dataset` or `val_dataset`): a file, or a Hugging Face dataset's `split`."""
    source = getattr(cfg, key)
    if is_file_source(source):
        return read_file(source, counter, key=f"data.{key}")
    return read_hf_dataset(source, split)


def load_datasets(
    cfg: DataConfig, tokenizer: Any, processor: Any = None, tool_prompts: dict[str, ToolPrompt] | None = None
) -> tuple[list[DatumSpec], list[DatumSpec], dict[str, float]]:
    """(training records, validation records, counts of skipped/truncated/dropped samples). `processor`: a
    vision-language model's (posttrain.models.vlm.load_processor), needed by rows with images;
    `tool_prompts`: the tools each task declares to the model (posttrain.data.tool_calls)."""
    counter = SkipCounter(cfg.skip_invalid)
    train_rows, val_rows = _read_rows(cfg, counter)
    if val_rows is None:  # carve a validation split off with the seed
        order = list(range(len(train_rows)))
        random.Random(cfg.seed).shuffle(order)
        num_val = max(1, int(len(order) * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
        val_rows = [train_rows[i] for i in order[:num_val]]
        train_rows = [train_rows[i] for i in sorted(order[num_val:])]
    if cfg.dataset not in BUILTIN_TASKS:  # a built-in task generated num_train / num_val rows already
        train_rows, val_rows = train_rows[: cfg.num_train], val_rows[: cfg.num_val]
    train = rows_to_records(train_rows, cfg, tokenizer, counter, processor, tool_prompts)
    val = rows_to_records(val_rows, cfg, tokenizer, counter, processor, tool_prompts)
    if not train:
        raise DataError(f"data.dataset={cfg.dataset}: no usable training rows")
    stats = {
        "num_train": float(len(train)),
        "num_val": float(len(val)),
        "skipped_invalid": float(counter.invalid),
        "truncated": float(counter.truncated),
        "dropped_overlong": float(counter.dropped),
    }
    return train, val, stats


def load_all_records(
    cfg: DataConfig, tokenizer: Any, processor: Any = None, tool_prompts: dict[str, ToolPrompt] | None = None
) -> list[DatumSpec]:
    """Every record of the data an evaluation scores whole: `data.val_dataset` when set, else every row of
    `data.dataset` (a Hugging Face dataset: split `data.val_split`, else `data.split`); a built-in task's
    validation rows (its training rows are for training). `data.num_val` keeps the first that many."""
    counter = SkipCounter(cfg.skip_invalid)
    if cfg.dataset in BUILTIN_TASKS or is_reasoning_gym(cfg.dataset):
        _, rows = _read_rows(cfg, counter)
    else:
        rows = _read_source(
            cfg, "val_dataset" if cfg.val_dataset else "dataset", cfg.val_split or cfg.split, counter
        )
        rows = rows[: cfg.num_val]
    return rows_to_records(rows or [], cfg, tokenizer, counter, processor, tool_prompts)
