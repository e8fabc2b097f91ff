"""Prompt sources: the built-in tasks and datasets of one's own (files)."""

from rayspec.config import DATASETS  # one list of names, validated by the config
from rayspec.data.files import DataFileError, load_files
from rayspec.data.prompts import (SYSTEM_PROMPT, Problem, PromptSource, arithmetic_problems, load_gsm8k,
                                  prompt_ids)


def load_problems(data) -> list[Problem]:
    """Problems of the dataset a ``DataConfig`` (``cfg.data``) names, its
    first ``data.num_problems`` where given.

    "arithmetic": ``data.num_problems`` (default 1000) seeded problems of
    difficulty ``data.level`` with quantities up to ``data.max_operand``
    (see :func:`arithmetic_problems`). "gsm8k": ``data.split`` of
    ``data.path`` (default the hub id "openai/gsm8k"). "files":
    ``data.path`` read by :func:`rayspec.data.files.load_files`.

    Raises:
        ValueError: unknown name (the message names ``data.name``), or a bad
            row (``DataFileError`` for files).
        FileNotFoundError, ImportError: see :func:`load_gsm8k`.
    """
    if data.name == "arithmetic":
        return arithmetic_problems(data.num_problems or 1000, data.seed, data.max_operand, data.level,
                                   data.system_prompt)
    if data.name == "gsm8k":
        problems = load_gsm8k(data.path or "openai/gsm8k", data.split or "train", data.system_prompt)
    elif data.name == "files":
        problems = load_files(data.path, data.prompt_key, data.split, data.system_prompt)
    else:
        raise ValueError(f"data.name={data.name!r}: unknown dataset, expected one of {DATASETS}")
    return problems if data.num_problems is None else problems[:data.num_problems]


def train_and_heldout(data, held_out: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, ``held_out`` held-out problems) of ``cfg.data``:
    the first ``held_out`` rows of ``data.eval_path`` where it is given
    (read like ``data.path``), else the dataset's last ``held_out``
    distinct prompts (:func:`heldout_split`). ``held_out`` = 0: none.

    Raises:
        ValueError: see :func:`load_problems` and :func:`heldout_split`;
            ``DataFileError`` naming ``data.eval_path`` for its file errors
            and for columns other than ``data.path``'s.
    """
    problems = load_problems(data)
    if data.eval_path is None or held_out <= 0:
        return heldout_split(problems, held_out)
    try:
        held = load_files(data.eval_path, data.prompt_key, None, data.system_prompt)[:held_out]
    except DataFileError as e:
        raise DataFileError(f"data.eval_path: {e}") from None
    if set(held[0].columns) != set(problems[0].columns):
        raise DataFileError(f"data.eval_path: columns {sorted(held[0].columns)} differ from data.path's "
                            f"{sorted(problems[0].columns)} (besides the prompt): the reward functions read both")
    return problems, held


def heldout_split(problems: list[Problem], n: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems, ``n`` held-out problems): the held-out set is the
    last ``n`` distinct prompts of ``problems``; training keeps every
    problem whose prompt is not among them (a generated task repeats
    prompts, and none of those may leak into training).

    Raises:
        ValueError: fewer than ``n`` + 1 distinct prompts (nothing would be left to train on).
    """
    if n <= 0:
        return list(problems), []
    held: dict[str, Problem] = {}
    for p in reversed(problems):
        held.setdefault(p.key, p)
        if len(held) == n:
            break
    train = [p for p in problems if p.key not in held]
    if len(held) < n or not train:
        distinct = len({p.key for p in problems})
        raise ValueError(f"{n} held-out problems leave nothing to train on: the dataset has "
                         f"{distinct} distinct prompts")
    return train, list(reversed(held.values()))


__all__ = ["DATASETS", "DataFileError", "Problem", "PromptSource", "SYSTEM_PROMPT", "arithmetic_problems",
           "heldout_split", "load_files", "load_gsm8k", "load_problems", "prompt_ids", "train_and_heldout"]
