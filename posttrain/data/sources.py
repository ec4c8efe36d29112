"""Rows from local files (JSONL, JSON, Parquet, CSV) or Hugging Face datasets, each tagged with where it
came from so that a bad row is reported by file and line (or row index). Text files are UTF-8, with or
without a byte-order mark."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"


class DataError(ValueError):
    """A row that cannot be used; the message names the file and line (or row index)."""


@dataclass
class Row:
    values: dict[str, Any]
    where: str  # "data/train.jsonl:12" or "data/train.csv row 3" or "hf:gsm8k[train] row 5"
    base_dir: str | None = None  # the data file's directory: relative image paths are looked up there first


@dataclass
class SkipCounter:
    """Rows skipped by `skip_invalid`, and samples truncated or dropped for length."""

    skip_invalid: bool = False
    invalid: int = 0
    truncated: int = 0
    dropped: int = 0

    def bad_row(self, where: str, problem: str) -> None:
        """A row that cannot be used: counted with `skip_invalid`, else a DataError naming `where`."""
        if not self.skip_invalid:
            raise DataError(f"{where}: {problem}") from None
        self.invalid += 1


def is_file_source(source: str) -> bool:
    return source.endswith(FILE_SUFFIXES)


def looks_like_hub_name(name: str, single_word: bool = False) -> bool:
    """`org/name` (or, with `single_word`, a bare `name` like the legacy `gpt2`), as hub ids are spelled."""
    pattern = rf"{_HUB_PART}(/{_HUB_PART})?" if single_word else rf"{_HUB_PART}/{_HUB_PART}"
    return re.fullmatch(pattern, name) is not None and ".." not in name


def _text_lines(path: Path, counter: SkipCounter) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file, a leading BOM dropped; a line that is not UTF-8 is a bad row
    (`SkipCounter.bad_row`)."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                yield line_number, raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                problem = f"not UTF-8 text ({error.reason} at byte {error.start} of the line)"
                counter.bad_row(f"{path}:{line_number}", problem)


def read_jsonl(path: Path, counter: SkipCounter) -> list[Row]:
    rows = []
    for line_number, line in _text_lines(path, counter):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError(f"expected a JSON object, got {type(value).__name__}")
        except ValueError as error:
            counter.bad_row(where, f"malformed JSON line: {error}")
            continue
        rows.append(Row(value, where))
    return rows


def read_csv(path: Path, counter: SkipCounter) -> list[Row]:
    """Rows of a CSV file with a header line; each named by the file line it starts on."""
    numbered = list(_text_lines(path, counter))
    reader = csv.reader(line for _, line in numbered)
    try:
        header = next(reader)
    except StopIteration:
        raise DataError(f"{path}: empty CSV file (no header line)") from None
    rows = []
    while True:
        start = numbered[reader.line_num][0] if reader.line_num < len(numbered) else None
        try:
            fields = next(reader)
        except StopIteration:
            return rows
        except csv.Error as error:
            fields, problem = None, f"malformed CSV: {error}"
        else:
            problem = None
            if len(fields) != len(header) and any(fields):
                problem = f"expected {len(header)} fields ({', '.join(header)}), got {len(fields)}"
        if fields is not None and not any(fields):
            continue  # a blank line
        if problem:
            counter.bad_row(f"{path}:{start}", problem)
            continue
        rows.append(Row(dict(zip(header, fields)), f"{path}:{start}"))


def read_table(path: Path) -> list[Row]:
    """JSON (a list of objects, or {"data": [...]}) or Parquet rows with their index."""
    if path.suffix == ".json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as error:
            line = raw[: error.start].count(b"\n") + 1
            raise DataError(
                f"{path}:{line}: not UTF-8 text ({error.reason}); a .json file is read whole, so "
                "data.skip_invalid cannot skip it"
            ) from None
        except ValueError as error:
            raise DataError(f"{path}: malformed JSON: {error}") from None
        data = data.get("data", data) if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a list of objects (or {{'data': [...]}})")
        return [
            Row(dict(v) if isinstance(v, dict) else {"_invalid": v}, f"{path} row {i}")
            for i, v in enumerate(data)
        ]
    import pandas

    records = pandas.read_parquet(path).to_dict(orient="records")
    return [Row(_plain(record), f"{path} row {i}") for i, record in enumerate(records)]


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


def missing_file(name: str) -> str | None:
    """None when the data file `name` exists; else why not (a relative path says where it was looked for)."""
    if Path(name).is_file():
        return None
    where = "" if Path(name).is_absolute() else f" (looked for {Path(name).resolve()})"
    return f"data file {name} does not exist{where}"


def read_file(path: str, counter: SkipCounter, key: str = "data.dataset") -> list[Row]:
    file = Path(path)
    if problem := missing_file(path):
        raise FileNotFoundError(f"{key}: {problem}")
    if file.suffix == ".jsonl":
        rows = read_jsonl(file, counter)
    elif file.suffix == ".csv":
        rows = read_csv(file, counter)
    else:
        rows = read_table(file)
    for row in rows:
        row.base_dir = str(file.parent)
    return rows


def read_hf_dataset(name: str, split: str) -> list[Row]:
    """A Hugging Face dataset split by name (needs the network the first time)."""
    import datasets

    dataset = datasets.load_dataset(name, split=split)
    return [Row(dict(row), f"hf:{name}[{split}] row {i}") for i, row in enumerate(dataset)]
