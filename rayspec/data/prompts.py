"""Prompt sources: GSM8K (local jsonl or the Hugging Face hub) and a built-in,
seeded arithmetic task for offline runs."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PROMPT = "You are a careful math tutor. Solve the problem step by step."


@dataclass(frozen=True)
class Problem:
    """One prompt with a verifiable answer.

    Attributes:
        question: problem text.
        answer: canonical final number as a string ("72", "-3", "0.5").
        source: dataset name.
        index: row index in the source.
    """

    question: str
    answer: str
    source: str
    index: int


def gsm8k_final_answer(answer_text: str) -> str:
    """The number after ``####`` in a GSM8K solution (Cobbe et al. 2021), commas removed.

    Raises:
        ValueError: no ``####`` marker.
    """
    if "####" not in answer_text:
        raise ValueError("answer has no '#### N' final line")
    return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def load_gsm8k(path: str, split: str = "train") -> list[Problem]:
    """GSM8K from ``<path>/<split>.jsonl``, a jsonl file, or a hub id.

    Raises:
        ValueError: a bad row; the message names the file and 1-based line.
        ImportError: ``path`` is a hub id and ``datasets`` is not installed.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / f"{split}.jsonl"
    if p.is_file():
        problems = []
        with open(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    problems.append(Problem(row["question"], gsm8k_final_answer(row["answer"]),
                                            "gsm8k", len(problems)))
                except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
                    raise ValueError(f"{p}:{lineno}: bad GSM8K row: {e!r}") from None
        return problems
    if Path(path).expanduser().exists() or path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data.path={path}: no {split}.jsonl there")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"data.path={path} is not a local path; loading it from the "
                          "Hugging Face hub needs `pip install datasets`") from e
    ds = datasets.load_dataset(path, "main", split=split)
    return [Problem(r["question"], gsm8k_final_answer(r["answer"]), "gsm8k", i)
            for i, r in enumerate(ds)]


_NAMES = ["Tom", "Ana", "Lee", "Maya", "Sam", "Ravi", "Nora", "Omar"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils"]


def arithmetic_problems(n: int, seed: int, max_operand: int = 50) -> list[Problem]:
    """``n`` seeded word problems with 2-3 operations (+, -, *) and exact integer answers."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = (rng.randint(2, max_operand) for _ in range(3))
        kind = rng.randrange(4)
        if kind == 0:
            q = f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {name} have now?"
            ans = a + b - c
        elif kind == 1:
            k = rng.randint(2, 9)
            q = f"{name} buys {k} boxes with {a} {item} each and then finds {b} more. How many {item} does {name} have?"
            ans = k * a + b
        elif kind == 2:
            k = rng.randint(2, 9)
            q = f"{name} has {a} {item}, gets {b} more, and then the pile is copied {k} times in total. How many {item} are there?"
            ans = (a + b) * k
        else:
            q = f"{name} starts with {a + b + c} {item}, loses {b}, then loses {c} more. How many {item} are left?"
            ans = a
        out.append(Problem(q, str(ans), "arithmetic", i))
    return out


def format_question(problem: Problem) -> str:
    """The user message: the question and the answer-format instruction."""
    return (f"{problem.question}\nThink step by step, then give the final answer "
            "on its own last line as '#### <number>'.")


class PromptSource:
    """Batches of problems without repetition within an epoch; reshuffled
    each epoch by a seeded RNG. Resumable through ``state_dict``.

    Raises:
        ValueError: no problems or batch_size < 1.
    """

    def __init__(self, problems: list[Problem], batch_size: int, seed: int):
        if not problems:
            raise ValueError("PromptSource: no problems")
        if batch_size < 1:
            raise ValueError(f"PromptSource: batch_size={batch_size} must be >= 1")
        self.problems, self.batch_size, self.seed = problems, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Problem]:
        out = []
        while len(out) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.problems[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle(self.epoch)
