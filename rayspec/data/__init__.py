"""Prompt sources and verifiable rewards."""

from rayspec.config import DATASETS  # one list of names, validated by the config
from rayspec.data.prompts import (SYSTEM_PROMPT, Problem, PromptSource, arithmetic_problems,
                                  chat_prompt_ids, format_question, load_gsm8k)
from rayspec.data.reward import extract_final_number, math_reward


def load_problems(data) -> list[Problem]:
    """Problems of the dataset a ``DataConfig`` (``cfg.data``) names.

    "arithmetic": ``data.num_problems`` (default 1000) seeded problems of
    difficulty ``data.level`` with quantities up to ``data.max_operand``
    (see :func:`arithmetic_problems`); ``path`` and ``split`` are ignored.
    "gsm8k": ``data.split`` of ``data.path`` (default the hub id
    "openai/gsm8k"), its first ``data.num_problems`` when given.

    Raises:
        ValueError: unknown name (the message names ``data.name``), or a bad GSM8K row.
        FileNotFoundError, ImportError: see :func:`load_gsm8k`.
    """
    if data.name == "arithmetic":
        return arithmetic_problems(data.num_problems or 1000, data.seed, data.max_operand, data.level)
    if data.name == "gsm8k":
        problems = load_gsm8k(data.path or "openai/gsm8k", data.split)
        return problems if data.num_problems is None else problems[:data.num_problems]
    raise ValueError(f"data.name={data.name!r}: unknown dataset, expected one of {DATASETS}")


def batch_rewards(batch, problems: list[Problem]) -> list[float]:
    """:func:`math_reward` of each sample of a ``RolloutBatch`` against the
    answer of its group's problem (``problems[batch.group[i]]``)."""
    return [math_reward(text, problems[g].answer) for text, g in zip(batch.texts, batch.group)]


def heldout_split(problems: list[Problem], n: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, ``n`` held-out problems): the held-out set is the
    last ``n`` distinct questions of ``problems``; training keeps every
    problem whose question is not among them (a generated task repeats
    questions, and none of those may leak into training).

    Raises:
        ValueError: fewer than ``n`` + 1 distinct questions (nothing would be left to train on).
    """
    if n <= 0:
        return list(problems), []
    held: dict[str, Problem] = {}
    for p in reversed(problems):
        held.setdefault(p.question, p)
        if len(held) == n:
            break
    train = [p for p in problems if p.question not in held]
    if len(held) < n or not train:
        distinct = len({p.question for p in problems})
        raise ValueError(f"{n} held-out problems leave nothing to train on: the dataset has "
                         f"{distinct} distinct questions")
    return train, list(reversed(held.values()))


__all__ = ["DATASETS", "Problem", "PromptSource", "SYSTEM_PROMPT", "arithmetic_problems",
           "batch_rewards", "chat_prompt_ids", "extract_final_number", "format_question", "heldout_split", "load_gsm8k",
           "load_problems", "math_reward"]
