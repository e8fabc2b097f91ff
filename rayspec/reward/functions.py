"""Reward functions by reference (``reward.functions``): import them, and
check, before the first rollout, that each can be called with the dataset's
columns in TRL's form ``fn(prompts, completions, completion_ids, **columns)``.
"""

from __future__ import annotations

import inspect
from typing import Callable

from rayspec.config import BUILTIN_REWARDS
from rayspec.files import import_object
from rayspec.reward import builtins

STANDARD_ARGS = ("prompts", "completions", "completion_ids")


class RewardFunctionError(ValueError):
    """A reward function cannot be imported or called as TRL's form asks;
    the message names ``reward.functions[i]``."""


def resolve(spec: str, key: str, format_pattern: str | None = None) -> Callable:
    """The function ``spec`` names: a built-in (``BUILTIN_REWARDS``),
    ``path/to/file.py:name`` (a path ending in ``.py``) or
    ``package.module:name``.

    Raises:
        RewardFunctionError: naming ``key``: the file or module cannot be
            imported (with the error it raised), it has no ``name``, or
            ``name`` is not callable.
    """
    if spec in BUILTIN_REWARDS:
        return builtins.format_reward(format_pattern) if spec == "format" else getattr(builtins, spec)
    fn = import_object(spec, key, RewardFunctionError)
    if not callable(fn):
        raise RewardFunctionError(f"{key}: {spec} is a {type(fn).__name__}, not a function")
    return fn


def check_signature(fn: Callable, key: str, columns: set[str]) -> None:
    """Check that ``fn`` can be called as
    ``fn(prompts=..., completions=..., completion_ids=..., **columns)`` with
    the dataset's ``columns`` (TRL passes every column; a function without
    ``**kwargs`` gets only those it names).

    Raises:
        RewardFunctionError: naming ``key``: a positional-only parameter, a
            required parameter that is neither a standard argument nor a
            dataset column (listing the columns), or no way to receive
            ``completions``.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"{key}: cannot read its signature: {e}") from None
    names = {p.name for p in params}
    has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:
        if p.kind is p.POSITIONAL_ONLY:
            raise RewardFunctionError(f"{key}: parameter {p.name!r} is positional-only; rayspec passes "
                                      f"{', '.join(STANDARD_ARGS)} and the dataset's columns by keyword (TRL's form)")
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty \
                and p.name not in STANDARD_ARGS and p.name not in columns:
            raise RewardFunctionError(f"{key}: parameter {p.name!r} is neither one of {list(STANDARD_ARGS)} nor a "
                                      f"dataset column (the columns are {sorted(columns)})")
    if "completions" not in names and not has_kwargs:
        raise RewardFunctionError(f"{key}: takes no 'completions' (TRL's form: "
                                  "fn(prompts, completions, completion_ids, **columns) -> list[float | None])")


def accepted_kwargs(fn: Callable, columns: set[str]) -> set[str] | None:
    """The argument names ``fn`` receives: None for all (it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params} & (set(STANDARD_ARGS) | columns)
