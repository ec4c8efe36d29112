"""The KV cache in a Hugging Face forward's arguments and outputs, by the name the installed transformers
uses: `cache` from transformers 5 on (where `past_key_values` is deprecated, to be removed), else
`past_key_values`."""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=None)
def _cache_keyword(forward_class: type) -> str:
    parameters = inspect.signature(forward_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model(...)`, under the name its forward takes."""
    return {_cache_keyword(type(model)): cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned (a ModelOutput): its `cache`, else its `past_key_values`."""
    return output["cache"] if "cache" in output else output["past_key_values"]
