"""A verifiable reward for math answers: extract the final answer of a completion, normalize it, compare it with the
record's ``answer``.

`extract_answer` takes, in order of precedence, the last ``\\boxed{...}`` (or ``\\fbox{...}``; braces balanced, as
MATH and DeepSeek-R1-style prompts ask for), the text after the last ``####`` (GSM8K's solutions), or the last number
in the text. `normalize_answer` removes what does not change the value: surrounding ``$``, ``\\left`` / ``\\right``,
LaTeX spacing, ``\\text{...}`` wrappers, ``\\dfrac`` / ``\\tfrac`` spellings, thousands separators, a trailing period,
a leading ``x =``, spaces. `answers_match` compares two normalized answers as exact rationals when both read as
numbers (``0.5``, ``1/2``, ``\\frac{1}{2}``, ``50%`` is not a number) and as strings otherwise.

`math_answer` is the reward function (``"colo.apps.rlhf.math_answer:math_answer"`` in ``grpo.reward_functions``):
1.0 where the completion's answer matches the record's, else 0.0. A record's ``answer`` that itself holds a marker (a
whole GSM8K solution ending in ``#### 72``, or a ``\\boxed{}``) is reduced the same way first. On the synthetic
``a+b=`` prompts (`colo.apps.rlhf.synthetic.arithmetic_prompts`) it scores a bare ``19`` as `exact_answer` does, and
also ``the sum is 19.``, ``\\boxed{19}`` or ``#### 19``.

This is a deliberately small, dependency-free checker (numbers, fractions, simple expressions compared as text). For
symbolic equivalence (``\\sqrt{2}/2`` vs ``1/\\sqrt{2}``, sets, intervals) Hugging Face's ``math-verify`` is the
thorough choice; any such function plugs in through ``grpo.reward_functions``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*=\s*(.+)$")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last ``\\boxed{}``'s content, else what follows the last ``####``, else the
    last number; ``None`` when there is none (module docstring)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """``answer`` without what does not change its value (module docstring)."""
    text = answer.strip()
    for _ in range(2):
        text = text.strip().rstrip(".").strip().strip("$").strip()
        text = _TEXT.sub(r"\1", text)
    for token in (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", "~"):
        text = text.replace(token, "")
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = _THOUSANDS.sub("", text)
    text = text.rstrip(".").strip()
    assignment = _ASSIGNMENT.match(text)
    if assignment:
        text = assignment.group(1)
    return re.sub(r"\s+", "", text)


def as_number(answer: str) -> Fraction | None:
    """A normalized answer's exact value when it is an integer, a decimal, ``a/b`` or ``\\frac{a}{b}``; else
    ``None``."""
    frac = _FRAC.match(answer)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/-?\d+(?:\.\d*)?)?", answer):
            return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: str, expected: str) -> bool:
    """Whether two answers agree after `normalize_answer`: as exact numbers when both are numbers, else as text."""
    left, right = normalize_answer(predicted), normalize_answer(expected)
    left_value, right_value = as_number(left), as_number(right)
    if left_value is not None and right_value is not None:
        return left_value == right_value
    return left == right


def math_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence, **_) -> list[float]:
    """1.0 where the completion's final answer matches the record's ``answer``, else 0.0 (module docstring)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        expected = str(expected)
        if "####" in expected or _BOX.search(expected):
            expected = extract_answer(expected) or expected
        predicted = extract_answer(completion)
        rewards.append(float(predicted is not None and answers_match(predicted, expected)))
    return rewards


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (``\\boxed 5``: the token
    after it); ``None`` without one or with unclosed braces."""
    matches = list(_BOX.finditer(text))
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for index in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[index], 0)
                if depth == 0:
                    return text[start + 1 : index].strip()
            continue  # unclosed: try an earlier box
        token = text[start:].split()
        if token:
            return token[0].strip("$")
    return None
