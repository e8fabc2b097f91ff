"""The README's "Your own task" reward functions, in TRL's form:
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``.
Completions of conversational prompts are ``[{"role": "assistant", "content": ...}]``."""

import re

BOXED = re.compile(r"\\boxed\{[^{}]*\}")


def boxed_once(completions, **kwargs):
    """1.0 where the answer is boxed exactly once (the format the prompt asks for)."""
    return [1.0 if len(BOXED.findall(c[-1]["content"])) == 1 else 0.0 for c in completions]


def products_only(completions, answer, op, **kwargs):
    """A column as an argument: the exact answer, scored on products only
    (None, "does not apply", on sums: left out of this function's mean)."""
    return [None if o != "*" else float(a in c[-1]["content"]) for c, a, o in zip(completions, answer, op)]
