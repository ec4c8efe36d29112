"""The answer a reply commits to, and strict grading of that answer against a ground truth.

`final_answer(reply)` finds the one answer a reply commits to, or None:
1. End-of-turn markers at the end and surrounding whitespace are removed; an empty reply has no answer.
2. If the reply has `\\boxed{...}`, the answer is what the boxes hold. Boxes holding different things are
   several candidates: no answer.
3. Otherwise the answer is stated last: on the last non-empty line, the text after the last answer
   marker (`=`, `:`, or the words `is`, `equals`), or the whole line when it has none. Emphasis (`**`,
   backticks), math delimiters (`$...$`, `\\(...\\)`) and a trailing `.`, `!` or `,` are dropped.

`grade_answer(answer, ground_truth)` compares only that answer:
- A numeric ground truth (`122`, `-5`, `0.5`, `1/2`, `\\frac{1}{2}`) needs a number written out: an
  integer or decimal (optional sign, thousands separators as in `1,234`), `a/b` or `\\frac{a}{b}`;
  numbers are equal as exact fractions, so `0.5`, `1/2` and `\\frac{1}{2}` match each other. An
  expression that evaluates to the number (`59 + 63`), a question (`= ?`, `122?`), words around the
  number (`not 122`, `12 or 13`) score 0.
- Any other ground truth (an expression, an interval) is compared by math-verify with the answer alone.
With ground truth 122, `59 + 63 = 122` and `\\boxed{122}` score 1; `59 + 63 = ?` and `122 or 123` score 0."""

from __future__ import annotations

import re
from fractions import Fraction

END_MARKERS = ("<eos>", "</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
MAX_ANSWER_CHARS = 1000  # a longer "answer" is not one (and keeps math-verify's parsing bounded)

_MARKER = re.compile(r"=|:|\bis\b|\bequals\b", re.IGNORECASE)
_DECIMAL = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"
_NUMBER = re.compile(rf"(?:{_DECIMAL})(?:/(?:{_DECIMAL}))?")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac(?:\{\s*([^{}]+?)\s*\}|(\d))(?:\{\s*([^{}]+?)\s*\}|(\d))")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"), ("`", "`"))


def strip_end_markers(text: str) -> str:
    """The text without end-of-turn markers at its end, stripped of surrounding whitespace."""
    text = text.strip()
    while text.endswith(END_MARKERS):
        text = text[: -len(next(m for m in END_MARKERS if text.endswith(m)))].rstrip()
    return text


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (nested braces kept), in order; an unclosed box is dropped."""
    contents, start = [], text.find("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            contents.append(text[start + len("\\boxed{") : i - 1].strip())
        start = text.find("\\boxed{", i)
    return contents


def _clean(candidate: str) -> str:
    candidate = candidate.strip().rstrip(".!,;").strip()
    changed = True
    while changed:
        changed = False
        for left, right in _DELIMITERS:
            wrapped = candidate.startswith(left) and candidate.endswith(right)
            if wrapped and len(candidate) > len(left) + len(right):
                candidate = candidate[len(left) : -len(right)].strip().rstrip(".!,;").strip()
                changed = True
    return candidate


def final_answer(reply: str) -> str | None:
    """The one answer the reply commits to (module docstring), or None when it commits to none."""
    text = strip_end_markers(reply)
    if not text:
        return None
    if "\\boxed{" in text:
        boxes = {_clean(box) for box in boxed_contents(text)}
        return boxes.pop() if len(boxes) == 1 and "" not in boxes else None
    last_line = next(line for line in reversed(text.splitlines()) if line.strip())
    markers = list(_MARKER.finditer(last_line))
    answer = _clean(last_line[markers[-1].end() :] if markers else last_line)
    return answer if answer and len(answer) <= MAX_ANSWER_CHARS else None


def parse_number(text: str) -> Fraction | None:
    """An exact number from a number written out (`-1,234.5`, `3/4`, `\\frac{3}{4}`), else None."""
    text = text.strip().replace("\u2212", "-")
    latex = _LATEX_FRACTION.fullmatch(text)
    if latex:
        numerator, denominator = parse_number(latex[2] or latex[3]), parse_number(latex[4] or latex[5])
        if numerator is None or denominator is None or denominator == 0:
            return None
        return (-1 if latex[1] == "-" else 1) * numerator / denominator
    if not _NUMBER.fullmatch(text):
        return None
    parts = text.replace(",", "").split("/")
    if len(parts) == 2 and Fraction(parts[1]) == 0:
        return None
    return Fraction(parts[0]) / (Fraction(parts[1]) if len(parts) == 2 else 1)


def grade_answer(answer: str | None, ground_truth: str, timeout_seconds: int | None = 5) -> float:
    """1.0 when the committed answer equals the ground truth (module docstring), else 0.0.

    math-verify (non-numeric ground truths only) raises on failures, which callers count; its timeouts use
    signals and work on a main thread only: pass `timeout_seconds=None` from threaded or async actors."""
    if answer is None:
        return 0.0
    gold_number = parse_number(_clean(ground_truth))
    if gold_number is not None:
        return float(parse_number(answer) == gold_number)
    from math_verify import parse, verify

    parse_kwargs = {} if timeout_seconds else {"parsing_timeout": None}
    wrap = lambda text: text if "$" in text else f"${text}$"  # noqa: E731
    gold = parse(wrap(ground_truth), **parse_kwargs)
    predicted = parse(wrap(answer), **parse_kwargs)
    return float(bool(verify(gold, predicted, timeout_seconds=timeout_seconds)))


def grade_reply(reply: str, ground_truth: str, timeout_seconds: int | None = 5) -> tuple[float, str | None]:
    """(1.0 or 0.0, the committed answer or None) for a whole reply."""
    answer = final_answer(reply)
    return grade_answer(answer, ground_truth, timeout_seconds), answer
