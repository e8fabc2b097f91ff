"""Greedy continuations with and without speculation, compared token by token.

    python -m jobs.check_greedy [--model bundled:smollm2-135m-instruct]
        [--data-path ../shared/data/gsm8k] [--prompts 32] [--max-tokens 128]
        [--methods eagle3,draft_model,ngram] [--eagle3 DIR] [--draft-layers 15]
        [--k 3] [--out greedy.json]

In exact arithmetic, greedy speculative decoding emits the target's argmax at
every position, so its continuations equal plain greedy decoding's. In
floating point the verifier scores k + 1 positions per step instead of one.
The matmul shapes differ, so logits can differ in the last bits, and a
near-tie can flip the argmax and everything after it. This job measures how
often that happens, in float32, on GSM8K prompts (the last ``--prompts``
problems of train.jsonl, chat template). It
reports, for every method, how many continuations are identical to plain
greedy decoding of the same batch, and where the first differing token of
each other one is. The ``none (batch 1)`` row decodes the prompts one at a
time without speculation: it shows what a change of batch shape alone does.

Prints a table and writes JSON (``--out``): a list of rows with ``method``,
``identical``, ``prompts``, ``identical_rate``, ``first_diff`` (position of
the first differing token per differing prompt, in tokens) and
``acceptance_length``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from jobs.check_lossless import engine_in_process

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
METHODS = ("eagle3", "draft_model", "ngram")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.check_greedy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct", help="policy HF dir or bundled model")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--data-path", default=str(SHARED_GSM8K), help="GSM8K jsonl directory or file")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    ap.add_argument("--eagle3", default=None, help="EAGLE-3 head directory (default: a fresh head)")
    ap.add_argument("--draft-layers", type=int, default=15, help="layers of the truncated draft model")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--work-dir", default=None, help="where drafts go (default: beside --out)")
    ap.add_argument("--out", default="greedy.json")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; expected some of {', '.join(METHODS)}")
    if args.prompts < 1 or args.max_tokens < 1 or args.k < 1:
        ap.error("--prompts, --max-tokens and --k must be >= 1")
    args.work_dir = Path(args.work_dir or Path(args.out).resolve().parent / "greedy_drafts")
    return args


def compare(reference: list[list[int]], other: list[list[int]]) -> tuple[int, list[int]]:
    """(identical continuations, first differing position of each other one).

    A continuation that is a strict prefix of the other differs at its end.
    """
    identical, first = 0, []
    for a, b in zip(reference, other):
        if a == b:
            identical += 1
            continue
        first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return identical, first


def speculative_config(method: str, model_dir: Path, args) -> dict:
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy, truncated_copy
    from rayspec.rollout.engine import vllm_speculative_config

    if method == "eagle3":
        head = args.eagle3
        if head is None:
            head = args.work_dir / "eagle3_head"
            if not (head / "config.json").is_file():
                save_head(init_head(load_policy(model_dir)), head)
        return vllm_speculative_config(method="eagle3", num_speculative_tokens=args.k, model=str(head))
    if method == "draft_model":
        draft = truncated_copy(model_dir, args.work_dir / f"draft_{args.draft_layers}l", args.draft_layers)
        return vllm_speculative_config(method="draft_model", num_speculative_tokens=args.k, model=str(draft))
    return vllm_speculative_config(method="ngram", num_speculative_tokens=args.k, prompt_lookup_max=4,
                                   prompt_lookup_min=2)


def format_table(rows: list[dict]) -> str:
    head = f"{'method':<16}{'identical':>10}{'rate':>7}{'acc len':>9}  first differing token (position)"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<16}{r['identical']:>5}/{r['prompts']:<4}{r['identical_rate']:>7.2f}"
                     f"{r['acceptance_length']:>9.2f}  {sorted(r['first_diff']) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from rayspec.config import ConfigError
    from rayspec.data import prompt_ids, load_gsm8k
    from rayspec.models import load_tokenizer, resolve_model_path

    try:
        model_dir = resolve_model_path(args.model, args.cache_dir)
        problems = load_gsm8k(args.data_path, "train")[-args.prompts:]
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(model_dir)
    prompts = [prompt_ids(tok, p) for p in problems]
    engine_kwargs = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": len(prompts), "seed": 0}
    greedy = {"n": 1, "temperature": 0.0, "max_tokens": args.max_tokens}

    def decode(spec, one_at_a_time=False):
        engine = engine_in_process(model_dir, spec, engine_kwargs)
        try:
            if one_at_a_time:
                return [engine.generate([p], **greedy)[0].response_ids[0] for p in prompts], 1.0
            batch, stats = engine.generate(prompts, **greedy)
            return batch.response_ids, stats.acceptance_length
        finally:
            engine.shutdown()

    reference, _ = decode(None)
    rows = []
    runs = [("none (batch 1)", None, True)] + [(m, speculative_config(m, model_dir, args), False)
                                                for m in args.methods]
    for name, spec, single in runs:
        out, acc = decode(spec, single)
        same, first = compare(reference, out)
        rows.append({"method": name, "k": spec["num_speculative_tokens"] if spec else 0,
                     "identical": same, "prompts": len(prompts), "identical_rate": same / len(prompts),
                     "first_diff": first, "acceptance_length": acc, "max_tokens": args.max_tokens,
                     "dtype": "float32"})
        print(f"{name}: {same}/{len(prompts)} identical", file=sys.stderr, flush=True)
    print(format_table(rows))
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
