"""Prompt sources and verifiable rewards."""

from rayspec.data.prompts import (SYSTEM_PROMPT, Problem, PromptSource, arithmetic_problems,
                                  format_question, load_gsm8k)
from rayspec.data.reward import extract_final_number, math_reward

DATASETS = ("arithmetic", "gsm8k")


def load_problems(name: str, path: str | None, split: str, num_problems: int | None,
                  seed: int) -> list[Problem]:
    """Problems of ``data.name``.

    Raises:
        ValueError: unknown name (the message names ``data.name``).
    """
    if name == "arithmetic":
        return arithmetic_problems(num_problems or 1000, seed)
    if name == "gsm8k":
        problems = load_gsm8k(path or "openai/gsm8k", split)
        return problems[:num_problems] if num_problems else problems
    raise ValueError(f"data.name={name!r}: unknown dataset, expected one of {DATASETS}")


__all__ = ["Problem", "PromptSource", "SYSTEM_PROMPT", "arithmetic_problems", "extract_final_number",
           "format_question", "load_gsm8k", "load_problems", "math_reward"]
