"""Prompt sources and verifiable rewards."""

from rayspec.config import DATASETS  # one list of names, validated by the config
from rayspec.data.prompts import (SYSTEM_PROMPT, Problem, PromptSource, arithmetic_problems,
                                  chat_prompt_ids, format_question, load_gsm8k)
from rayspec.data.reward import extract_final_number, math_reward


def load_problems(name: str, path: str | None, split: str, num_problems: int | None,
                  seed: int, level: int = 2) -> list[Problem]:
    """Problems of dataset ``data.name``.

    "arithmetic": ``num_problems`` (default 1000) seeded problems of difficulty
    ``level`` (see :func:`arithmetic_problems`); ``path`` and ``split`` are ignored. "gsm8k": ``split`` of ``path`` (default the hub id
    "openai/gsm8k"), its first ``num_problems`` when given.

    Raises:
        ValueError: unknown name (the message names ``data.name``), or a bad GSM8K row.
        FileNotFoundError, ImportError: see :func:`load_gsm8k`.
    """
    if name == "arithmetic":
        return arithmetic_problems(num_problems or 1000, seed, level=level)
    if name == "gsm8k":
        problems = load_gsm8k(path or "openai/gsm8k", split)
        return problems if num_problems is None else problems[:num_problems]
    raise ValueError(f"data.name={name!r}: unknown dataset, expected one of {DATASETS}")


__all__ = ["DATASETS", "Problem", "PromptSource", "SYSTEM_PROMPT", "arithmetic_problems",
           "chat_prompt_ids", "extract_final_number", "format_question", "load_gsm8k", "load_problems",
           "math_reward"]
