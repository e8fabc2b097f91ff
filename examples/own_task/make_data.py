"""Writes the README's "Your own task" dataset: train.jsonl and test.jsonl,
conversational prompts asking for a boxed answer, with an ``answer`` column.

    python examples/own_task/make_data.py [out_dir]   # default: examples/own_task/data
"""

import json
import random
import sys
from pathlib import Path


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        op, value = rng.choice([("+", a + b), ("*", a * b)])
        out.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Answer with \\boxed{{...}}."}],
                    "answer": str(value), "op": op})
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data")
    out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", 400, 0), ("test", 32, 1)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
    print(f"wrote {out}/train.jsonl and {out}/test.jsonl")
