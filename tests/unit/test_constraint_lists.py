"""The built-in constrained_lists task: its verifier on hand-checked replies, its graders (strict and on
topic, which the reward cannot see), its held-out split (topics and counts never trained on); and rl rows
without an answer: loaded, rewarded from their columns, refused at start only by an environment or a
reward function that needs the answer (or another column), naming the row and the key."""

import json

import pytest

from posttrain.data import DataConfig, DataError, load_datasets
from posttrain.data.constraint_lists import HELD_OUT_COUNTS, HELD_OUT_TOPICS, TRAIN_COUNTS
from posttrain.data.tasks import builtin_rows
from posttrain.environments import EnvironmentConfig, register_reward, resolve_environment
from posttrain.environments.constraint_lists import (
    ListConstraints,
    all_constraints_met,
    constraint_share,
    constraints_met,
    on_topic_share,
    parse_prompt,
)
from posttrain.environments.registry import check_record_tasks
from posttrain.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
FOUR_LOWER = ListConstraints(4, "lower", ",", "distinct")


@pytest.mark.parametrize(
    "reply, asked, met",
    [
        ("bamboo, flute, guitar, violin", FOUR_LOWER, [True, True, True, True]),
        ("bamboo, flute, guitar, violin.<|im_end|>", FOUR_LOWER, [True, True, True, True]),  # final period
        ("1. Violin\n2. Violin", FOUR_LOWER, [False, False, False, False]),  # one item, a numbered line
        ("Bamboo, flute, guitar, violin", FOUR_LOWER, [True, False, True, True]),  # one capital
        ("bamboo, flute, flute, violin", FOUR_LOWER, [True, True, True, False]),  # a repeat
        ("bamboo; flute; guitar; violin", FOUR_LOWER, [False, True, False, False]),  # one item, not a word
        ("bamboo, flute, guitar", FOUR_LOWER, [False, True, True, True]),  # three
        ("bamboo, flute, guitar, violin\n", FOUR_LOWER, [True, True, True, True]),  # trailing space only
        ("COD; EEL", ListConstraints(2, "upper", ";", "max_letters", "3"), [True, True, True, True]),
        ("COD; SALMON", ListConstraints(2, "upper", ";", "max_letters", "5"), [True, True, True, False]),
        ("Cod, Pike, Tuna", ListConstraints(3, "capitalized", ",", "include", "pike"), [True] * 4),
        (
            "Cod, pike, Tuna",
            ListConstraints(3, "capitalized", ",", "exclude", "pike"),
            [True, False, True, False],
        ),
    ],
)
def test_the_verifier_checks_each_constraint_as_derived_by_hand(reply, asked, met):
    assert constraints_met(reply, asked) == met
    columns = {"n": asked.n, "case": asked.case, "separator": asked.separator, "rule": asked.rule}
    assert constraint_share(reply, **columns, rule_value=asked.rule_value) == sum(met) / 4


def all_constraints_met_on_topic(sample):
    """1.0 when the reply meets all four constraints and every item belongs to the topic."""
    strict, on_topic = all_constraints_met(sample), on_topic_share(sample)
    return None if strict is None or on_topic is None else float(strict == 1.0 and on_topic == 1.0)


def test_the_strict_grade_is_all_four_and_the_on_topic_grade_sees_what_the_reward_cannot():
    """`banach, batik, ...` keeps the form and drops the meaning: reward 1, strict 1, on topic 0."""
    prompt = (
        "<|user|>List exactly 5 fish, all in lowercase, separated by commas, with no item repeated. Reply"
    )
    form_only = {"prompt": prompt, "response": "banach, batik, ciphers, djinn, greek"}
    fish = {"prompt": prompt, "response": "salmon, tunas, cod, carp, banach"}
    assert (all_constraints_met(form_only), on_topic_share(form_only)) == (1.0, 0.0)
    assert all_constraints_met_on_topic(form_only) == 0.0
    assert on_topic_share(fish) == 4 / 5  # "tunas" is tuna's plural; "banach" is no fish
    assert all_constraints_met({"prompt": "What is 2 plus 3?", "response": "5"}) is None


def test_held_out_rows_change_topics_and_counts_and_the_prompt_says_what_the_columns_say():
    train, val = builtin_rows("constrained_lists", 400, 100, seed=0)
    assert {r["n"] for r in train} == set(TRAIN_COUNTS) and {r["n"] for r in val} == set(HELD_OUT_COUNTS)
    assert not {r["topic"] for r in train} & set(HELD_OUT_TOPICS)
    assert {r["topic"] for r in val} == set(HELD_OUT_TOPICS)
    for row in train + val:
        asked, topic = parse_prompt(row["prompt"])
        assert (asked.n, asked.case, asked.separator, asked.rule, asked.rule_value, topic) == (
            row["n"], row["case"], row["separator"], row["rule"], row["rule_value"], row["topic"],
        )  # fmt: skip
        assert "answer" not in row
    assert builtin_rows("constrained_lists", 400, 100, seed=0) == (train, val)


def records_of(rows, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(dataset=str(path), val_dataset=str(path), format="rl", task_name="lists")
    return load_datasets(cfg, TOKENIZER)[0], cfg


def test_rows_without_an_answer_load_and_a_reward_of_their_columns_scores_them(tmp_path):
    rows = [{"prompt": "List two fish.", "n": 2, "case": "lower", "separator": ",", "rule": "distinct"}] * 2
    records, cfg = records_of([{**r, "rule_value": ""} for r in rows], tmp_path)
    assert records[0]["extra_env_info"]["ground_truth"] is None and records[0]["extra_env_info"]["n"] == 2
    env_cfg = EnvironmentConfig(reward="posttrain.environments.constraint_lists:constraint_share")
    check_record_tasks(records, {"lists": env_cfg}, cfg)  # needs no answer: no error
    cls, kwargs = resolve_environment(env_cfg)
    logs = [[{"role": "assistant", "content": text}] for text in ("cod, eel", "Cod\nCod")]
    assert cls(**kwargs).step(logs, [r["extra_env_info"] for r in records]).rewards.tolist() == [1.0, 0.0]


def test_an_environment_or_reward_that_needs_a_column_names_the_row_and_the_key_at_start(tmp_path):
    records, cfg = records_of([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], tmp_path)
    message = r"rows.jsonl:2: no 'answer' \(data.answer_key\), which env.lists \(math\) needs"
    with pytest.raises(DataError, match=message):
        check_record_tasks(records, {"lists": EnvironmentConfig(cls="math")}, cfg)

    def needs_answer(reply, ground_truth, source="x"):
        return float(reply == ground_truth)

    def needs_n(reply, n, **columns):
        return 1.0

    env = EnvironmentConfig(reward=register_reward(needs_answer))
    with pytest.raises(DataError, match=r"rows.jsonl:2: no 'answer' \(data.answer_key\), which env.lists"):
        check_record_tasks(records, {"lists": env}, cfg)
    with pytest.raises(DataError, match=r"rows.jsonl:1: no 'n', which env.lists \(reward_function\) needs"):
        check_record_tasks(records, {"lists": EnvironmentConfig(reward=register_reward(needs_n))}, cfg)
    check_record_tasks(records, {"lists": EnvironmentConfig(cls="judge")}, cfg)  # the judge reads it if there
