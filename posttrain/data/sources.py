"""Rows from local files (JSONL, JSON, Parquet, CSV) or Hugging Face datasets, each tagged with where it
came from so that a bad row is reported by file and line (or row index)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """A row that cannot be used; the message names the file and line (or row index)."""


@dataclass
class Row:
    values: dict[str, Any]
    where: str  # "data/train.jsonl:12" or "data/train.csv row 3" or "hf:gsm8k[train] row 5"


@dataclass
class SkipCounter:
    """Rows skipped by `skip_invalid`, and samples truncated or dropped for length."""

    invalid: int = 0
    truncated: int = 0
    dropped: int = 0


def is_file_source(source: str) -> bool:
    return source.endswith(FILE_SUFFIXES)


def read_jsonl(path: Path, skip_invalid: bool, counter: SkipCounter) -> list[Row]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                value = json.loads(line)
                if not isinstance(value, dict):
                    raise ValueError(f"expected a JSON object, got {type(value).__name__}")
            except ValueError as error:
                if not skip_invalid:
                    raise DataError(f"{where}: malformed JSON line: {error}") from None
                counter.invalid += 1
                continue
            rows.append(Row(value, where))
    return rows


def read_table(path: Path) -> list[Row]:
    """JSON (a list of objects, or {"data": [...]}), Parquet or CSV rows with their index."""
    if path.suffix == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as error:
                raise DataError(f"{path}: malformed JSON: {error}") from None
        data = data.get("data", data) if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a list of objects (or {{'data': [...]}})")
        return [Row(dict(v) if isinstance(v, dict) else {"_invalid": v}, f"{path} row {i}") for i, v in enumerate(data)]
    import pandas

    frame = pandas.read_parquet(path) if path.suffix == ".parquet" else pandas.read_csv(path, keep_default_na=False)
    return [Row(_plain(record), f"{path} row {i}") for i, record in enumerate(frame.to_dict(orient="records"))]


def _plain(record: dict) -> dict:
    """numpy arrays/scalars from pandas -> Python lists/values (messages columns in Parquet are arrays)."""
    out = {}
    for key, value in record.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, list):
            value = [_plain(v) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out


def read_file(path: str, skip_invalid: bool, counter: SkipCounter) -> list[Row]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file {file} does not exist")
    if file.suffix == ".jsonl":
        return read_jsonl(file, skip_invalid, counter)
    return read_table(file)


def read_hf_dataset(name: str, split: str) -> list[Row]:
    """A Hugging Face dataset split by name (needs the network the first time)."""
    import datasets

    dataset = datasets.load_dataset(name, split=split)
    return [Row(dict(row), f"hf:{name}[{split}] row {i}") for i, row in enumerate(dataset)]
