"""Message logs: conversations whose messages carry their own token ids, rendered with the tokenizer's
chat template, and flattened into padded `input_ids`, `input_lengths` and a trained-token `token_mask`."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.data.vision import (
    batch_vision_inputs,
    has_images,
    image_parts,
    process_message_images,
    strip_image_payloads,
)
from posttrain.distributed.batched_data_dict import BatchedDataDict

Message = dict[str, Any]


def _render(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool, tools: list | None = None
) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def tokenize_message_log(
    messages: list[Message],
    tokenizer: Any,
    add_generation_prompt: bool = False,
    processor: Any = None,
    base_dir: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[Message]:
    """Each message gets `token_ids`: the tokens the chat template adds for it (the last one also gets
    the assistant generation prompt when asked), so the concatenation is the whole rendered conversation.
    `tools` (OpenAI function schemas) go to the chat template's own `tools=` argument.

    A message with image parts also gets `pixel_values` and `image_grid_thw` from `processor` (a
    vision-language model's, see posttrain.data.vision), and its image pad token is repeated once per merged
    patch."""
    if processor is None and has_images(messages):
        raise ValueError(
            "the row has images but the model is text-only (its directory has no vision tower and "
            "image processor); use a vision-language model or drop the images"
        )
    result, previous = [], ""
    for i, message in enumerate(messages):
        last = i == len(messages) - 1
        text = _render(tokenizer, messages[: i + 1], add_generation_prompt and last, tools)
        if not text.startswith(previous):
            raise ValueError("the chat template does not render conversations incrementally")
        delta, vision = text[len(previous) :], {}
        if image_parts(message["content"]):
            vision = process_message_images(message, processor, base_dir)
            delta = processor.expand_image_tokens(delta, vision["image_grid_thw"])
        ids = tokenizer(delta, add_special_tokens=False)["input_ids"]
        if processor is not None:
            check_image_tokens(ids, processor, vision)
        content = strip_image_payloads(message["content"])
        result.append(
            {**message, "content": content, "token_ids": torch.tensor(ids, dtype=torch.long), **vision}
        )
        previous = text
    return result


def check_image_tokens(ids: list[int], processor: Any, vision: dict[str, torch.Tensor]) -> None:
    """A message's image pad tokens must be exactly its images' merged patches (a pad typed in the text
    would leave the model a placeholder without pixels)."""
    expected = sum(processor.num_image_tokens(vision["image_grid_thw"])) if vision else 0
    found = sum(1 for i in ids if i == processor.image_token_id)
    if found != expected:
        raise ValueError(
            f"a message has {found} image placeholder tokens ({processor.image_token}) where its "
            f"{len(vision.get('image_grid_thw', []))} image(s) need {expected}; remove placeholders "
            "from the text, images are given as {'type': 'image'} parts"
        )


def message_log_length(message_log: list[Message]) -> int:
    return sum(len(m["token_ids"]) for m in message_log)


def trained_messages(message_log: list[Message], train_on: str) -> list[bool]:
    """Which messages' tokens are trained on: assistant turns, the last one ("last_assistant", data.train_on),
    or for RL "sampled": the turns the policy sampled (they have `generation_logprobs`, few-shot ones not)."""
    if train_on == "sampled":
        return ["generation_logprobs" in m for m in message_log]
    assistant = [m["role"] == "assistant" for m in message_log]
    if train_on == "last_assistant":
        last = max((i for i, a in enumerate(assistant) if a), default=-1)
        return [i == last for i in range(len(message_log))]
    return assistant


def message_log_to_flat(
    message_logs: list[list[Message]], pad_token_id: int, train_on: str = "assistant"
) -> BatchedDataDict:
    """Right-padded `input_ids [B,T]`, `input_lengths [B]`, `token_mask [B,T]` (1 on trained tokens,
    never position 0) and `sample_mask [B]` (all 1); with images, per-row `pixel_values` and `image_grid_thw`
    lists (posttrain.data.vision)."""
    lengths = [message_log_length(log) for log in message_logs]
    max_len = max(lengths)
    input_ids = torch.full((len(message_logs), max_len), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros((len(message_logs), max_len), dtype=torch.float32)
    for row, log in enumerate(message_logs):
        position = 0
        for message, trained in zip(log, trained_messages(log, train_on)):
            n = len(message["token_ids"])
            input_ids[row, position : position + n] = torch.as_tensor(message["token_ids"], dtype=torch.long)
            if trained:
                token_mask[row, position : position + n] = 1.0
            position += n
    token_mask[:, 0] = 0.0  # position 0 has no logprob (nothing precedes it)
    masks = {"token_mask": token_mask, "sample_mask": torch.ones(len(message_logs), dtype=torch.float32)}
    lengths = torch.tensor(lengths, dtype=torch.long)
    return BatchedDataDict(
        input_ids=input_ids, input_lengths=lengths, **masks, **batch_vision_inputs(message_logs)
    )
