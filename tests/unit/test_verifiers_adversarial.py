"""Every built-in verifier against hand-written replies, each with the reward it must get.

Rows marked `# was 1` (or `# was 0`) got the other reward from the verifier that math-verified the whole
reply (it found `59 + 63` anywhere in a reply and called it equal to 122) or, for exact match, removed
end-of-turn markers anywhere in the reply. Two of them (`last ... states none`) are strict by design: the
answer must be what the reply says last, and a reply that trails off after it commits to nothing.
"""

import time

import pytest

from posttrain.data.tasks import builtin_rows, word_problem_row
from posttrain.environments.single_turn import ExactMatchEnvironment, MathEnvironment
from posttrain.environments.tool_env import CodeToolEnvironment

LONG_FILLER = "Let me think about this step by step. " * 2700  # ~100 kB

MATH_ROWS = [  # (reply, ground truth, reward)
    ("122", "122", 1.0),
    ("122<|im_end|>", "122", 1.0),
    ("  122 \n", "122", 1.0),
    ("59 + 63 = 122", "122", 1.0),
    ("The answer is 122.", "122", 1.0),
    ("Answer: **122**", "122", 1.0),
    ("The sum of 59 and 63 is 122!", "122", 1.0),
    ("\\boxed{122}", "122", 1.0),
    ("59 + 63 = 122, so the result is $\\boxed{122}$.", "122", 1.0),
    ("59 + 63 = ?", "122", 0.0),  # was 1
    ("59 + 63", "122", 0.0),  # was 1
    ("What is 59 plus 63?", "122", 0.0),
    ("59 + 63 is a mathematical expression that represents the sum of two numbers.", "122", 0.0),  # was 1
    ("59 + 63 = 122 = ?", "122", 0.0),  # was 1
    ("59 + 63 = 122, and minus 1 that is 121", "122", 0.0),
    ("122 or 123", "122", 0.0),
    ("It is either 121 or 122", "122", 0.0),  # was 1
    ("59 + 63 is not 122.", "122", 0.0),  # was 1
    ("122?", "122", 0.0),  # was 1
    ("", "122", 0.0),
    ("  \n\t ", "122", 0.0),
    ("\\boxed{59+63}", "122", 0.0),  # was 1
    ("\\boxed{122} or \\boxed{123}", "122", 0.0),
    ("\\boxed{121}\nNo wait, 122", "122", 0.0),
    ("The answer is 122. Let me know if you need anything else.", "122", 0.0),  # was 1; last words state none
    ("-15", "-15", 1.0),
    ("\u221215", "-15", 1.0),  # was 0
    ("The result is -15.", "-15", 1.0),
    ("15", "-15", 0.0),
    ("1,234", "1234", 1.0),
    ("1234.0", "1234", 1.0),
    ("1 234", "1234", 0.0),  # was 1
    ("12,34", "1234", 0.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("1/2", "0.5", 1.0),
    ("$\\frac12$", "0.5", 1.0),
    ("0.75", "\\frac{3}{4}", 1.0),
    ("x = 3/4", "\\frac{3}{4}", 1.0),
    ("0.7", "\\frac{3}{4}", 0.0),
    ("\\boxed{x^2 + 1}", "x^2+1", 1.0),
    ("The answer is $1 + x^2$", "x^2+1", 1.0),
    ("\\boxed{x^2}", "x^2+1", 0.0),
    (LONG_FILLER + "\n59 + 63 = 122", "122", 1.0),
    (LONG_FILLER + "59 + 63 = ?", "122", 0.0),  # was 1
]


def row_ids(name: str, rows: list) -> list[str]:
    return [f"{name}{i}" for i in range(len(rows))]


def conversation(reply: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("reply,ground_truth,reward", MATH_ROWS, ids=row_ids("math", MATH_ROWS))
def test_math_environment_pays_only_for_the_committed_answer(reply, ground_truth, reward):
    start = time.perf_counter()
    result = MathEnvironment().step([conversation(reply)], [{"ground_truth": ground_truth}])
    assert result.rewards.tolist() == [reward], (reply[-80:], result.answers)
    assert result.num_errors == 0
    assert time.perf_counter() - start < 2.0  # a 100 kB reply is graded well within the time limit


EXACT_ROWS = [  # (reply, ground truth, reward)
    ("092", "092", 1.0),
    ("092<eos>", "092", 1.0),
    (" 092\n", "092", 1.0),
    ("092</s>", "092", 1.0),
    ("092<eos><eos>", "092", 1.0),
    ("92", "092", 0.0),
    ("0092", "092", 0.0),
    ("092.", "092", 0.0),
    ("0 92", "092", 0.0),
    ("The answer is 092", "092", 0.0),
    ("07+85=092", "092", 0.0),
    ("07+85=", "092", 0.0),
    ("07+85=?", "092", 0.0),
    ("092 092", "092", 0.0),
    ("092\n092", "092", 0.0),
    ("O92", "092", 0.0),
    ("09<eos>2", "092", 0.0),  # was 1
    ("<eos>092", "092", 0.0),  # was 1
    ("0<|im_end|>92", "092", 0.0),  # was 1
    ("", "092", 0.0),
    ("   ", "092", 0.0),
    ("093", "092", 0.0),
    ("-092", "092", 0.0),
    ("+092", "092", 0.0),
    ("092?", "092", 0.0),
    ("\\boxed{092}", "092", 0.0),
    ("092 or 093", "092", 0.0),
    ("100", "100", 1.0),
    ("1,00", "100", 0.0),
    ("100.0", "100", 0.0),
    ("000", "000", 1.0),
    ("00", "000", 0.0),
    ("9" * 100_000, "092", 0.0),
]


@pytest.mark.parametrize("reply,ground_truth,reward", EXACT_ROWS, ids=row_ids("exact", EXACT_ROWS))
def test_exact_match_pays_only_for_the_exact_answer(reply, ground_truth, reward):
    result = ExactMatchEnvironment().step([conversation(reply)], [{"ground_truth": ground_truth}])
    assert result.rewards.tolist() == [reward]


def word_problem(a: int, op: str, b: int) -> dict:
    row = word_problem_row(a, op, b)
    return {"question": row["prompt"], "ground_truth": row["answer"]}


MATH_WORDS_ROWS = [  # (operands, reply, reward): replies of the kinds SmolLM2-135M-Instruct gives
    ((59, "+", 63), "122", 1.0),
    ((59, "+", 63), "59 + 63 = 122<|im_end|>", 1.0),
    ((59, "+", 63), "59 plus 63 equals 122.", 1.0),
    ((59, "+", 63), "The sum of 59 and 63 is 122.", 1.0),
    ((59, "+", 63), "59 + 63 = 152", 0.0),
    ((59, "+", 63), "59 + 63 = ?<|im_end|>", 0.0),  # was 1
    ((59, "+", 63), "What is 59 plus 63? Reply with the number only.", 0.0),
    ((59, "+", 63), "59 + 63 is a mathematical expression that represents the sum of 59 and 63.", 0.0),
    ((59, "+", 63), "To solve this problem, we need to find the sum of 59 and", 0.0),
    ((59, "+", 63), "59 + 63", 0.0),  # was 1
    ((59, "+", 63), "63 + 59 = 122", 1.0),
    ((59, "+", 63), "122.0", 1.0),
    ((59, "+", 63), "one hundred twenty-two", 0.0),
    ((59, "+", 63), "59 + 63 = 122\n\nThis is a classic", 0.0),  # was 1; last line states none
    ((93, "+", 16), "93 + 16 is not a number.", 0.0),  # was 1
    ((93, "+", 16), "109", 1.0),
    ((93, "+", 16), "93 + 16 = 109 or 110", 0.0),
    ((93, "+", 16), "93 + 16 = 109.<|im_end|>", 1.0),
    ((75, "-", 43), "32", 1.0),
    ((75, "-", 43), "75 - 43 = 32", 1.0),
    ((75, "-", 43), "75 minus 43 equals 32", 1.0),
    ((75, "-", 43), "The difference is 32", 1.0),
    ((75, "-", 43), "75 - 43 = ?", 0.0),  # was 1
    ((75, "-", 43), "75 - 43", 0.0),  # was 1
    ((75, "-", 43), "-32", 0.0),
    ((75, "-", 43), "43 - 75 = -32", 0.0),
    ((75, "-", 43), "75 - 43 = 32 - 0 = ?", 0.0),  # was 1
    ((75, "-", 43), "75 - 43 = 21", 0.0),
    ((75, "-", 43), "\\boxed{32}", 1.0),
    ((75, "-", 43), "\\boxed{75-43}", 0.0),  # was 1
    ((75, "-", 43), "32, 33", 0.0),
    ((75, "-", 43), "What is 75 minus 43?", 0.0),
]


@pytest.mark.parametrize("operands,reply,reward", MATH_WORDS_ROWS, ids=row_ids("words", MATH_WORDS_ROWS))
def test_math_words_task_pays_only_for_the_right_final_number(operands, reply, reward):
    problem = word_problem(*operands)
    result = MathEnvironment().step([conversation(reply)], [{"ground_truth": problem["ground_truth"]}])
    assert result.rewards.tolist() == [reward], (problem, reply)


def test_restating_any_built_in_question_scores_zero():
    """A policy that always restates the question, in any of three forms, earns nothing on any row."""
    train, val = builtin_rows("math_words", 4000, 200, seed=0)
    env = MathEnvironment()
    for row in train + val:
        a, op, b = row["prompt"].split("?")[0].removeprefix("What is ").split(" ")
        symbol = "+" if op == "plus" else "-"
        replies = [f"{a} {symbol} {b} = ?", row["prompt"], f"{a} {symbol} {b}", f"{a} {op} {b}"]
        metadata = [{"ground_truth": row["answer"]}] * len(replies)
        result = env.step([conversation(r) for r in replies], metadata)
        assert result.rewards.sum() == 0, (row, replies)


CODE_FINAL_ROWS = [  # (final turn without code, ground truth, reward); the math rows follow
    ("122", "122", 1.0),
    ("The program printed 122, so the answer is 122.", "122", 1.0),
    ("\\boxed{122}", "122", 1.0),
    ("59 + 63 = 122", "122", 1.0),
    ("59 + 63 = ?", "122", 0.0),  # was 1
    ("59 + 63", "122", 0.0),  # was 1
    ("print(59 + 63)", "122", 0.0),
    ("The output is 59 + 63", "122", 0.0),  # was 1
    ("122 or 123", "122", 0.0),
    ("", "122", 0.0),
]


@pytest.fixture(scope="module")
def code_env():
    return CodeToolEnvironment()


CODE_ROWS = CODE_FINAL_ROWS + MATH_ROWS


@pytest.mark.parametrize("reply,ground_truth,reward", CODE_ROWS, ids=row_ids("code", CODE_ROWS))
def test_code_tool_final_answer_pays_only_for_the_committed_answer(code_env, reply, ground_truth, reward):
    log = [
        {"role": "user", "content": "What is 59 + 63?"},
        {"role": "assistant", "content": "<code>print(59 + 63)</code>"},
        {"role": "tool", "content": "122\n"},
        {"role": "assistant", "content": reply},
    ]
    result = code_env.step([log], [{"ground_truth": ground_truth, "num_tool_calls": 1}])
    assert result.terminateds.tolist() == [True]
    assert result.rewards.tolist() == [reward]


def test_code_tool_runs_code_instead_of_grading_it(code_env):
    """A turn with code is a tool call (reward 0, episode goes on), even when its output is the answer."""
    result = code_env.step([conversation("<code>print(59 + 63)</code>")], [{"ground_truth": "122"}])
    assert result.terminateds.tolist() == [False] and result.rewards.tolist() == [0.0]
    assert result.observations[0]["content"].strip() == "122"
