"""The built-in reward functions, in TRL's form
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``:

- ``last_number``: the completion's final number against the ``answer``
  column's (1.0 / 0.0): the built-in tasks' reward.
- ``math_verify``: Hugging Face's math-verify (LaTeX and plain answers,
  symbolic equality) against the ``answer`` column, the completion's
  answer read where it is stated (boxed, or after an anchor).
- ``format``: 1.0 where ``reward.format_pattern`` matches at the start of
  the completion (``re.match``, ``re.DOTALL``), as TRL's format rewards do.

A completion is a string for standard prompts and a one-message list
``[{"role": "assistant", "content": ...}]`` for conversational ones (TRL).
An ``answer`` that holds a whole GSM8K solution counts by its ``#### N`` line.

GSM8K convention (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems", arXiv 2110.14168): a solution ends with a line ``#### N`` holding
the final number. Responses are asked to follow it; ``\\boxed{N}`` and a bare
last number are accepted as fallbacks.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A sign counts only when it cannot be a binary operator ("10-3" ends in 3, not -3);
# commas count only as thousands separators so that "3,4,5" ends in 5.
_NUM = re.compile(r"(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def normalise_number(s: str) -> str | None:
    """Canonical string of a number: commas, "$", a leading "+" and a trailing
    "." dropped; integral values without a decimal point ("72.0" -> "72"),
    others in plain notation ("0.50" -> "0.5"). None if ``s`` is not a finite number."""
    s = s.strip().replace(",", "").replace("$", "").lstrip("+").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def _last_number(text: str) -> str | None:
    hits = _NUM.findall(text)
    return normalise_number(hits[-1]) if hits else None


def extract_final_number(text: str) -> str | None:
    """The final number of a response, normalised by :func:`normalise_number`.

    Looks, in order, at the first number after the last ``####`` (the GSM8K
    convention, Cobbe et al. 2021, arXiv 2110.14168), the last number inside
    the last ``\\boxed{...}``, and the last number anywhere in ``text``.
    Returns None if there is no number at all.
    """
    if "####" in text:
        m = _NUM.search(text.rsplit("####", 1)[1])
        if m:
            return normalise_number(m.group())
    boxes = _BOXED.findall(text)
    if boxes:
        got = _last_number(boxes[-1])
        if got is not None:
            return got
    return _last_number(text)


def completion_text(completion) -> str:
    """A completion's text: the string, or the (assistant) message's content."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _reference(answer) -> str:
    """The reference answer's text: after the last ``####`` where it has one (a GSM8K solution)."""
    return str(answer).rsplit("####", 1)[-1]


def last_number(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1.0 where the completion's final number (:func:`extract_final_number`)
    equals the ``answer`` column's final number, else 0.0; None where the
    answer holds no number (the sample is left out of this function's mean)."""
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        ref = extract_final_number(str(a))
        out.append(None if ref is None else float(extract_final_number(completion_text(c)) == ref))
    return out


def math_verify(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1.0 where Hugging Face math-verify (``math_verify.parse`` /
    ``verify``, symbolic equality) finds the completion's answer equal to
    the ``answer`` column's, else 0.0; None where the answer cannot be
    parsed (as TRL's ``accuracy_reward`` skips it).

    The completion's answer is read where it is stated: ``\\boxed{...}``
    first, then LaTeX after "final answer is", then a plain answer after an
    anchor ("The answer is 21", "answer: 21"). math-verify's default would
    also take any expression in the text, and so credit a response that
    restates "9 + 12" for the answer 21 (seen in README's example task: the
    response "9 + 12 = ?" scored 1.0). The answer column is read with
    the default (LaTeX or plain; a GSM8K solution by its ``#### N`` line).
    math-verify's own timeouts (SIGALRM) stay on where the function runs on
    a main thread (Ray actors do); ``reward.timeout_s`` bounds it
    everywhere."""
    import threading

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    stated = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
              ExprExtractionConfig(try_extract_without_anchor=False)]
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for c, a in zip(completions, answer):
        gold = parse(_reference(a), parsing_timeout=limit)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion_text(c), extraction_config=stated, parsing_timeout=limit)
        out.append(float(verify(gold, pred, timeout_seconds=limit)))
    return out


def format_reward(pattern: str):
    """The ``format`` reward for ``reward.format_pattern``: 1.0 where
    ``re.match(pattern, completion, re.DOTALL)``, else 0.0."""
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, completion_ids, **columns) -> list[float]:  # noqa: A001 (its record name)
        return [float(regex.match(completion_text(c)) is not None) for c in completions]

    return format
