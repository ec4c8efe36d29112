"""The verifier of the built-in `constrained_lists` task (rows: `posttrain.data.constraint_lists`): the
reward (`constraint_share`, a reward function of the row's columns), the strict grade read back from the
prompt (`all_constraints_met`), and a grade the reward never reads (`on_topic_share`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from posttrain.data.constraint_lists import CASES, SEPARATORS, TOPICS
from posttrain.environments.answers import strip_end_markers

_PROMPT = re.compile(
    r"List exactly (\d+) (\w+), (" + "|".join(CASES.values()) + r"), separated by (commas|semicolons), "
    r"(with no item repeated|each at most (\d+) letters long|including (\w+)|without (\w+))\."
)
_ITEM = re.compile(r"[A-Za-z][A-Za-z' -]*")


@dataclass(frozen=True)
class ListConstraints:
    """What a prompt asks: `n` items, `case`, `separator`, and a `rule` with its value (`max_letters`: the
    most letters of an item; `include` / `exclude`: a word; `distinct`: "")."""

    n: int
    case: str
    separator: str
    rule: str
    rule_value: str = ""


def list_items(reply: str, separator: str) -> list[str]:
    """The reply (end-of-turn markers, whitespace and one final period removed) cut at `separator`."""
    text = strip_end_markers(reply).strip()
    text = text[:-1] if text.endswith(".") else text
    return [item.strip() for item in text.split(separator)]


def constraints_met(reply: str, asked: ListConstraints) -> list[bool]:
    """The four checks, in order: exactly `n` items, each words of letters; the case; the separator (used,
    and no other separator or line break); the rule, on items that are words. `bamboo, flute, guitar,
    violin` meets all four of (4, lower, ",", distinct); `1. Violin\\n2. Violin` meets none."""
    text = strip_end_markers(reply).strip()
    items = list_items(reply, asked.separator)
    are_words = all(_ITEM.fullmatch(item) for item in items)
    count = len(items) == asked.n and are_words
    if asked.case == "lower":  # str.islower: some letters, none upper case
        case = all(item.islower() for item in items)
    elif asked.case == "upper":
        case = all(item.isupper() for item in items)
    else:
        case = all(item[:1].isupper() for item in items)
    others = [s for s in (*SEPARATORS, "\n") if s != asked.separator]
    separator = asked.separator in text and not any(s in text for s in others)
    words = [item.lower() for item in items]
    if asked.rule == "distinct":
        rule = len(set(words)) == len(words)
    elif asked.rule == "max_letters":
        rule = all(sum(c.isalpha() for c in item) <= int(asked.rule_value) for item in items)
    elif asked.rule == "include":
        rule = asked.rule_value in words
    else:
        rule = asked.rule_value not in words
    return [count, case, separator, rule and are_words]


def constraint_share(reply: str, n: int, case: str, separator: str, rule: str, rule_value: str) -> float:
    """The task's reward: the share of the four constraints the reply meets (0, 0.25, ..., 1), a reward
    function of the row's columns."""
    met = constraints_met(reply, ListConstraints(int(n), case, separator, rule, str(rule_value or "")))
    return sum(met) / len(met)


def parse_prompt(prompt: str) -> tuple[ListConstraints, str] | None:
    """The constraints and the topic a prompt of this task asks for; None for another prompt."""
    match = _PROMPT.search(prompt)
    if match is None:
        return None
    n, topic, case_text, separator_text, _, max_letters, include, exclude = match.groups()
    case = next(name for name, text in CASES.items() if text == case_text)
    separator = next(s for s, name in SEPARATORS.items() if name == separator_text)
    rule, value = "distinct", ""
    for name, found in (("max_letters", max_letters), ("include", include), ("exclude", exclude)):
        rule, value = (name, found) if found else (rule, value)
    return ListConstraints(int(n), case, separator, rule, value), topic


def _reply(sample: dict[str, Any]) -> str:
    return sample["final_response"] if "final_response" in sample else sample["response"]


def all_constraints_met(sample: dict[str, Any]) -> float | None:
    """Strict grade (`grpo.validation.grader`, `eval.grader`): 1.0 when the reply meets all four constraints
    its prompt asks for; None for a prompt of another task."""
    parsed = parse_prompt(sample["prompt"])
    return None if parsed is None else float(all(constraints_met(_reply(sample), parsed[0])))


def _stem(word: str) -> str:
    return word.lower().strip().removesuffix("es").removesuffix("s")


def on_topic_share(sample: dict[str, Any]) -> float | None:
    """The share of the reply's items that are words of the prompt's topic (`TOPICS`, singular or plural):
    what the reward cannot see. None for a prompt of another task or an unknown topic."""
    parsed = parse_prompt(sample["prompt"])
    if parsed is None or parsed[1] not in TOPICS:
        return None
    words = {_stem(w) for w in TOPICS[parsed[1]].split()}
    items = [item for item in list_items(_reply(sample), parsed[0].separator) if item]
    return sum(_stem(item) in words for item in items) / len(items) if items else 0.0
