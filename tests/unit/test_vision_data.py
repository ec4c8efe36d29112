"""Images through the data pipeline (no Ray): messages with image parts and image-path columns become
records whose tokens hold one image pad per merged patch and whose patches travel with their row; bad
images stop loading naming the file and line, or are skipped and counted with `data.skip_invalid`; the
built-in visual task is reproducible from its seed."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from posttrain.data import DataConfig, DataError, load_datasets, message_log_to_flat
from posttrain.data.visual_tasks import red_squares_rows
from posttrain.models.tokenizer import build_char_tokenizer
from posttrain.models.vlm import IMAGE_PAD, build_processor

PROCESSOR = build_processor()
TOKENIZER = PROCESSOR.tokenizer


def write_rows(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def image_message_row(image: str, answer: str = "2") -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "How many?"}],
            },
            {"role": "assistant", "content": answer},
        ]
    }


def load(tmp_path, rows, processor=PROCESSOR, tokenizer=TOKENIZER, **overrides):
    cfg = DataConfig(dataset=write_rows(tmp_path, rows), val_fraction=0.0, max_length=128, **overrides)
    return load_datasets(cfg, tokenizer, processor)


def test_image_messages_and_path_columns_become_patches_and_pad_tokens(tmp_path):
    """A 16x16 image is 4x4 patches of 4 pixels -> 16 patches of 3x2x4x4 = 96 values, merged 2x2 into 4 pad
    tokens; a 24x40 (width x height) image is 10x6 patches -> 60 patches, 15 pad tokens. The relative path is
    found next to
    the data file; a text-only row in the same file has no patches."""
    Image.new("RGB", (16, 16), "red").save(tmp_path / "a.png")
    Image.new("RGB", (24, 40), "blue").save(tmp_path / "b.png")
    rows = [
        image_message_row("a.png"),
        {"prompt": "Colour?", "images": ["b.png"], "response": "blue"},
        {"prompt": "No image", "response": "ok"},
    ]
    train, _, stats = load(tmp_path, rows)
    pad = TOKENIZER.convert_tokens_to_ids(IMAGE_PAD)
    assert [int((torch.cat([m["token_ids"] for m in r["message_log"]]) == pad).sum()) for r in train] == [
        4,
        15,
        0,
    ]
    batch = message_log_to_flat([r["message_log"] for r in train], TOKENIZER.pad_token_id)
    assert [tuple(p.shape) for p in batch["pixel_values"]] == [(16, 96), (60, 96), (0, 0)]
    assert [g.tolist() for g in batch["image_grid_thw"]] == [[[1, 4, 4]], [[1, 10, 6]], []]
    assert train[0]["message_log"][0]["content"][0] == {
        "type": "image",
        "image": "a.png",
    }  # no pixels kept there
    assert stats["skipped_invalid"] == 0


def test_missing_unreadable_and_text_only_images_name_file_and_line(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    Image.new("RGB", (16, 16)).save(tmp_path / "ok.png")
    path = write_rows(tmp_path, [image_message_row("ok.png"), image_message_row("missing.png")])
    with pytest.raises(DataError, match=rf"{path}:2: image file missing.png does not exist"):
        load(tmp_path, [image_message_row("ok.png"), image_message_row("missing.png")])
    with pytest.raises(DataError, match=r"train.jsonl:1: image broken.png is not a readable image"):
        load(tmp_path, [image_message_row("broken.png")])
    with pytest.raises(DataError, match=r"train.jsonl:1: the row has images but the model is text-only"):
        load(tmp_path, [image_message_row("ok.png")], processor=None, tokenizer=build_char_tokenizer())


def test_skip_invalid_counts_bad_image_rows(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG truncated")
    Image.new("RGB", (16, 16)).save(tmp_path / "ok.png")
    rows = [image_message_row("ok.png"), image_message_row("missing.png"), image_message_row("broken.png")]
    train, _, stats = load(tmp_path, rows, skip_invalid=True)
    assert len(train) == 1 and stats["skipped_invalid"] == 2


def test_red_squares_task_is_seeded_and_its_answer_counts_red_cells():
    train, val = red_squares_rows(8, 4, seed=0)
    again, _ = red_squares_rows(8, 4, seed=0)
    assert [r["answer"] for r in train] == [r["answer"] for r in again]
    for row in train + val:
        pixels = list(row["images"][0].getdata())
        assert pixels.count((220, 30, 30)) == 16 * int(row["answer"])  # each red cell is 4x4 pixels
    assert list(train[0]["images"][0].getdata()) == list(again[0]["images"][0].getdata())


def test_parquet_image_bytes_column_as_datasets_stores_it(tmp_path):
    """An `images` column of {"bytes": PNG, "path": None} structs (how Hugging Face datasets write images to
    Parquet) gives the same patches as the picture itself."""
    import io

    import pandas

    image = Image.new("RGB", (16, 16), (10, 200, 30))
    png = io.BytesIO()
    image.save(png, format="PNG")
    path = tmp_path / "train.parquet"
    pandas.DataFrame(
        [{"prompt": "Colour?", "images": {"bytes": png.getvalue(), "path": None}, "response": "green"}]
    ).to_parquet(path)
    train, _, _ = load_datasets(
        DataConfig(dataset=str(path), val_fraction=0.0, max_length=64), TOKENIZER, PROCESSOR
    )
    expected = PROCESSOR.process_images([image])["pixel_values"]
    torch.testing.assert_close(train[0]["message_log"][0]["pixel_values"], expected)
