"""Adaptive k's step costs measured in rollouts, against timed before them.

    python -m jobs.bench_step_costs [--rounds 3] [--batch-sizes 1,4,16,32]
        [--out runs/bench_step_costs.json] [--plot runs/bench_step_costs.png]

Adaptive k chooses k per batch size from t(b, k), the seconds of one engine
decode step at b sequences in flight with k drafts each. Until 2026-12-01
each replica timed synthetic steps when it started (the start-up
calibration, reproduced here as the baseline: b copies of a 32-token
periodic prompt for ``--calibration-tokens`` new tokens minus a 1-token run,
plain, sync, 1-draft and k-draft steps, each the median of
``--calibration-rounds`` timings in alternating order); 7 minutes on a
2-core AVX2 host before step 1. Now each replica folds the decode steps of
its own rollouts in, as vLLM reports them (``rayspec.vllm.step_timer``,
``rayspec.rollout.adaptive.StepTimes``), and nothing is timed before them.

One engine (the policy in ``--dtype``, an untrained EAGLE-3 head, k drafts
sampled from it, T = 1). Each round, in alternating order: one start-up
calibration, and two GRPO-shaped rollouts (``--prompts`` arithmetic prompts
x ``--group-size`` samples, up to ``--max-tokens`` tokens, stopping at EOS),
one plain and one drafting k at every batch size, each folded into a fresh
``StepTimes``. Per kind (plain, k drafts) and batch size: each method's
estimate in each round and its spread over the rounds (max / min - 1), the
online estimate over all rounds' rollouts (what a replica's window holds
after them), and the seconds each method spent. Prints a table, writes
JSON (``--out``) and a plot (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from rayspec.tools.bench import ints, untrained_head, work_dir_for


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_step_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both methods (default 3)")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 4, 16, 32],
                    help="where the estimates are compared (default 1,4,16,32; the calibration times these)")
    ap.add_argument("--calibration-tokens", type=int, default=16)
    ap.add_argument("--calibration-rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="arithmetic prompts per rollout (default 4)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--max-tokens", type=int, default=96,
                    help="response cap (default 96: most responses of the initial policy end before it, so the "
                         "rollouts have a tail)")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--work-dir", default="/tmp/rayspec-bench-rollout", help="where the untrained head is made")
    ap.add_argument("--out", default="runs/bench_step_costs.json")
    ap.add_argument("--plot", default="runs/bench_step_costs.png")
    args = ap.parse_args(argv)
    if args.k < 1 or args.rounds < 1 or args.calibration_rounds < 1 or args.calibration_tokens < 2:
        ap.error("--k, --rounds and --calibration-rounds must be >= 1, --calibration-tokens >= 2")
    return args


def calibrate(engine, k: int, batch_sizes: list[int], tokens: int, rounds: int) -> dict[str, dict[int, float]]:
    """The start-up calibration rayspec ran until 2026-12-01: seconds of a
    plain, a sync, a 1-draft and a k-draft step at each batch size, each the
    median of ``rounds`` timings (configurations in reverse order every
    other round) of (a ``tokens``-token run - a 1-token run) / the steps,
    from an empty prefix cache, at T = 1 with logprobs. Returns
    {kind: {b: seconds}} with kinds ``plain``, ``sync``, ``1``, ``k``."""
    from vllm import SamplingParams, TokensPrompt

    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.spec_stats import completion_stats

    prompt = TokensPrompt(prompt_token_ids=list(range(100, 108)) * 4)
    runs = [("plain", 0, None), ("sync", 0, False), ("1", 1, None), (str(k), k, None)]
    seqs = engine.max_num_seqs

    def run(b: int, n: int) -> tuple[float, int]:
        params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0)
        engine.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.llm.generate([prompt] * b, params)
        return time.perf_counter() - t0, completion_stats(outs).num_accepted_tokens

    timed: dict[tuple[str, int], list[float]] = {}
    for _, kk, idle in runs:  # one untimed run per configuration
        engine.set_k_schedule(uniform(kk, seqs), drafter_idle=idle)
        run(batch_sizes[0], tokens)
    for r in range(rounds):
        for b in batch_sizes:
            for kind, kk, idle in (runs if r % 2 == 0 else runs[::-1]):
                engine.set_k_schedule(uniform(kk, seqs), drafter_idle=idle)
                prefill, _ = run(b, 1)
                wall, accepted = run(b, tokens)
                timed.setdefault((kind, b), []).append(max(wall - prefill, 1e-6) / max(tokens - 1 - accepted / b, 1))
    return {kind: {b: statistics.median(timed[kind, b]) for b in batch_sizes} for kind, _, _ in runs}


def rollout_costs(engine, k: int, prompts: list[list[int]], args, pooled) -> dict[str, dict[int, float]]:
    """One plain and one k-draft rollout, each folded into a fresh
    ``StepTimes`` as a replica folds its rollouts (and into ``pooled``);
    returns {kind: {b: seconds}} at the ``args.batch_sizes`` whose bucket
    the rollout ran steps in."""
    from rayspec.rollout.adaptive import StepTimes, uniform

    out = {}
    for kind, kk in (("plain", 0), (str(k), k)):
        engine.step_times = StepTimes(k)
        engine.set_k_schedule(uniform(kk, engine.max_num_seqs))
        engine.generate(prompts, n=args.group_size, temperature=1.0, max_tokens=args.max_tokens)
        steps = engine.step_times.steps()
        for step in steps:
            pooled.add(*step)
        cost = engine.step_times.cost()
        buckets = {b.bit_length() for kd, b, _ in steps if kd == kind}
        out[kind] = {b: cost.seconds(b, kk) for b in args.batch_sizes if b.bit_length() in buckets}
    return out


def spread(values: list[float]) -> float:
    """max / min - 1 of a list of positive numbers (0 for fewer than two)."""
    return max(values) / min(values) - 1.0 if len(values) > 1 else 0.0


def summarize(rounds: list[dict], pooled, args) -> list[dict]:
    """Per kind and batch size: each method's estimate per round (ms), its
    spread, and the online estimate over every rollout (``pooled``)."""
    cost = pooled.cost()
    rows = []
    for kind, kk in (("plain", 0), (str(args.k), args.k)):
        for b in args.batch_sizes:
            cal = [1e3 * r["calibration"][kind][b] for r in rounds]
            onl = [1e3 * r["online"][kind][b] for r in rounds if b in r["online"][kind]]
            rows.append({"kind": kind, "b": b, "calibration_ms": cal, "online_ms": onl,
                         "calibration_spread": spread(cal), "online_spread": spread(onl),
                         "online_pooled_ms": 1e3 * cost.seconds(b, kk) if cost.known(kk) else None})
    return rows


def format_table(rows: list[dict], rounds: list[dict]) -> str:
    lines = ["kind   b | start-up calibration, ms per round   spread | online (rollouts), ms per round   "
             "spread  pooled"]
    for r in rows:
        cal = " ".join(f"{x:6.1f}" for x in r["calibration_ms"])
        onl = " ".join(f"{x:6.1f}" for x in r["online_ms"]) or "-"
        pooled = f"{r['online_pooled_ms']:7.1f}" if r["online_pooled_ms"] is not None else "      -"
        lines.append(f"{r['kind']:<5} {r['b']:>3} | {cal:<35} {r['calibration_spread']:6.1%} | {onl:<32} "
                     f"{r['online_spread']:6.1%} {pooled}")
    cal_s = [x["calibration_s"] for x in rounds]
    onl_s = [x["rollouts_s"] for x in rounds]
    lines.append(f"seconds per round: start-up calibration {min(cal_s):.0f}-{max(cal_s):.0f} (before the first "
                 f"rollout); the two rollouts {min(onl_s):.0f}-{max(onl_s):.0f} (the timing itself: none extra)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows}, key=lambda k: (k != "plain", k))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), constrained_layout=True)
    for ax, kind in zip(axes, kinds):
        mine = [r for r in rows if r["kind"] == kind]
        for i, r in enumerate(mine):
            ax.plot([r["b"] * 0.93] * len(r["calibration_ms"]), r["calibration_ms"], "o", color="C0",
                    label="start-up calibration, per round" if i == 0 else None)
            ax.plot([r["b"] * 1.07] * len(r["online_ms"]), r["online_ms"], "^", color="C1",
                    label="online (one rollout), per round" if i == 0 else None)
        pooled = [(r["b"], r["online_pooled_ms"]) for r in mine if r["online_pooled_ms"] is not None]
        if pooled:
            ax.plot(*zip(*pooled), "-", color="C1", label="online, all rounds' rollouts")
        ax.set(xscale="log", xlabel="sequences in flight", ylabel="ms per decode step",
               title="plain step" if kind == "plain" else f"{kind}-draft step")
        ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from tqdm import tqdm

    from rayspec.data import arithmetic_problems, prompt_ids
    from rayspec.models import load_tokenizer, resolve_model_path
    from rayspec.rollout.adaptive import StepTimes
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, vllm_speculative_config

    model_dir = resolve_model_path(args.model, args.cache_dir)
    head = untrained_head(model_dir, work_dir_for(args.work_dir, model_dir))
    tok = load_tokenizer(model_dir)
    # the default preset's task: one + or - of numbers up to 10
    prompts = [prompt_ids(tok, p) for p in arithmetic_problems(args.prompts, seed=1, max_operand=10, level=1)]
    seqs = max(args.batch_sizes + [args.prompts * args.group_size])
    spec = vllm_speculative_config(method="eagle3", model=str(head), num_speculative_tokens=args.k,
                                   draft_sample_method="probabilistic")
    engine = SpecVLLMEngine(str(model_dir), spec,
                            dtype=args.dtype, env=cpu_engine_env(args.kv_cache_gib, "all"),
                            engine_kwargs={"enforce_eager": True, "max_num_seqs": seqs, "seed": 0,
                                           "max_model_len": 512},
                            adaptive_k={"temperature": 1.0})
    pooled, rounds = StepTimes(args.k), []
    try:
        engine.generate(prompts[:1], n=2, temperature=1.0, max_tokens=8)  # first call's allocations: untimed
        for r in tqdm(range(args.rounds), desc="rounds", disable=None):
            out = {}
            for method in (("calibration", "online") if r % 2 == 0 else ("online", "calibration")):
                t0 = time.perf_counter()
                if method == "calibration":
                    out["calibration"] = calibrate(engine, args.k, args.batch_sizes, args.calibration_tokens,
                                                   args.calibration_rounds)
                    out["calibration_s"] = time.perf_counter() - t0
                else:
                    out["online"] = rollout_costs(engine, args.k, prompts, args, pooled)
                    out["rollouts_s"] = time.perf_counter() - t0
            rounds.append(out)
    finally:
        engine.shutdown()
    rows = summarize(rounds, pooled, args)
    print(format_table(rows, rounds))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows,
                                          "rounds": rounds}, indent=1, default=str))
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
