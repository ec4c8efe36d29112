"""A multi-turn tool episode through the rollout loop (scripted generations, the `tools` environment in
process): the conversation's tokens and its loss mask, checked token by token; tool results are masked."""

import torch

from posttrain.data.config import DataConfig
from posttrain.data.message_log import message_log_to_flat
from posttrain.data.records import row_to_record
from posttrain.environments.tool_env import ToolEnvironment
from posttrain.experience.rollouts import (
    records_to_rollout_batch,
    run_multi_turn_rollout,
    tokenize_observation,
)
from posttrain.models.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

# The character tokenizer's template, plus a one-letter system turn when tools are declared (so the
# expected tokens below stay short enough to read).
TOOLS_TEMPLATE = "{% if tools %}<|system|>T{% endif %}" + build_char_tokenizer().chat_template
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class ScriptedGeneration:
    """Turn t of active sample i writes script[t][i]; a turn ends with <eos> unless a stop string ended it."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.turn, self.stop_strings = tokenizer, script, 0, []

    def generate(self, data, greedy=False, seed=None):
        texts, self.turn = self.script[self.turn], self.turn + 1
        self.stop_strings.append(data["stop_strings"])
        answers = []
        for text, stops in zip(texts, data["stop_strings"]):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ended_by_stop = any(text.endswith(s) for s in stops or [])
            answers.append(ids if ended_by_stop else ids + [self.tokenizer.eos_token_id])
        lengths = data["input_lengths"]
        width = int(lengths.max()) + max(len(a) for a in answers)
        output = torch.zeros(len(answers), width, dtype=torch.long)
        for i, ids in enumerate(answers):
            output[i, : lengths[i]] = data["input_ids"][i, : lengths[i]]
            output[i, lengths[i] : lengths[i] + len(ids)] = torch.tensor(ids)
        return {
            "output_ids": output,
            "logprobs": torch.full((len(answers), width), -0.5),
            "generation_lengths": torch.tensor([len(a) for a in answers]),
        }


def tool_episode():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    env = ToolEnvironment(tools=["calculator"])
    record = row_to_record(
        {"prompt": "6*7?", "answer": "42"},
        DataConfig(format="rl", task_name="calc"),
        tokenizer,
        0,
        tool_prompts={"calc": env.tool_prompt({"tools": ["calculator"]})},
    )
    generation = ScriptedGeneration(tokenizer, [[CALL], ["42"]])
    rollouts, metrics = run_multi_turn_rollout(
        generation, records_to_rollout_batch([record]), tokenizer, {"calc": env}, 512, 4
    )
    return tokenizer, generation, rollouts, metrics


def test_a_tool_episode_trains_on_the_model_turns_only_token_by_token():
    tokenizer, generation, rollouts, metrics = tool_episode()
    log = rollouts["message_log"][0]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    assert rollouts["total_reward"].tolist() == [1.0] and rollouts["num_turns"].tolist() == [2]
    assert generation.stop_strings == [[["</tool_call>"]]] * 2  # both turns (one sample) stop after a call
    assert metrics["env/tool_calls"] == 1.0 and metrics["env/tool_errors"] == 0.0
    # The conversation, segment by segment: (text, trained). Special tokens are one token each, every
    # other character one token. The first turn ended at </tool_call> without <eos>, so the tool message
    # starts by closing the assistant turn the way the template does (<eos>), untrained; the final turn
    # wrote its own <eos>, trained.
    segments = [
        ("<|system|>", 0),
        ("T", 0),
        ("<|user|>", 0),
        ("6*7?", 0),
        ("<|assistant|>", 0),
        (CALL, 1),
        ("<eos>", 0),
        ("<|tool|>", 0),
        ("42", 0),
        ("<|assistant|>", 0),
        ("42", 1),
        ("<eos>", 1),
    ]
    expected_ids, expected_mask = [], []
    for text, trained in segments:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == (1 if text in SPECIAL_TOKENS else len(text))
        expected_ids += ids
        expected_mask += [float(trained)] * len(ids)
    flat = message_log_to_flat(rollouts["message_log"], tokenizer.pad_token_id)
    assert flat["input_ids"][0].tolist() == expected_ids
    assert flat["token_mask"][0].tolist() == expected_mask
    # What was trained on decodes to exactly the two generations.
    trained_ids = flat["input_ids"][0][flat["token_mask"][0].bool()]
    assert tokenizer.decode(trained_ids, skip_special_tokens=False) == CALL + "42<eos>"


CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_an_observation_closes_the_turn_once_whether_or_not_the_generation_wrote_its_end():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHATML
    prompt = [{"role": "user", "content": "hi"}]
    tool = {"role": "tool", "content": "42"}
    rest = "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    for generated, expected in [(CALL, "<|im_end|>\n" + rest), ("move<|im_end|>", "\n" + rest)]:
        ids = tokenize_observation(tokenizer, prompt + [{"role": "assistant", "content": generated}], tool)
        assert tokenizer.decode(ids) == expected, generated
