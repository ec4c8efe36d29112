"""Validation samples of the supervised algorithms (SFT, DPO, RM): for `logger.num_val_samples_to_print`
validation rows, the prompt, the reference response and what the current model makes of it (its greedy
answer, or for a reward model its scores of the chosen and rejected responses), printed and saved by the
logger like GRPO's samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.vision import VISION_KEYS
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.workers.generation import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker


@dataclass
class PromptReference:
    """One validation row cut at its first trained token: the prompt before it, the trained tokens after."""

    prompt_ids: list[int]
    reference_ids: list[int]


def split_row(input_ids: torch.Tensor, token_mask: torch.Tensor, length: int) -> PromptReference:
    """`input_ids [T]` and `token_mask [T]` of one row of `length` tokens: prompt = tokens before the first
    masked-in token, reference = the masked-in tokens (the response trained on)."""
    ids, mask = input_ids[:length].tolist(), token_mask[:length].tolist()
    first = next((t for t, m in enumerate(mask) if m), length)
    return PromptReference(ids[:first], [token for token, m in zip(ids, mask) if m])


def pick_rows(batches: list[Any], num_rows: int, stride: int) -> list[dict[str, torch.Tensor]]:
    """The first `num_rows` real rows (sample_mask 1) of the validation batches, taking every `stride`-th
    row (2 for preference pairs: row 2i chosen, 2i+1 rejected), each with its following row as `next_*`."""
    rows: list[dict[str, torch.Tensor]] = []
    for batch in batches:
        for i in range(0, batch.size, stride):
            if len(rows) == num_rows:
                return rows
            if "sample_mask" in batch and not batch["sample_mask"][i]:
                continue
            row = {key: batch[key][i] for key in ("input_ids", "token_mask", "input_lengths")}
            row.update({key: batch[key][i] for key in VISION_KEYS if key in batch})  # a VLM's images
            if stride == 2:
                row.update(
                    {
                        f"rejected_{key}": batch[key][i + 1]
                        for key in ("input_ids", "token_mask", "input_lengths")
                    }
                )
            rows.append(row)
    return rows


def greedy_answers(
    policy: Any, prompts: list[list[int]], max_new_tokens: int, images: dict[str, list] | None = None
) -> list[list[int]]:
    """Greedy continuations of `prompts` (with their per-row `images` for a vision-language model) by the
    policy's current weights, decoded on the driver with the Hugging Face generation code (one copy of the
    model, loaded for this call)."""
    cfg = GenerationConfig(backend="hf", max_new_tokens=max_new_tokens)
    worker = HFGenerationWorker(cfg, policy.cfg.model_name, policy.cfg.tokenizer_name)
    worker.update_weights(policy.get_weights(only_changed=False))
    lengths = torch.tensor([len(p) for p in prompts])  # [B]
    input_ids = torch.full((len(prompts), int(lengths.max())), worker.pad_id, dtype=torch.long)  # [B, T]
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt)
    out = worker.generate({"input_ids": input_ids, "input_lengths": lengths, **(images or {})}, greedy=True)
    return [
        out["output_ids"][i, lengths[i] : out["unpadded_sequence_lengths"][i]].tolist()
        for i in range(len(prompts))
    ]


def causal_lm_samples(
    policy: Any, tokenizer: Any, rows: list[dict[str, torch.Tensor]]
) -> list[dict[str, Any]]:
    """prompt / reference / greedy answer per row; reward 1 when the answer's text equals the reference's."""
    cuts = [split_row(r["input_ids"], r["token_mask"], int(r["input_lengths"])) for r in rows]
    max_new_tokens = max(len(cut.reference_ids) for cut in cuts) + 8
    images = {key: [r[key] for r in rows] for key in VISION_KEYS if key in rows[0]}
    answers = greedy_answers(policy, [cut.prompt_ids for cut in cuts], max_new_tokens, images)
    samples = []
    for cut, answer_ids in zip(cuts, answers):
        reference = tokenizer.decode(cut.reference_ids, skip_special_tokens=True).strip()
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
        prompt = tokenizer.decode(cut.prompt_ids, skip_special_tokens=True)
        turns = [("user", prompt), ("reference", reference), ("assistant", answer)]
        message_log = [{"role": role, "content": content} for role, content in turns]
        samples.append({"message_log": message_log, "reward": float(answer == reference)})
    return samples


def reward_model_samples(
    policy: Any, tokenizer: Any, rows: list[dict[str, torch.Tensor]]
) -> list[dict[str, Any]]:
    """prompt / chosen (the reference) / rejected with the model's score of each; reward = the margin."""
    keys = ("input_ids", "token_mask", "input_lengths")
    width = max(int(r["input_ids"].shape[0]) for r in rows)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[0])) if t.dim() else t  # noqa: E731
    stacked = {key: torch.stack([pad(r[p + key]) for r in rows for p in ("", "rejected_")]) for key in keys}
    scores = policy.get_scores(BatchedDataDict(stacked))["scores"].tolist()  # [2 x rows], chosen first
    samples = []
    for i, row in enumerate(rows):
        chosen = split_row(row["input_ids"], row["token_mask"], int(row["input_lengths"]))
        rejected = split_row(
            row["rejected_input_ids"], row["rejected_token_mask"], int(row["rejected_input_lengths"])
        )
        chosen_score, rejected_score = scores[2 * i], scores[2 * i + 1]
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        turns = [
            ("user", decode(chosen.prompt_ids)),
            ("reference", f"(score {chosen_score:.4g}) {decode(chosen.reference_ids)}"),
            ("rejected", f"(score {rejected_score:.4g}) {decode(rejected.reference_ids)}"),
        ]
        message_log = [{"role": role, "content": content} for role, content in turns]
        samples.append({"message_log": message_log, "reward": chosen_score - rejected_score})
    return samples


def log_supervised_samples(
    logger: Any, policy: Any, tokenizer: Any, val_batches: list[Any], step: int, pairs: bool = False
) -> list[dict[str, Any]]:
    """Print and save (val_samples/step_N.jsonl) `logger.num_val_samples_to_print` validation samples;
    `pairs`: the batches hold chosen/rejected rows (DPO, RM). Nothing happens when the number is 0."""
    num_rows = logger.cfg.num_val_samples_to_print
    if num_rows <= 0 or not val_batches:
        return []
    rows = pick_rows(val_batches, num_rows, stride=2 if pairs else 1)
    if policy.cfg.model_kind == "reward_model":
        samples = reward_model_samples(policy, tokenizer, rows)
    else:
        samples = causal_lm_samples(policy, tokenizer, rows)
    logger.log_val_samples(samples, step)
    return samples
