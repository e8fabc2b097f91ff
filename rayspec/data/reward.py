"""Verifiable reward: the response's final number against the reference.

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


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final number (GSM8K ``#### N`` convention, see
    :func:`extract_final_number`) equals ``answer`` numerically, else 0.0."""
    got = extract_final_number(response)
    return 1.0 if got is not None and got == normalise_number(answer) else 0.0
