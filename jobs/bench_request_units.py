"""Rollout seconds over two replicas: one shard per replica (``vllm.LLM``)
against prompt groups as request units (vLLM's ``AsyncLLM``).

    python -m jobs.bench_request_units [--rounds 4] [--prompts 8] [--group-size 4]
        [--max-tokens 128] [--method none|ngram|suffix] [--out bench_request_units.json]

Two replicas of each kind run side by side in this process (``LocalReplicas``),
each bound to one core of this machine (the placement plan's split on 2
cores), the bundled policy in float32. Every round rolls out the same GSM8K
prompts (chat template, natural EOS: a batch with a tail) through
``RolloutClient`` both ways: ``shards`` (``rollout.engine_cls=offline``, one
call of ``prompts / 2`` groups per replica) and ``units``
(``rollout.engine_cls=async``, each group one call, all sent at once and
batched continuously by the replica that takes it). The two run in
order-alternating pairs (this machine's speed drifts by 25% between runs),
each round on prompts of its own. Samples differ between the kinds (a unit
reseeds where it finds its engine idle, a shard once), so a round compares
two draws of the same prompts; the ratio's range over rounds is the figure.

Prints a table, writes JSON (``--out``) and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
KINDS = {"shards": "offline", "units": "async"}  # -> rollout.engine_cls
# SpeculativeConfig's keys
METHODS = {"none": {"method": None},
           "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
           "suffix": {"method": "suffix", "num_speculative_tokens": 8}}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_request_units", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds (default 4)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default 8)")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt (default 4: 32 samples)")
    ap.add_argument("--max-tokens", type=int, default=128, help="response cap (tokens; default 128)")
    ap.add_argument("--method", choices=sorted(METHODS), default="none", help="the replicas' drafter")
    ap.add_argument("--first-prompt", type=int, default=2000, help="index of the first GSM8K train prompt")
    ap.add_argument("--data-path", default=str(SHARED_GSM8K), help="GSM8K jsonl directory")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--out", default="bench_request_units.json")
    return ap.parse_args(argv)


def replicas(kind: str, model_dir: Path, method: str, cores: list[int]):
    """Two engines of ``kind``, one per core (``cores``), as ``LocalReplicas``."""
    from rayspec.rollout.client import LocalReplicas
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, vllm_speculative_config

    spec = vllm_speculative_config(**METHODS[method])
    engines = [SpecVLLMEngine(str(model_dir), spec, dtype="float32", engine_cls=KINDS[kind],
                              env=cpu_engine_env(1, str(core)),
                              engine_kwargs={"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 64,
                                             "seed": 0})
               for core in cores]
    return LocalReplicas(engines)


def format_table(rounds: list[dict]) -> str:
    lines = [f"{'round':>5}  {'first':<7}{'shards s':>9}{'units s':>9}{'units / shards':>16}"
             f"{'tokens (shards, units)':>24}{'longest':>9}"]
    for r in rounds:
        lines.append(f"{r['round']:>5}  {r['order'][0]:<7}{r['shards']['seconds']:>9.2f}{r['units']['seconds']:>9.2f}"
                     f"{r['units']['seconds'] / r['shards']['seconds']:>16.3f}"
                     f"{r['shards']['tokens']:>12}{r['units']['tokens']:>12}"
                     f"{max(r['shards']['longest'], r['units']['longest']):>9}")
    ratios = [r["units"]["seconds"] / r["shards"]["seconds"] for r in rounds]
    if ratios:
        lines.append(f"units / shards: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-"
                     f"{max(ratios):.3f} over {len(ratios)} rounds")
    return "\n".join(lines)


def plot(rounds: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for kind, marker in zip(KINDS, "os"):
        ax.plot([r["round"] for r in rounds], [r[kind]["seconds"] for r in rounds], marker + "-", label=kind)
    ax.set(xlabel="round", ylabel="rollout seconds", title="one rollout over 2 replicas")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from rayspec.data import load_gsm8k, prompt_ids
    from rayspec.models import load_tokenizer, resolve_model_path
    from rayspec.rollout.client import RolloutClient

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        print("error: needs 2 cores (one per replica)", file=sys.stderr)
        return 2
    model_dir = resolve_model_path(args.model, args.cache_dir)
    tok = load_tokenizer(model_dir)
    try:
        problems = load_gsm8k(args.data_path, "train")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: --data-path {args.data_path}: {e}", file=sys.stderr)
        return 2
    need = args.first_prompt + args.rounds * args.prompts
    if need > len(problems):
        print(f"error: --first-prompt {args.first_prompt} + {args.rounds} rounds x {args.prompts} prompts needs "
              f"{need} train problems; {args.data_path} has {len(problems)}", file=sys.stderr)
        return 2
    built = {kind: replicas(kind, model_dir, args.method, cores) for kind in KINDS}
    clients = {kind: RolloutClient(r, 2, by_group=kind == "units") for kind, r in built.items()}
    rounds: list[dict] = []
    try:
        for kind, client in clients.items():  # warm-up: the first call of an engine pays one-time costs
            client.generate([prompt_ids(tok, problems[0])], n=2, temperature=1.0, max_tokens=8)
        for r in range(args.rounds):
            first = args.first_prompt + r * args.prompts
            prompts = [prompt_ids(tok, p) for p in problems[first:first + args.prompts]]
            order = list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]
            row = {"round": r, "order": order, "prompts": [first, first + args.prompts]}
            for kind in order:
                t0 = time.perf_counter()
                batch, stats = clients[kind].generate(prompts, n=args.group_size, temperature=1.0,
                                                      max_tokens=args.max_tokens, seed=r)
                row[kind] = {"seconds": time.perf_counter() - t0, "tokens": stats.output_tokens,
                             "longest": max(map(len, batch.response_ids)),
                             "acceptance_length": stats.acceptance_length}
            rounds.append(row)
            print(format_table([row]).splitlines()[1], flush=True)
    finally:
        for r in built.values():
            for e in r.engines:
                e.shutdown()
    print(format_table(rounds))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {out} and {plot(rounds, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
