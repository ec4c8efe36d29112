"""Images in messages: content lists with `{"type": "image", "image": ...}` parts (a file path, raw bytes,
`{"bytes": ...}`/`{"path": ...}` as Parquet/HF datasets store them, or a PIL image), loaded, processed by the
model's processor into patches, and the per-row vision inputs of a batch.

A message with images carries `pixel_values [P, D]` (the patches of its images, in order) and
`image_grid_thw [N, 3]` next to its `token_ids`, whose image pad token is repeated once per merged patch.
A batch carries them per row as lists (`pixel_values[i]` is row i's patches, `[0, 0]` for a row without
images), so that every row operation of `BatchedDataDict` (shard, select, micro-batch) keeps a row's
patches with its tokens; the model's forward concatenates them in row order."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

VISION_KEYS = ("pixel_values", "image_grid_thw")


def image_parts(content: Any) -> list[dict]:
    """The image parts of a message's content (a string has none)."""
    if not isinstance(content, list):
        return []
    return [part for part in content if isinstance(part, dict) and part.get("type") == "image"]


def has_images(messages: list[dict]) -> bool:
    return any(image_parts(m.get("content")) for m in messages)


def _describe(source: Any) -> str:
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    return f"<{type(source).__name__}>"


def load_image(source: Any, base_dir: str | None = None) -> Any:
    """An RGB PIL image from a path (relative paths: next to the data file, else the working directory),
    bytes, a `{"bytes"|"path": ...}` dict or a PIL image. Errors name the file."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        opened = io.BytesIO(source)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).exists():
            path = Path(base_dir) / path
        if not path.is_file():
            where = (
                f" (looked next to the data file in {base_dir} and in the working directory)"
                if base_dir
                else ""
            )
            raise FileNotFoundError(f"image file {source} does not exist{where}")
        opened = path
    else:
        raise ValueError(f"an image must be a path, bytes or a PIL image, got {type(source).__name__}")
    try:
        with Image.open(opened) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"image {_describe(source)} is not a readable image: {error}") from None


def strip_image_payloads(content: Any) -> Any:
    """The content with image parts reduced to `{"type": "image"}` (plus the path, when it was one): records
    and rollouts carry the processed patches, not the images."""
    if not isinstance(content, list):
        return content
    stripped = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            source = part.get("image")
            path = {"image": str(source)} if isinstance(source, (str, Path)) else {}
            stripped.append({"type": "image", **path})
        else:
            stripped.append(part)
    return stripped


def process_message_images(message: dict, processor: Any, base_dir: str | None) -> dict[str, torch.Tensor]:
    """`pixel_values` and `image_grid_thw` of a message's images (in content order)."""
    images = [load_image(part.get("image"), base_dir) for part in image_parts(message["content"])]
    return processor.process_images(images)


def row_vision_inputs(message_log: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(`pixel_values [P, D]`, `image_grid_thw [N, 3]`) of a whole conversation; `[0, 0]` and `[0, 3]` without
    images."""
    with_images = [m for m in message_log if "pixel_values" in m]
    if not with_images:
        return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
    pixel_values = torch.cat([m["pixel_values"] for m in with_images])
    return pixel_values, torch.cat([m["image_grid_thw"] for m in with_images]).long()


def batch_vision_inputs(message_logs: list[list[dict]]) -> dict[str, list[torch.Tensor]]:
    """Per-row `pixel_values` and `image_grid_thw` lists of a batch, or {} when no row has an image."""
    if not any("pixel_values" in m for log in message_logs for m in log):
        return {}
    rows = [row_vision_inputs(log) for log in message_logs]
    return {"pixel_values": [p for p, _ in rows], "image_grid_thw": [g for _, g in rows]}


def content_text(content: Any) -> str:
    """A message's content as text: a string as is; a content list's text parts, each image as `<image>`."""
    if not isinstance(content, list):
        return content
    return "".join("<image>" if part.get("type") == "image" else part.get("text", "") for part in content)
