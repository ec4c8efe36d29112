"""Vision-language models: the tiny offline Qwen2-VL built from `model.from_config` (architecture `qwen2_vl`),
its processor (the project's character tokenizer with vision tokens, and a Qwen2-VL image processor built
from keyword arguments, no hub), and how to tell a vision-language model directory from a text-only one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken

from posttrain.models.cache_api import returned_cache
from posttrain.models.tokenizer import TOKENIZERS, load_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = VISION_TOKENS

# Like the text template (posttrain.models.tokenizer), but a message's content may be a list of parts:
# {"type": "image"} renders as <|vision_start|><|image_pad|><|vision_end|> (the processor repeats the pad once
# per merged image patch), {"type": "text", "text": ...} as its text.
VLM_CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}{% if part['type'] == 'image' %}{{ "
    "'<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ raise_exception('unsupported content part: ' + part['type']) }}{% endif %}{% endfor %}"
    "{% endif %}{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + render(message['content']) }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + render(message['content']) }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + render(message['content']) + '<eos>' }}"
    "{% elif message['role'] == 'tool' %}{{ '<|tool|>' + render(message['content']) }}"
    "{% elif message['role'] == 'environment' %}{{ '<|env|>' + render(message['content']) }}"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The tiny vision tower: 4x4-pixel patches, 2x2 of them merged into one language token, so a 32x32 image is
# 64 patches and 16 image tokens.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 4, 2, 2
VISION_EMBED_DIM, VISION_DEPTH, VISION_HEADS = 32, 1, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64


def build_vlm_tokenizer(kind: str = "char") -> Any:
    """The project's tokenizer (`char` or `byte`) with the four vision special tokens and the VLM chat
    template."""
    tokenizer = TOKENIZERS[kind]()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in VISION_TOKENS]}
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_image_processor() -> Any:
    """A Qwen2-VL image processor (PIL backend) for the tiny tower: images resized to multiples of 8 pixels
    between 16x16 and 64x64 pixels in area."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


def build_processor(kind: str = "char") -> VisionProcessor:
    """The processor of the tiny model (tokenizer with the VLM chat template + image processor), offline."""
    return VisionProcessor(build_vlm_tokenizer(kind), build_image_processor())


class VisionProcessor:
    """A tokenizer and an image processor: what Qwen2-VL's `AutoProcessor` does for images, without its video
    processor (which needs torchvision). `expand_image_tokens` repeats each image's pad token once per merged
    patch, as the Hugging Face processor does."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str = IMAGE_PAD) -> None:
        self.tokenizer, self.image_processor, self.image_token = tokenizer, image_processor, image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.merge_size = int(image_processor.merge_size)

    def process_images(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """`pixel_values [P, D]` (the patches of all images, in order) and `image_grid_thw [N, 3]`."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def num_image_tokens(self, image_grid_thw: torch.Tensor) -> list[int]:
        return (image_grid_thw.prod(-1) // self.merge_size**2).tolist()

    def expand_image_tokens(self, text: str, image_grid_thw: torch.Tensor) -> str:
        """Replace the i-th image token of `text` by as many as image i has merged patches."""
        pieces = text.split(self.image_token)
        counts = self.num_image_tokens(image_grid_thw)
        if len(pieces) - 1 != len(counts):
            raise ValueError(
                f"the text has {len(pieces) - 1} image placeholders but {len(counts)} images were given"
            )
        return pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))

    def save_pretrained(self, out_dir: str | Path) -> None:
        self.tokenizer.save_pretrained(out_dir)
        self.image_processor.save_pretrained(out_dir)


def make_vlm_config(cfg: Any, tokenizer: Any) -> Any:
    """A Qwen2-VL config from `ModelFromConfig` (text sizes) and the fixed tiny vision tower above."""
    from transformers import Qwen2VLConfig

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    half = head_dim // 2  # M-RoPE splits the rotary frequencies into temporal / height / width sections
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_dropout": cfg.attention_dropout,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision_config = {
        "depth": VISION_DEPTH,
        "embed_dim": VISION_EMBED_DIM,
        "hidden_size": cfg.hidden_size,
        "mlp_ratio": 2,
        "num_heads": VISION_HEADS,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_vlm_dir(cfg: Any, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory (weights, config, tokenizer, processor) of a seeded random tiny
    Qwen2-VL."""
    from transformers import Qwen2VLForConditionalGeneration

    processor = build_processor(cfg.tokenizer)
    hf_config = make_vlm_config(cfg, processor.tokenizer)
    build = lambda: Qwen2VLForConditionalGeneration(hf_config).to(torch.float32)  # noqa: E731
    return write_seeded_model(build, cfg.seed, processor.tokenizer, processor, out_dir)


def write_seeded_model(
    build: Callable[[], torch.nn.Module], seed: int, tokenizer: Any, saved_with: Any, out_dir: str | Path
) -> Path:
    """Build a model with `build()` under `seed` (in a private RNG state: the caller's global stream is left
    as it was), give its generation config the tokenizer's pad/bos/eos ids, and save it and `saved_with`
    (the tokenizer, or a vision-language model's processor) to `out_dir`. Returns the directory."""
    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        saved_with.save_pretrained(out_dir)
    except OSError as error:
        raise OSError(f"could not write the model directory {out_dir}: {error}") from error
    return out_dir


def is_vision_language_dir(path_or_name: str | Path) -> bool:
    """True when a local model directory's config has a vision tower (`vision_config`)."""
    config_file = Path(path_or_name) / "config.json"
    if not config_file.is_file():
        return False
    return "vision_config" in json.loads(config_file.read_text())


def is_vision_language_model(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def load_processor(path_or_name: str | Path) -> VisionProcessor:
    """The tokenizer and image processor saved with a vision-language model (offline for a local
    directory)."""
    from transformers import AutoImageProcessor

    tokenizer = load_tokenizer(path_or_name)
    image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
    return VisionProcessor(tokenizer, AutoImageProcessor.from_pretrained(str(path_or_name)), image_token)


def concat_row_images(
    data: dict[str, Any], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(`pixel_values [P, D]`, `image_grid_thw [N, 3]`) of a micro-batch's rows, in row order, or (None, None)
    when none of its rows has an image."""
    pairs = zip(data.get("pixel_values") or [], data.get("image_grid_thw") or [])
    rows = [(p, g) for p, g in pairs if g.shape[0] > 0]
    if not rows:
        return None, None
    return torch.cat([p for p, _ in rows]).to(device), torch.cat([g for _, g in rows]).long().to(device)


def mrope_position_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's 3-D rotary positions `[3, B, T]` (an image's tokens share a temporal position and take their
    row/column as height/width, the text after it continues from the largest) and each row's offset `[B, 1]`
    of the next text position from its token count. Padding (attention_mask 0) gets position 0; left or right
    padding both work."""
    token_types = (input_ids == model.config.image_token_id).int()  # [B, T]: 1 on image tokens
    return model.model.get_rope_index(
        input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
    )


def vision_forward_inputs(
    model: torch.nn.Module, data: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Extra forward arguments of a vision-language model: the micro-batch's images and M-RoPE positions
    (computed here for every micro-batch, with or without images, so that a row's logprobs do not depend on
    its neighbours). {} for a text-only model; an error when a text-only model is given images."""
    pixel_values, image_grid_thw = concat_row_images(data, input_ids.device)
    if not is_vision_language_model(model):
        if pixel_values is not None:
            raise ValueError(f"{type(model).__name__} is a text-only model but the batch has images")
        return {}
    position_ids, _ = mrope_position_ids(model, input_ids, attention_mask, image_grid_thw)
    inputs = {"position_ids": position_ids}
    if pixel_values is not None:
        inputs.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return inputs


def vision_tower_anchor(model: torch.nn.Module) -> torch.Tensor | float:
    """0 x (sum of the vision tower's weights) while gradients are on, else 0.

    Added to the output of every training forward, it gives each vision weight a (zero) gradient even in a
    micro-batch without images, so that every data-parallel rank reduce-scatters the same gradients (FSDP2
    would otherwise hang or mix up tensors when one rank's micro-batch had images and another's had none).
    The tower is sharded with the root module, whose weights stay gathered after the forward."""
    if not (torch.is_grad_enabled() and is_vision_language_model(model)):
        return 0.0
    return 0.0 * sum(p.sum() for p in model.model.visual.parameters())


def vision_prefill(
    model: torch.nn.Module, left_ids: torch.Tensor, attention_mask: torch.Tensor, data: dict[str, Any]
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Generation's first step for a vision-language model: the KV cache of left-padded prompts [B, T] with
    their images, the last position's logits [B, V], and each row's offset [B, 1] of the next text position
    from its token count (M-RoPE gives an image fewer positions than tokens). Every sample is prefilled:
    two prompts with the same tokens may show different images."""
    pixel_values, image_grid_thw = concat_row_images(data, left_ids.device)
    position_ids, offsets = mrope_position_ids(model, left_ids, attention_mask, image_grid_thw)
    images = {} if pixel_values is None else {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    inputs = {"input_ids": left_ids, "attention_mask": attention_mask, "position_ids": position_ids, **images}
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    return returned_cache(out), out.logits[:, -1, :], offsets.to(left_ids.device)


def processor_for(model_name: str | Path, tokenizer_name: str | Path | None = None) -> VisionProcessor | None:
    """The processor the data pipeline needs for a vision-language model directory; None for a text-only
    model (rows with images then fail, naming file and line)."""
    if not is_vision_language_dir(model_name):
        return None
    return load_processor(tokenizer_name or model_name)


def vision_token_ids(model: torch.nn.Module) -> list[int]:
    """The placeholder tokens of images and videos and their delimiters, which generation must never draw
    (each stands for patches that a generated text has not got); [] for a text-only model."""
    if not is_vision_language_model(model):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(model.config, n)) for n in names if getattr(model.config, n, None) is not None]
