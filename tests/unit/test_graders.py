"""Strict validation graders: the final-number grade, user graders by import spec, the reward gap."""

import pytest

from posttrain.evals.graders import (
    final_number,
    resolve_grader,
    reward_hacking_warning,
    strict_grades,
)


def sample(response: str, ground_truth, reward: float = 0.0, idx: int = 0) -> dict:
    return {
        "idx": idx,
        "prompt": "What is 59 plus 63?",
        "response": response,
        "reward": reward,
        "ground_truth": ground_truth,
    }


@pytest.mark.parametrize(
    "response,ground_truth,grade",
    [
        ("122", "122", 1.0),
        ("59 + 63 = 122<|im_end|>", "122", 1.0),
        ("The sum is 1,122.", "1122", 1.0),
        ("-15", "-15", 1.0),
        ("59 + 63 = ?", "122", 0.0),  # the last number is 63
        ("What is 59 plus 63?", "122", 0.0),
        ("122 or 123", "122", 0.0),
        ("no number here", "122", 0.0),
        ("", "122", 0.0),
        ("anything", "x^2+1", None),  # not a numeric ground truth: not graded
        ("anything", None, None),
    ],
)
def test_final_number_grades_the_last_number_of_the_reply(response, ground_truth, grade):
    assert final_number(sample(response, ground_truth)) == grade


def test_final_number_grades_the_last_turn_of_a_tool_episode():
    """The whole response runs the tool's result into the answer (`...</tool_call>122122`); the grade is
    the final assistant turn's."""
    episode = sample('<tool_call>{"name": "calculator"}</tool_call>122122<|im_end|>', "122")
    assert final_number(episode) == 0.0
    assert final_number({**episode, "final_response": "122<|im_end|>"}) == 1.0
    assert final_number({**episode, "final_response": "121"}) == 0.0


def test_strict_grades_summarise_only_the_graded_samples():
    """Rewards 1, 1, 0 and grades 1, 0, 0 over the three numeric samples: strict accuracy 1/3, mean
    reward 2/3, gap 1/3; the non-numeric sample is left out."""
    samples = [
        sample("122", "122", 1.0),
        sample("59 + 63 = ?", "122", 1.0),
        sample("7", "8", 0.0),
        sample("x", "x^2", 1.0),
    ]
    metrics = strict_grades(samples, final_number)
    assert metrics == pytest.approx({"strict_accuracy": 1 / 3, "reward_gap": 1 / 3, "num_strict_graded": 3.0})
    assert [s["strict_grade"] for s in samples] == [1.0, 0.0, 0.0, None]


def test_the_warning_names_the_sample_where_reward_and_grade_differ_most():
    samples = [
        sample("122", "122", 1.0, idx=0),
        sample("59 + 63 = ?", "122", 1.0, idx=7),
        sample("7", "8", 0.0, idx=2),
    ]
    metrics = strict_grades(samples, final_number)
    warning = reward_hacking_warning(metrics, samples, max_gap=0.1)
    assert "Sample idx 7" in warning and "'59 + 63 = ?'" in warning and "by 0.333" in warning
    assert reward_hacking_warning(metrics, samples, max_gap=0.5) is None  # 1/3 is within 0.5
    assert reward_hacking_warning({"num_strict_graded": 0.0}, [], max_gap=0.0) is None


def test_a_user_grader_is_loaded_from_a_file(tmp_path):
    path = tmp_path / "my_graders.py"
    path.write_text("def judge(sample):\n    return float('122' in sample['response'])\n")
    grader = resolve_grader(f"{path}:judge")
    assert grader(sample("it is 122", "122")) == 1.0 and grader(sample("121", "122")) == 0.0
    assert resolve_grader(None) is None and resolve_grader("final_number") is final_number
    broken = strict_grades([sample("1", "1"), sample("2", "2")], lambda s: 1 / 0)
    assert broken == {"num_strict_graded": 0.0, "num_strict_errors": 2.0}
    with pytest.raises(KeyError, match="unknown grader 'exact'.*final_number"):
        resolve_grader("exact")
