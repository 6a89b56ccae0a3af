"""Embedded synthetic preference sets, generated from a seed at run time (no download).

- `python_line_records` (the ``tiny-rm`` / ``tiny-dpo`` presets): a line of the Python standard library's own
  source (chosen) against the same words in a shuffled order (rejected), after the line before it as the prompt.
  Telling them apart takes the syntax a language model learns (a 0.2M-parameter reward model gets ~94% on
  held-out pairs after 200 steps on one CPU process).
- `arithmetic_prompts` (the ``tiny-grpo`` preset): distinct ``a+b=`` prompts with their ``answer``, the
  verifiable task of online RL (reward: the exact answer, or `colo.apps.rlhf.math_answer.math_answer`, which also
  reads ``\boxed{}`` / ``####`` / last-number answers).
- `arithmetic_records`: sums answered correctly or with the last digit corrupted. Harder than it looks: a reward
  model must learn addition modulo 10 first, and the tiny presets do not get past chance in minutes (measured),
  so it serves the tests only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic_records(num_records: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``{"prompt": "12+35=", "chosen": "47", "rejected": "43"}`` records: the rejected answer is the sum with its
    last digit changed (never equal to the correct one)."""
    rng = random.Random(seed)
    records = []
    for _ in range(num_records):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        answer = str(a + b)
        position = len(answer) - 1
        digit = rng.choice([d for d in "0123456789" if d != answer[position]])
        wrong = answer[:position] + digit + answer[position + 1 :]
        records.append({"prompt": f"{a}+{b}=", "chosen": answer, "rejected": wrong})
    return records


def worked_sum(a: int, b: int) -> str:
    """A worked solution of ``a + b`` in GSM8K's form, the steps then ``#### <answer>``: the ones, the rest, their sum,
    e.g. ``12 + 9`` -> ``"2+9=11, 10+0=10, 10+11=21 #### 21"`` (the ``tiny-grpo-long`` preset's longer answers;
    `colo.apps.rlhf.math_answer.math_answer` reads the number after ``####`` of the completion and of the record)."""
    ones, rest = a % 10 + b % 10, a - a % 10 + b - b % 10
    return f"{a % 10}+{b % 10}={ones}, {a - a % 10}+{b - b % 10}={rest}, {rest}+{ones}={a + b} #### {a + b}"


def arithmetic_prompts(
    num_prompts: int, *, seed: int = 0, max_operand: int = 20, worked: bool = False
) -> list[dict[str, str]]:
    """``{"prompt": "12+7=", "answer": "19"}`` records of distinct problems ``a + b`` with ``a, b`` in
    ``[0, max_operand)``, in a seeded order (so the tail a run holds out never appears in its training prompts).

    Args:
        num_prompts (int): how many.
        seed (int): the order's seed. Default: ``0``.
        max_operand (int): operands in ``[0, max_operand)``. Default: ``20``.
        worked (bool): the answer is `worked_sum`'s solution (``"2+7=9, 10+0=10, 10+9=19 #### 19"``), several
            times longer than the sum; score it with `colo.apps.rlhf.math_answer.math_answer` (after ``####``).
            Default: ``False``.

    Raises:
        ValueError: more prompts asked for than the ``max_operand ** 2`` distinct problems.
    """
    if num_prompts > max_operand**2:
        raise ValueError(
            f"arithmetic_prompts: {num_prompts} prompts asked for, but operands in [0, {max_operand}) give only "
            f"{max_operand**2} distinct problems; raise max_operand or ask for fewer"
        )
    problems = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(problems)
    return [
        {"prompt": f"{a}+{b}=", "answer": worked_sum(a, b) if worked else str(a + b)} for a, b in problems[:num_prompts]
    ]


def python_line_records(num_records: int, *, seed: int = 0, max_chars: int = 40) -> list[dict[str, str]]:
    """``{"prompt": <the previous line's last 24 characters + newline>, "chosen": <a line>, "rejected": <its words
    shuffled>}`` records from the standard library's ``.py`` files (`colo.apps.data.default_corpus`): lines of 3 or
    more words and at most ``max_chars`` characters, comments and string lines skipped, drawn in a seeded order. The
    same on every run of the same Python (other versions carry other files).

    Raises:
        ValueError: the corpus has fewer suitable lines than ``num_records``.
    """
    from ..data.sources import default_corpus

    rng = random.Random(seed)
    candidates = []
    for path in default_corpus():
        previous = None
        for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", '"', "'")):
                continue
            if previous is not None and len(line.split()) >= 3 and len(line) <= max_chars:
                candidates.append((previous[-24:], line))
            previous = line
        if len(candidates) >= 20 * num_records:
            break
    rng.shuffle(candidates)
    records = []
    for prompt, line in candidates:
        words = line.split()
        order = list(range(len(words)))
        while order == sorted(order):
            rng.shuffle(order)
        wrong = " ".join(words[i] for i in order)
        if wrong != line:
            records.append({"prompt": prompt + "\n", "chosen": line, "rejected": wrong})
        if len(records) == num_records:
            return records
    raise ValueError(f"python_line_records: the corpus holds {len(records)} suitable lines, not {num_records}")


def sft_records(num_records: int, *, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/response records of the correct answers (the SFT stage that precedes DPO)."""
    return [{"prompt": r["prompt"], "response": r["chosen"]} for r in arithmetic_records(num_records, seed=seed)]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Write records as JSON Lines (creating the directory); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
