"""Writes the tool-use example's dataset: train.jsonl and test.jsonl,
products of a 3-digit and a 2- to 3-digit number (beyond a 135M model
alone), with an ``answer`` column. Each prompt opens with one worked
exchange (a call, the tool's result, the answer copied from it): a 135M
model shown only the tool's schema never calls it (0 calls in 32 samples
at T = 1, measured here).

    python examples/tool_use/make_data.py [out_dir]   # default: examples/tool_use/data
"""

import json
import random
import sys
from pathlib import Path


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}? Use the multiply tool, then reply with only the number."


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x, y, a, b = (rng.randint(100, 999), rng.randint(12, 999), rng.randint(100, 999), rng.randint(12, 999))
        call = json.dumps({"name": "multiply", "arguments": {"a": x, "b": y}})
        shown = [{"role": "user", "content": question(x, y)},
                 {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                 {"role": "tool", "name": "multiply", "content": str(x * y)},
                 {"role": "assistant", "content": str(x * y)}]
        out.append({"prompt": shown + [{"role": "user", "content": question(a, b)}], "answer": str(a * b)})
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data")
    out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", 400, 0), ("test", 32, 1)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
    print(f"wrote {out}/train.jsonl and {out}/test.jsonl")
