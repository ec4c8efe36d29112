"""Data: sources (files, Hugging Face, built-in tasks) -> records with tokenized message logs; flattening
into training batches; a seeded, resumable data loader.

A record (`DatumSpec`) has `message_log` (messages with `token_ids`; for `rl` the prompt only, ending with
the assistant generation prompt), `length`, `extra_env_info` (`ground_truth` and task metadata),
`task_name`, `idx`, and for preferences `chosen_message_log` / `rejected_message_log`."""

from posttrain.data.config import DataConfig
from posttrain.data.loader import StatefulDataLoader
from posttrain.data.message_log import message_log_to_flat, tokenize_message_log
from posttrain.data.records import DatumSpec, load_all_records, load_datasets, rows_to_records
from posttrain.data.sources import DataError

__all__ = [
    "DataConfig",
    "DataError",
    "DatumSpec",
    "StatefulDataLoader",
    "load_all_records",
    "load_datasets",
    "message_log_to_flat",
    "rows_to_records",
    "tokenize_message_log",
]
