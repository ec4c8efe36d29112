"""Environments without Ray: final-answer grading, exact match, the sliding puzzle, the code sandbox."""

import pytest

from posttrain.data.sliding_puzzle import apply_move, solved_board
from posttrain.environments.registry import register_environment, resolve_environment_class
from posttrain.environments.single_turn import ExactMatchEnvironment, MathEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment
from posttrain.environments.tool_env import CodeToolEnvironment


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]


def test_math_environment_accepts_boxed_plain_and_fraction_answers():
    env = MathEnvironment()
    logs = [conversation(r) for r in ["so \\boxed{\\frac{1}{2}}", "42<eos>", "3/4", "7"]]
    meta = [{"ground_truth": g} for g in ["0.5", "42", "\\frac{3}{4}", "8"]]
    result = env.step(logs, meta)
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert result.terminateds.all() and result.num_errors == 0


def test_math_environment_scores_a_verifier_error_zero_and_counts_it():
    env = MathEnvironment()
    result = env.step([conversation("1"), conversation("2")], [{"ground_truth": "1"}, {}])  # 2nd: no key
    assert result.rewards.tolist() == [1.0, 0.0]
    assert result.num_errors == 1


def test_exact_match_strips_eos_and_compares_strings():
    env = ExactMatchEnvironment()
    result = env.step([conversation("092<eos>"), conversation("92")], [{"ground_truth": "092"}] * 2)
    assert result.rewards.tolist() == [1.0, 0.0]
    assert result.answers == ["092", "92"]


def test_sliding_puzzle_moves_reward_on_solve_and_error_on_invalid_move():
    env = SlidingPuzzleEnvironment(max_moves=3)
    one_away = apply_move(solved_board(2), "up")  # blank moved up from the corner
    assert one_away == [[1, 0], [3, 2]]
    logs = [conversation("<action>down</action>"), conversation("<action>up</action>"), conversation("jump")]
    meta = [{"board": one_away}] * 3
    result = env.step(logs, meta)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0]
    assert result.terminateds.tolist() == [True, False, False]
    assert "Invalid move 'up'" in result.observations[1]["content"]
    assert "Invalid move None" in result.observations[2]["content"]
    assert result.next_stop_strings[1] == ["</action>"] and result.next_stop_strings[0] is None
    # the move limit ends the episode without reward
    late = env.step([conversation("<action>left</action>")], [{"board": one_away, "num_moves": 2}])
    assert late.terminateds.tolist() == [True] and late.rewards.tolist() == [0.0]


def test_code_tool_environment_runs_code_then_scores_the_final_answer():
    env = CodeToolEnvironment()
    first = env.step([conversation("<code>print(12 * 12)</code>")], [{"ground_truth": "144"}])
    assert first.observations[0] == {"role": "tool", "content": "144\n"}
    assert first.terminateds.tolist() == [False]
    final = env.step([conversation("The answer is 144")], first.metadata)
    assert final.rewards.tolist() == [1.0] and final.terminateds.tolist() == [True]


def test_registry_resolves_names_files_and_rejects_unknown(tmp_path):
    assert resolve_environment_class("math") is MathEnvironment
    path = tmp_path / "my_env.py"
    path.write_text(
        "from posttrain.environments.single_turn import ExactMatchEnvironment\n"
        "class MyEnv(ExactMatchEnvironment):\n    pass\n"
    )
    assert resolve_environment_class(f"{path}:MyEnv").__name__ == "MyEnv"
    register_environment("my_env", resolve_environment_class(f"{path}:MyEnv"))
    assert resolve_environment_class("my_env").__name__ == "MyEnv"
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        resolve_environment_class("nope")


def test_merged_returns_sum_the_counts_of_every_actor():
    import torch

    from posttrain.environments.interface import EnvironmentReturn
    from posttrain.environments.pool import merge_returns

    def part(counts):
        return EnvironmentReturn(
            [{}], [{}], [None], torch.zeros(1), torch.ones(1, dtype=torch.bool), [None], 0, counts
        )

    merged = merge_returns(
        [part({"tool_calls": 2.0}), part({"tool_calls": 1.0, "tool_errors": 1.0}), part({})]
    )
    assert merged.counts == {"tool_calls": 3.0, "tool_errors": 1.0}
