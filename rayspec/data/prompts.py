"""Prompt sources: the built-in tasks (a seeded arithmetic task for offline
runs, and GSM8K from a local jsonl or the Hugging Face hub), the prompt's
token ids, and the epoch-shuffled batches of prompts each RL step draws.
Datasets of one's own are read by ``rayspec.data.files``."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from rayspec.config import DEFAULT_SYSTEM_PROMPT as SYSTEM_PROMPT
from rayspec.reward.builtins import normalise_number

COT_INSTRUCTION = ("Think step by step, then give the final answer on its own last line "
                   "as '#### <number>'.")
# One-operation problems are answered directly: a 135M policy sampling at
# temperature 1.0 loses its way in long reasoning (measured here: 4% correct
# on "What is a + b?" with free-form answers, 12% when asked for the number only).
DIRECT_INSTRUCTION = "Reply with only the number."


Messages = list  # [{"role": str, "content": str}, ...]: a conversational prompt (TRL's format)


@dataclass(frozen=True)
class Problem:
    """One prompt and the dataset columns its reward functions read.

    Attributes:
        prompt: a string, used as is ("standard" format, as TRL names it), or
            a list of ``{"role", "content"}`` messages put through the
            tokenizer's chat template ("conversational"); a system prompt,
            where there is one, is already its first message.
        columns: every other column of the row (e.g. ``{"answer": "72"}``),
            passed to the reward functions as keyword lists.
        source: dataset name ("arithmetic", "gsm8k") or the file the row came from.
        index: 0-based position in the source.
    """

    prompt: Union[str, Messages]
    columns: dict[str, Any]
    source: str
    index: int

    @property
    def text(self) -> str:
        """The prompt for people to read: the string, or the last message's content."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]

    @property
    def key(self) -> str:
        """The prompt's identity (held-out problems are kept out of training by it)."""
        return self.prompt if isinstance(self.prompt, str) else json.dumps(self.prompt, sort_keys=True)


def conversation(question: str, system_prompt: str | None) -> Messages:
    """``[system, user]`` messages (no system message where ``system_prompt`` is None)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return msgs + [{"role": "user", "content": question}]


def gsm8k_final_answer(answer_text: str) -> str:
    """The canonical number after the last ``####`` of a GSM8K solution
    (Cobbe et al. 2021, arXiv 2110.14168), e.g. "... #### 1,000" -> "1000".

    Raises:
        ValueError: no ``####`` marker, or no number after it.
    """
    if "####" not in answer_text:
        raise ValueError("answer has no '#### N' final line")
    raw = answer_text.rsplit("####", 1)[1]
    number = normalise_number(raw)
    if number is None:
        raise ValueError(f"'#### {raw.strip()}' is not a number")
    return number


def _gsm8k_problem(question: str, answer_text: str, index: int, system_prompt: str | None) -> Problem:
    return Problem(conversation(f"{question}\n{COT_INSTRUCTION}", system_prompt),
                   {"answer": gsm8k_final_answer(answer_text)}, "gsm8k", index)


def _read_gsm8k_jsonl(file: Path, system_prompt: str | None) -> list[Problem]:
    problems = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(_gsm8k_problem(row["question"], row["answer"], len(problems), system_prompt))
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{lineno}: invalid JSON: {e}") from None
            except KeyError as e:
                raise ValueError(f"{file}:{lineno}: GSM8K row lacks key {e}") from None
            except (ValueError, TypeError) as e:
                raise ValueError(f"{file}:{lineno}: bad GSM8K row: {e}") from None
    return problems


def load_gsm8k(path: str, split: str = "train", system_prompt: str | None = SYSTEM_PROMPT) -> list[Problem]:
    """GSM8K problems from ``<path>/<split>.jsonl``, from the jsonl file ``path``,
    or, when ``path`` is not a local path, from the hub dataset ``path``
    (config "main", e.g. "openai/gsm8k"). Each prompt is ``system_prompt``
    and the question with the instruction to reason step by step and end
    with ``#### <number>``; the ``answer`` column is the final number.

    Raises:
        ValueError: a bad row (invalid JSON, missing key, answer without a
            ``#### N`` line; the message names the file and the 1-based line),
            or a file without rows.
        FileNotFoundError: ``path`` is a local directory without ``<split>.jsonl``,
            or looks like a local path ("/", ".", "~") that does not exist.
        ImportError: ``path`` is a hub id and ``datasets`` is not installed.
    """
    p = Path(path).expanduser()
    file = p / f"{split}.jsonl" if p.is_dir() else p
    if file.is_file():
        problems = _read_gsm8k_jsonl(file, system_prompt)
        if not problems:
            raise ValueError(f"{file}: no GSM8K rows (empty file)")
        return problems
    # A hub id is "owner/name"; anything path-like that is missing is a typo, not a hub id.
    if p.exists() or path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"GSM8K path {path}: no file {file}")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"GSM8K path {path!r} is not a local path, and loading it from the "
                          "Hugging Face hub needs the `datasets` package") from e
    rows = datasets.load_dataset(path, "main", split=split)
    return [_gsm8k_problem(r["question"], r["answer"], i, system_prompt) for i, r in enumerate(rows)]


_NAMES = ("Tom", "Ana", "Lee", "Maya", "Sam", "Ravi", "Nora", "Omar")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils")


# Each template draws its numbers from (rng, max_operand) and returns (question, answer);
# counts never go negative so the stories stay plausible.
def _buy_give(rng: random.Random, m: int, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, m), rng.randint(2, m)
    c = rng.randint(1, min(m, a + b))
    return (f"{name} has {a} {item} and buys {b} more, then gives away {c}. "
            f"How many {item} does {name} have now?", a + b - c)


def _bags(rng: random.Random, m: int, name: str, item: str) -> tuple[str, int]:
    k, a, b = rng.randint(2, 9), rng.randint(2, m), rng.randint(2, m)
    return (f"{name} buys {k} bags with {a} {item} in each bag and already had {b} {item}. "
            f"How many {item} does {name} have in total?", k * a + b)


def _shelves(rng: random.Random, m: int, name: str, item: str) -> tuple[str, int]:
    k, a, b = rng.randint(2, 9), rng.randint(2, m), rng.randint(2, m)
    c = rng.randint(1, min(m, k * a))
    return (f"{name} has {k} shelves with {a} {item} on each shelf. {name} gives away {c} {item} "
            f"and then buys {b} more. How many {item} does {name} have now?", k * a - c + b)


def _three_days(rng: random.Random, m: int, name: str, item: str) -> tuple[str, int]:
    a, b, k = rng.randint(2, m), rng.randint(2, m), rng.randint(2, 9)
    return (f"{name} collects {a} {item} on Monday and {b} {item} on Tuesday. On Wednesday "
            f"{name} collects {k} times as many {item} as on Monday. How many {item} does "
            f"{name} collect over the three days?", a + b + k * a)


def _losses(rng: random.Random, m: int, name: str, item: str) -> tuple[str, int]:
    a, b, c = rng.randint(0, m), rng.randint(2, m), rng.randint(2, m)
    return (f"{name} starts with {a + b + c} {item}, loses {b} of them, then loses {c} more. "
            f"How many {item} does {name} have left?", a)


_TEMPLATES: tuple[Callable[[random.Random, int, str, str], tuple[str, int]], ...] = (
    _buy_give, _bags, _shelves, _three_days, _losses)


def _one_op(rng: random.Random, m: int) -> tuple[str, int]:
    a, b = rng.randint(2, m), rng.randint(2, m)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def arithmetic_problems(n: int, seed: int, max_operand: int = 50, level: int = 2,
                        system_prompt: str | None = SYSTEM_PROMPT) -> list[Problem]:
    """``n`` problems with exact integer answers (the ``answer`` column),
    deterministic in ``seed``; each prompt is ``system_prompt`` and the
    question with its answer-format instruction.

    Args:
        n: number of problems.
        seed: RNG seed.
        max_operand: largest drawn quantity (a starting total may be the sum
            of three); multipliers are 2-9.
        level: 1 = one addition or subtraction ("What is 7 + 5?"), answered
            directly; 2 = word problems with 2-3 operations (+, -, *),
            answered with step-by-step reasoning.

    Raises:
        ValueError: ``n < 0``, ``max_operand < 2`` or an unknown level.
    """
    if n < 0:
        raise ValueError(f"arithmetic_problems: n={n} must be >= 0")
    if max_operand < 2:
        raise ValueError(f"arithmetic_problems: max_operand={max_operand} must be >= 2")
    if level not in (1, 2):
        raise ValueError(f"arithmetic_problems: level={level} must be 1 or 2")
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        if level == 1:
            question, answer = _one_op(rng, max_operand)
            instruction = DIRECT_INSTRUCTION
        else:
            template = rng.choice(_TEMPLATES)
            question, answer = template(rng, max_operand, rng.choice(_NAMES), rng.choice(_ITEMS))
            instruction = COT_INSTRUCTION
        problems.append(Problem(conversation(f"{question}\n{instruction}", system_prompt),
                                {"answer": str(answer)}, "arithmetic", i))
    return problems


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """Token ids of ``problem``'s prompt, as TRL's GRPOTrainer makes them: a
    conversational prompt through the tokenizer's chat template with the
    assistant turn opened (``add_generation_prompt``); a standard prompt
    tokenized as is, without special tokens added."""
    if isinstance(problem.prompt, str):
        return list(tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])
    return list(tokenizer.apply_chat_template(
        problem.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


class PromptSource:
    """Batches of problems, each problem once per epoch, reshuffled every epoch
    by an RNG seeded from (seed, epoch). A batch may span two epochs.
    Resumable through :meth:`state_dict`.

    Raises:
        ValueError: no problems, or ``batch_size < 1``.
    """

    def __init__(self, problems: list[Problem], batch_size: int, seed: int):
        if not problems:
            raise ValueError("PromptSource: no problems")
        if batch_size < 1:
            raise ValueError(f"PromptSource: batch_size={batch_size} must be >= 1")
        self.problems, self.batch_size, self.seed = list(problems), batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        # A str seed is hashed with SHA-512, so the order is stable across processes.
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[Problem]:
        """The next ``batch_size`` problems."""
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            batch.append(self.problems[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The cursor: ``epoch`` and ``position`` (problems consumed in that epoch)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a cursor from :meth:`state_dict` (same problems and seed).

        Raises:
            ValueError: the cursor does not fit this problem list.
        """
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.problems):
            raise ValueError(f"PromptSource: cursor epoch={epoch} position={position} "
                             f"does not fit {len(self.problems)} problems")
        self.epoch, self.position = epoch, position
        self._order = self._shuffle(epoch)
