"""Data pipeline: templated message logs, flattening, file formats, bad rows, length limits, built-in
tasks and the resumable loader."""

import json

import pandas
import pytest
import torch

from posttrain.data import (
    DataConfig,
    DataError,
    StatefulDataLoader,
    load_datasets,
    message_log_to_flat,
    tokenize_message_log,
)
from posttrain.data.sliding_puzzle import scrambled_board
from posttrain.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
]


def test_message_token_ids_concatenate_to_the_full_template():
    log = tokenize_message_log(CONVERSATION, TOKENIZER)
    full = TOKENIZER.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert torch.cat([m["token_ids"] for m in log]).tolist() == full
    assert [len(m["token_ids"]) for m in log] == [
        3,
        4,
        5,
        3,
    ]  # <|user|>hi, <|assistant|>yo<eos>, <|user|>1+1=, <|assistant|>2<eos>


def test_token_mask_marks_assistant_tokens_or_only_the_last_turn():
    log = tokenize_message_log(CONVERSATION, TOKENIZER)
    flat = message_log_to_flat([log, log[:2]], pad_token_id=0)
    assert flat["input_lengths"].tolist() == [15, 7]
    assert flat["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert flat["token_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1] + [0] * 8  # padding never trained
    last = message_log_to_flat([log], pad_token_id=0, train_on="last_assistant")
    assert last["token_mask"][0].tolist() == [0] * 12 + [1, 1, 1]


def write(path, rows, kind):
    if kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        pandas.DataFrame(rows).to_csv(path, index=False)
    else:
        pandas.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_each_file_format_loads_prompt_response_rows(tmp_path, kind):
    rows = [{"question": f"{i}+{i}=", "reply": str(2 * i)} for i in range(10)]
    path = write(tmp_path / f"train.{kind}", rows, kind)
    cfg = DataConfig(
        dataset=path, prompt_key="question", response_key="reply", format="prompt_response", val_fraction=0.2
    )
    train, val, stats = load_datasets(cfg, TOKENIZER)
    assert (len(train), len(val)) == (8, 2)
    contents = sorted(r["message_log"][1]["content"] for r in train + val)
    assert contents == sorted(str(2 * i) for i in range(10))


def test_messages_and_rl_and_preference_formats(tmp_path):
    messages = write(tmp_path / "m.jsonl", [{"messages": CONVERSATION}] * 4, "jsonl")
    train, _, _ = load_datasets(DataConfig(dataset=messages, val_dataset=messages), TOKENIZER)
    assert [m["role"] for m in train[0]["message_log"]] == ["user", "assistant", "user", "assistant"]
    rl = write(tmp_path / "rl.jsonl", [{"prompt": "2+2=", "answer": 4, "task_name": "arith"}] * 4, "jsonl")
    train, _, _ = load_datasets(
        DataConfig(dataset=rl, val_dataset=rl, format="rl", system_prompt="Add."), TOKENIZER
    )
    assert train[0]["extra_env_info"] == {"ground_truth": "4"} and train[0]["task_name"] == "arith"
    assert (
        TOKENIZER.decode(torch.cat([m["token_ids"] for m in train[0]["message_log"]]))
        == "<|system|>Add.<|user|>2+2=<|assistant|>"
    )
    shot = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    train, _, _ = load_datasets(DataConfig(dataset=rl, val_dataset=rl, format="rl", few_shot=shot), TOKENIZER)
    assert (
        TOKENIZER.decode(torch.cat([m["token_ids"] for m in train[0]["message_log"]]))
        == "<|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>"
    )
    pref = write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4, "jsonl")
    train, _, _ = load_datasets(
        DataConfig(dataset=pref, val_dataset=pref, prompt_template="Q: {prompt}"), TOKENIZER
    )
    assert train[0]["chosen_message_log"][0]["content"] == "Q: 1+1="
    assert train[0]["rejected_message_log"][-1]["content"] == "3"


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON line"):
        load_datasets(DataConfig(dataset=str(path)), TOKENIZER)


def test_missing_field_and_unknown_role_name_the_row(tmp_path):
    missing = write(tmp_path / "missing.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "c"}], "jsonl")
    with pytest.raises(DataError, match=r"missing.jsonl:2: .*missing field 'response'"):
        load_datasets(DataConfig(dataset=missing, format="prompt_response"), TOKENIZER)
    roles = write(tmp_path / "roles.csv", [{"prompt": "a", "response": "b"}], "csv")
    narrator = write(
        tmp_path / "narrator.json",
        [{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}],
        "json",
    )
    with pytest.raises(DataError, match=r"narrator.json row 0: .*unsupported role: narrator"):
        load_datasets(DataConfig(dataset=roles, val_dataset=narrator), TOKENIZER)


def test_skip_invalid_counts_what_it_skipped(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "a", "response": "b"})
    path.write_text("\n".join([good, "{not json", json.dumps({"prompt": "x"}), good, good]) + "\n")
    train, val, stats = load_datasets(
        DataConfig(dataset=str(path), val_dataset=str(path), skip_invalid=True, format="prompt_response"),
        TOKENIZER,
    )
    assert len(train) == 3 and stats["skipped_invalid"] == 4.0  # 2 bad rows, read for train and for val


def test_overlong_samples_are_truncated_or_dropped_and_counted(tmp_path):
    rows = [{"prompt": "a", "response": "b" * 30}, {"prompt": "a", "response": "b"}]
    path = write(tmp_path / "long.jsonl", rows, "jsonl")
    cfg = DataConfig(dataset=path, val_dataset=path, max_length=20)
    train, _, stats = load_datasets(cfg, TOKENIZER)
    assert [r["length"] for r in train] == [20, 5] and stats["truncated"] == 2.0
    cfg.overlong = "drop"
    train, _, stats = load_datasets(cfg, TOKENIZER)
    assert len(train) == 1 and stats["dropped_overlong"] == 2.0


def test_builtin_arithmetic_is_seeded_and_train_val_disjoint():
    cfg = DataConfig(dataset="arithmetic", format="rl", num_train=500, num_val=100, seed=3)
    train, val, _ = load_datasets(cfg, TOKENIZER)
    prompts = lambda records: {r["message_log"][0]["content"] for r in records}  # noqa: E731
    assert len(prompts(val)) == 100 and not prompts(train) & prompts(val)
    again, _, _ = load_datasets(cfg, TOKENIZER)
    assert [r["message_log"][0]["content"] for r in again] == [r["message_log"][0]["content"] for r in train]
    record = train[0]
    a, b = record["message_log"][0]["content"].rstrip("=").split("+")
    assert record["extra_env_info"]["ground_truth"] == f"{int(a) + int(b):03d}"


def test_loader_resumes_with_exactly_the_same_batches():
    records = list(range(10))
    loader = StatefulDataLoader(records, batch_size=3, seed=7)
    uninterrupted = [loader.next_batch() for _ in range(8)]  # crosses two epoch boundaries
    first = StatefulDataLoader(records, batch_size=3, seed=7)
    head = [first.next_batch() for _ in range(4)]
    resumed = StatefulDataLoader(records, batch_size=3, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + [resumed.next_batch() for _ in range(4)] == uninterrupted
    assert uninterrupted[:3] != [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # shuffled
    assert len(loader) == 3 and all(len(b) == 3 for b in uninterrupted)


def test_scrambled_boards_are_reproducible_and_not_solved():
    assert scrambled_board(3, 5, seed=1) == scrambled_board(3, 5, seed=1)
    assert sorted(sum(scrambled_board(3, 5, seed=2), [])) == list(range(9))


def test_builtin_multiplication_asks_for_products_of_n_digit_numbers_with_disjoint_splits():
    from posttrain.data.tasks import builtin_rows

    train, val = builtin_rows("multiplication", 500, 50, seed=1, num_digits=3)
    assert builtin_rows("multiplication", 500, 50, seed=1, num_digits=3) == (train, val)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val} and len(train) == 500
    for row in train + val:
        words = row["prompt"].split()  # What is A times B? Reply with the number only.
        a, b = int(words[2]), int(words[4].rstrip("?"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and words[3] == "times"
        assert row["answer"] == row["response"] == str(a * b) and row["task_name"] == "math"


def test_builtin_math_words_asks_in_words_with_right_answers_and_disjoint_splits():
    from posttrain.data.tasks import builtin_rows

    train, val = builtin_rows("math_words", 3000, 200, seed=5)
    assert builtin_rows("math_words", 3000, 200, seed=5) == (train, val)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 3000
    for row in train + val:
        words = row["prompt"].split()  # What is A plus|minus B? Reply with the number only.
        a, op, b = int(words[2]), words[3], int(words[4].rstrip("?"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["prompt"].endswith("? Reply with the number only.")
        assert row["answer"] == row["response"] == str(a + b if op == "plus" else a - b)
        assert int(row["answer"]) >= 0 and row["task_name"] == "math"
    assert 0.3 < sum("minus" in r["prompt"] for r in val) / len(val) < 0.7


def test_builtin_math_steps_asks_for_worked_solutions_of_three_lengths():
    from posttrain.data.math_steps import worked_solution
    from posttrain.data.tasks import builtin_rows
    from posttrain.environments.answers import final_answer

    assert worked_solution(47, 13, 512, 0) == "47 * 13 = 611\n611 + 512 = 1123\n\\boxed{1123}"
    assert worked_solution(47, 13, 512, 1) == (
        "Step 1: 47 * 13 = 10 * 47 + 3 * 47 = 470 + 141 = 611\nStep 2: 611 + 512 = 1123\n"
        "The final answer is \\boxed{1123}."
    )
    assert worked_solution(82, 3, 195, 2).splitlines()[1:4] == ["80 * 3 = 240", "2 * 3 = 6", "240 + 6 = 246"]
    assert worked_solution(82, 3, 195, 2).splitlines()[6:8] == ["246 + 100 = 346", "346 + 95 = 441"]

    train, val = builtin_rows("math_steps", 3000, 200, seed=5)
    assert builtin_rows("math_steps", 3000, 200, seed=5) == (train, val)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 3000
    styles = {0: 0, 1: 0, 2: 0}
    for row in train + val:
        expression = row["prompt"].removeprefix("What is ").split("?")[0]  # a * b + c
        a, b, c = (int(x) for x in expression.replace("*", "+").split("+"))
        assert 12 <= a <= 99 and 3 <= b <= 19 and 100 <= c <= 999 and row["task_name"] == "math"
        assert row["answer"] == str(a * b + c) == final_answer(row["response"])
        styles[[worked_solution(a, b, c, s) for s in range(3)].index(row["response"])] += 1
    assert all(count > 800 for count in styles.values()), styles
