"""Single- and multi-turn rollouts: generate for the active samples, let each task's environment answer,
append the assistant message and the observation, and stop samples that terminate, hit the turn limit
or would exceed `max_seq_len`.

A message in a message log is `{"role", "content", "token_ids"}`; assistant messages also carry
`generation_logprobs` (one per token id) and, from partial rollouts, `generation_weight_versions` (the
policy version that generated each token). The concatenated token ids of a log are the conversation."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from posttrain.data.tool_calls import strip_end_markers
from posttrain.data.vision import batch_vision_inputs
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.utils.timer import Timer


def flat_token_ids(message_log: list[dict[str, Any]]) -> torch.Tensor:
    return torch.cat([torch.as_tensor(m["token_ids"], dtype=torch.long) for m in message_log])


def build_generation_input(
    message_logs: list[list[dict]], stop_strings: list, pad_token_id: int
) -> BatchedDataDict:
    """Right-padded `input_ids`, `input_lengths`, per-sample `stop_strings` and, for prompts with images,
    per-row `pixel_values` / `image_grid_thw` for the generator."""
    sequences = [flat_token_ids(log) for log in message_logs]
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    input_ids = torch.full((len(sequences), int(lengths.max())), pad_token_id, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        input_ids[i, : len(sequence)] = sequence
    vision = batch_vision_inputs(message_logs)
    return BatchedDataDict(
        input_ids=input_ids, input_lengths=lengths, stop_strings=list(stop_strings), **vision
    )


def tokenize_observation(tokenizer, message_log: list[dict], observation: dict) -> list[int]:
    """Token ids that the chat template adds for `observation` plus the next assistant prompt.

    When `message_log` ends with a generated assistant turn, the ids also close that turn the way the
    template does (e.g. `<|im_end|>\n` after a turn that a stop string such as `</tool_call>` ended), less
    the end-of-turn token the generation already wrote."""
    plain = [{"role": m["role"], "content": m["content"]} for m in message_log]
    delta = _text_after_generation(tokenizer, plain, observation)
    if delta is None:
        before = tokenizer.apply_chat_template(plain, tokenize=False)
        after = tokenizer.apply_chat_template(
            plain + [observation], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError(
                "the chat template does not render conversations incrementally; cannot append turns"
            )
        delta = after[len(before) :]
    return tokenizer(delta, add_special_tokens=False)["input_ids"]


def _text_after_generation(tokenizer, plain: list[dict], observation: dict) -> str | None:
    """The template's text after the last assistant turn's generated text, through `observation` and the
    next assistant prompt (None when the log does not end with an assistant turn after a prompt, or the
    template does not render its content verbatim)."""
    if len(plain) < 2 or plain[-1]["role"] != "assistant":
        return None
    generated = plain[-1]["content"]
    content = strip_end_markers(generated)
    prompt = tokenizer.apply_chat_template(plain[:-1], tokenize=False, add_generation_prompt=True)
    conversation = plain[:-1] + [{"role": "assistant", "content": content}, observation]
    after = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if not after.startswith(prompt + content):
        return None
    delta, written_end = after[len(prompt + content) :], generated[len(content) :].strip()
    if written_end and delta.startswith(written_end):
        delta = delta[len(written_end) :]  # the generation already holds the end-of-turn token
    return delta


def _append_generations(message_logs, active, generated, tokenizer, max_seq_len) -> list[bool]:
    """Append each active sample's generation as an assistant message; returns which were cut to fit."""
    cut = []
    for j, i in enumerate(active):
        start = int(generated["input_lengths"][j])
        length = int(generated["generation_lengths"][j])
        room = max_seq_len - start
        keep = max(0, min(length, room))
        window = slice(start, start + keep)
        token_ids = generated["output_ids"][j, window]
        message = {
            "role": "assistant",
            "content": tokenizer.decode(token_ids, skip_special_tokens=False),
            "token_ids": token_ids.clone(),
            "generation_logprobs": generated["logprobs"][j, window].clone(),
        }
        # partial rollouts: the version of each token; an MoE generator: its experts per token [keep, L, k]
        for key in ("generation_weight_versions", "routed_experts"):
            if key in generated:
                message[key] = generated[key][j, window].clone()
        message_logs[i].append(message)
        cut.append(keep < length)
    return cut


def _step_environments(task_to_env, message_logs, metadata, task_names, indices, counts):
    """Call each task's environment once for its samples (each message as `role`, `content` and its
    `num_tokens`); the environments' `counts` are added to `counts`.

    Returns ({sample index: (EnvironmentReturn, position in it)}, number of reward-function errors)."""
    answers, num_errors = {}, 0
    for task in sorted({task_names[i] for i in indices}):
        if task not in task_to_env:
            raise KeyError(f"no environment for task {task!r}; configured: {sorted(task_to_env)}")
        task_indices = [i for i in indices if task_names[i] == task]
        logs = [
            [
                {"role": m["role"], "content": m["content"], "num_tokens": len(m["token_ids"])}
                for m in message_logs[i]
            ]
            for i in task_indices
        ]
        result = task_to_env[task].step(logs, [metadata[i] for i in task_indices])
        num_errors += result.num_errors
        for name, value in result.counts.items():
            counts[name] = counts.get(name, 0.0) + float(value)
        for position, i in enumerate(task_indices):
            answers[i] = (result, position)
    return answers, num_errors


def run_multi_turn_rollout(
    generation,
    batch: BatchedDataDict,
    tokenizer,
    task_to_env: dict,
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool = False,
    seed: int | None = None,
    timer: Timer | None = None,
) -> tuple[BatchedDataDict, dict[str, float]]:
    """Roll out every sample of `batch` (keys `message_log`, `extra_env_info`, `task_name`).

    Returns the batch with updated `message_log`, `extra_env_info`, and new `total_reward [B]`, `truncated
    [B]`, `num_turns [B]`, `answer` (last extracted answer) plus rollout metrics (the environments' `counts`,
    summed over the turns, as `env/<name>`). With `seed`, turn t samples with seed `seed + t`, so a resumed
    run regenerates the same rollouts. With a `timer`, the environments' steps are timed as "rewards"."""
    batch_size = len(batch["message_log"])
    message_logs = [list(log) for log in batch["message_log"]]
    metadata = [dict(m) for m in batch["extra_env_info"]]
    task_names = list(batch["task_name"])
    stop_strings = list(batch.get("stop_strings", [None] * batch_size))
    total_reward = torch.zeros(batch_size)
    done = torch.zeros(batch_size, dtype=torch.bool)
    truncated = torch.zeros(batch_size, dtype=torch.bool)
    num_turns = torch.zeros(batch_size, dtype=torch.long)
    answers: list[str | None] = [None] * batch_size
    num_env_errors, env_counts = 0, {}

    for turn in range(max_rollout_turns):
        active = [i for i in range(batch_size) if not done[i]]
        if not active:
            break
        gen_input = build_generation_input(
            [message_logs[i] for i in active], [stop_strings[i] for i in active], tokenizer.pad_token_id
        )
        generated = generation.generate(gen_input, greedy=greedy, seed=None if seed is None else seed + turn)
        generated["input_lengths"] = gen_input["input_lengths"]
        cut = _append_generations(message_logs, active, generated, tokenizer, max_seq_len)
        num_turns[active] += 1
        with timer.time("rewards") if timer is not None else nullcontext():
            env_answers, errors = _step_environments(
                task_to_env, message_logs, metadata, task_names, active, env_counts
            )
        num_env_errors += errors
        for j, i in enumerate(active):
            result, k = env_answers[i]
            total_reward[i] += result.rewards[k]
            metadata[i], answers[i] = result.metadata[k], result.answers[k]
            stop_strings[i] = result.next_stop_strings[k]
            if cut[j]:
                truncated[i] = done[i] = True
            elif bool(result.terminateds[k]):
                done[i] = True
            else:
                _append_observation(
                    message_logs, i, result.observations[k], tokenizer, max_seq_len, truncated, done
                )

    out = BatchedDataDict(batch)
    out.update(message_log=message_logs, extra_env_info=metadata, total_reward=total_reward, answer=answers)
    out.update(truncated=truncated, num_turns=num_turns)
    metrics = rollout_metrics(message_logs, total_reward, truncated, num_turns, done, num_env_errors)
    metrics.update({f"env/{name}": value for name, value in env_counts.items()})
    return out, metrics


def _append_observation(message_logs, i, observation, tokenizer, max_seq_len, truncated, done) -> None:
    token_ids = tokenize_observation(tokenizer, message_logs[i], observation)
    if len(flat_token_ids(message_logs[i])) + len(token_ids) >= max_seq_len:
        truncated[i] = done[i] = True  # no room for the observation and another answer
        return
    message_logs[i].append({**observation, "token_ids": torch.tensor(token_ids, dtype=torch.long)})


def generated_lengths(message_logs: list[list[dict]]) -> torch.Tensor:
    """Generated tokens of each conversation (its sampled assistant turns). [B] float"""
    return torch.tensor(
        [float(sum(len(m["token_ids"]) for m in log if "generation_logprobs" in m)) for log in message_logs]
    )


def rollout_metrics(
    message_logs, total_reward, truncated, num_turns, done, num_env_errors
) -> dict[str, float]:
    lengths = torch.tensor([float(len(flat_token_ids(log))) for log in message_logs])
    generated = generated_lengths(message_logs)
    return {
        "mean_reward": float(total_reward.mean()),
        "mean_turns": float(num_turns.float().mean()),
        "mean_total_length": float(lengths.mean()),
        "max_total_length": float(lengths.max()),
        "mean_generated_length": float(generated.mean()),
        "termination_rate": float((done & ~truncated).float().mean()),
        "truncation_rate": float(truncated.float().mean()),
        "turn_limit_rate": float((~done).float().mean()),
        "env_errors": float(num_env_errors),
    }


def records_to_rollout_batch(records: list[dict], num_generations: int = 1) -> BatchedDataDict:
    """A rollout batch from prompt records, each repeated `num_generations` times (contiguously).

    A record has `message_log` (the prompt, its last message ending with the generation prompt),
    `extra_env_info`, `task_name` and optionally `idx` and `stop_strings`."""
    repeated = [record for record in records for _ in range(num_generations)]
    return BatchedDataDict(
        message_log=[[dict(m) for m in r["message_log"]] for r in repeated],
        extra_env_info=[dict(r.get("extra_env_info") or {}) for r in repeated],
        task_name=[r["task_name"] for r in repeated],
        idx=[r.get("idx") for r in repeated],
        stop_strings=[r.get("stop_strings") for r in repeated],
    )
