"""Agents written as users write them, with the `openai` client, for the agent-environment tests."""

import asyncio

import torch

from posttrain.experience.rollouts import records_to_rollout_batch

SEEN: dict[str, list[dict]] = {}  # per row: what the endpoint answered each call (ids, prompt ids, text)


async def two_turns(client, row):
    """Ask, then send the conversation back with one user turn and ask again; reward 1 for a digit."""
    messages = [{"role": "user", "content": row["prompt"]}]
    calls = SEEN.setdefault(row["prompt"], [])
    for _turn in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        text = reply.choices[0].message.content
        calls.append(
            {
                "token_ids": reply.choices[0].model_extra["token_ids"],
                "prompt_token_ids": reply.model_extra["prompt_token_ids"],
                "text": text,
            }
        )
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Sure? Say it again."},
        ]
    return float(any(c.isdigit() for c in text))


async def misbehaving(client, row):
    """Raises, hangs, returns NaN or edits its first reply, by the row's number; else one plain call."""
    kind = row["ground_truth"]
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    if kind == "raise":
        raise RuntimeError("the agent's tool crashed")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "nan":
        return float("nan")
    if kind == "edit":
        edited = [*messages, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    return 1.0 if reply.choices[0].message.content else 0.5


async def one_tool_call(client, row):
    """Offer a tool, send the reply back as returned (its tool call parsed out) with the tool's result, and
    ask again: one episode of two calls."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(
        model="policy", messages=messages, tools=tools, max_tokens=40
    )
    message = reply.choices[0].message
    assert message.tool_calls, message
    messages += [message.model_dump(exclude_none=True), {"role": "tool", "content": "7"}]
    await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=40)
    return 1.0


def agent_batch(answers: list[str], num_generations: int = 1):
    """A rollout batch of task `t`: row i asks `i+1=`, its ground truth `answers[i]`, num_generations each."""
    records = [
        {
            "message_log": [{"role": "user", "content": f"{i}+1=", "token_ids": torch.tensor([1])}],
            "extra_env_info": {"ground_truth": answer},
            "task_name": "t",
            "idx": i,
        }
        for i, answer in enumerate(answers)
    ]
    return records_to_rollout_batch(records, num_generations)
