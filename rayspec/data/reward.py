"""Verifiable reward: the response's final number against the reference.

GSM8K convention (Cobbe et al. 2021, arXiv 2110.14168): the solution ends
with a line ``#### N``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUM = r"-?\d[\d,]*(?:\.\d+)?"


def _normalise(s: str) -> str | None:
    s = s.strip().replace(",", "").replace("$", "").lstrip("+").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The number after the last ``####``; else in the last ``\\boxed{}``;
    else the last number in the text. Normalised ("1,000." -> "1000",
    "72.0" -> "72"); None if there is none."""
    for pattern in (r"####\s*\$?\s*(" + _NUM + ")", r"\\boxed\{\s*\$?(" + _NUM + r")\s*\}"):
        hits = re.findall(pattern, text)
        if hits:
            return _normalise(hits[-1])
    hits = re.findall(_NUM, text)
    return _normalise(hits[-1]) if hits else None


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final number equals ``answer`` numerically, else 0.0."""
    got = extract_final_number(response)
    return 1.0 if got is not None and got == _normalise(answer) else 0.0
