"""Speculation over multi-turn rollouts with a tool: per drafter, the
acceptance length of first turns against turns after a tool message, the
share of accepted n-gram and suffix drafts copied from a tool output, and
rollout seconds, in paired, order-alternating rounds.

    python -m jobs.bench_agent [--rounds 4] [--prompts 8] [--group-size 4] [--max-tokens 128]
        [--methods none,ngram,suffix,suffix-group,eagle3] [--head runs/tool_use/draft_head] [--out bench_agent.json]

The task is ``examples/tool_use`` (products of 3-digit numbers, a
``multiply`` tool, a worked exchange in each prompt), its held-out rows,
each round on prompts of its own, the bundled policy in float32, one
``AsyncLLM`` engine per drafter in this process (``SpecVLLMEngine`` with
the tool; the engines wait while another one rolls out). ``eagle3`` needs
``--head``, an EAGLE-3 head of the policy (e.g. the ``draft_head`` a
``jobs.grpo`` run of the example trained online); without it the method is
left out. The drafters run in turn, the order reversed every round (this
machine's speed drifts by 25% between runs); samples differ between
drafters (speculation is lossless: the same distribution, not the same
draws), so a round compares draws of the same prompts, and the seconds are
compared as ratios to ``none`` over rounds.

The copy share replays vLLM's n-gram drafter, and its suffix drafter over
a trajectory's own text, over each trajectory
(``rayspec.rollout.agent.drafted_copies``); the replay's drafts and accepted
tokens are printed beside vLLM's own counts, which they equal where the
replay is exact. ``suffix-group`` has no replay (its cache is the engine's
timing); its engine also indexes each tool output for the other
trajectories (``worker_ext.rayspec_index_suffix_text``).

Prints a table, writes JSON (``--out``) and a plot beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_use"
# suffix: the trajectory's own text (prompt, tool outputs, turns); suffix-group: also every response the
# engine keeps (vLLM's window: the sibling trajectories' turns) and their tool outputs, as jobs.bench_rollout
# names them
# (SpeculativeConfig's keys; eagle3 also gets --head as its model)
METHODS = {"none": {"method": None},
           "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
           "suffix": {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0},
           "suffix-group": {"method": "suffix", "num_speculative_tokens": 8},
           "eagle3": {"method": "eagle3", "num_speculative_tokens": 3}}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds (default 4)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per rollout (default 8)")
    ap.add_argument("--group-size", type=int, default=4, help="trajectories per prompt (default 4)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens after the prompt (default 128)")
    ap.add_argument("--max-turns", type=int, default=3, help="model turns per trajectory (default 3)")
    ap.add_argument("--methods", default="none,ngram,suffix,suffix-group,eagle3", help="drafters, comma-separated")
    ap.add_argument("--head", default=None, help="EAGLE-3 head directory (eagle3 is left out without it)")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--out", default="bench_agent.json")
    return ap.parse_args(argv)


def example_rows(n: int) -> list[dict]:
    """``n`` held-out rows of the tool-use example (its ``make_data.rows``)."""
    spec = importlib.util.spec_from_file_location("tool_use_make_data", EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rows(n, seed=1)


def engine(model_dir: Path, method: str, head: str | None, max_turns: int):
    """A ``SpecVLLMEngine`` of ``method`` with the example's tool."""
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, vllm_speculative_config

    spec = vllm_speculative_config(**METHODS[method], **({"model": head} if method == "eagle3" else {}))
    return SpecVLLMEngine(str(model_dir), spec, dtype="float32", engine_cls="async", env=cpu_engine_env(1, "all"),
                          engine_kwargs={"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 64, "seed": 0},
                          agent={"tools": [f"{EXAMPLE / 'tools.py'}:multiply"], "max_turns": max_turns})


def replay(e):
    """The exact replay of engine ``e``'s drafter (``agent.replay_for``), or None."""
    from rayspec.rollout.agent import replay_for

    return replay_for(e.llm.vllm_config.speculative_config, adaptive=False)


def measure(batch, stats, seconds: float, replay) -> dict:
    """One rollout's figures (``agent.turn_counts`` summed; the drafter's replay, ``replay``'s, where not None)."""
    from rayspec.metrics import trajectory_fields
    from rayspec.rollout.agent import drafted_copies

    out = {"seconds": seconds, "tokens": stats.output_tokens, "acceptance_length": stats.acceptance_length,
           "num_drafts": stats.num_drafts, "num_accepted_tokens": stats.num_accepted_tokens,
           "accepted_after_tool": sum(c["accepted_after_tool"] for c in batch.tool_counts),
           **trajectory_fields(batch)}
    if replay is not None:
        counts = [drafted_copies(p, r, m, replay) for p, r, m in zip(batch.prompt_ids, batch.response_ids,
                                                                        batch.loss_mask)]
        out["replay"] = {k: sum(x[k] for x in counts) for k in counts[0]}
    return out


def format_table(rounds: list[dict], methods: list[str]) -> str:
    lines = [f"{'round':>5}  {'method':<13}{'seconds':>9}{'/ none':>8}{'AL':>6}{'AL 1st':>8}{'AL tool':>9}"
             f"{'calls':>7}{'copied from tool':>18}"]
    for r in rounds:
        for m in methods:
            x = r[m]
            ratio = x["seconds"] / r["none"]["seconds"] if "none" in r else float("nan")
            rep = x.get("replay")
            copied = f"{rep['accepted_from_tool']}/{rep['accepted']}" if rep else "-"
            lines.append(f"{r['round']:>5}  {m:<13}{x['seconds']:>9.2f}{ratio:>8.3f}{x['acceptance_length']:>6.2f}"
                         f"{_fmt(x.get('acceptance_length_first_turn')):>8}"
                         f"{_fmt(x.get('acceptance_length_after_tool')):>9}{x.get('tool_calls', 0):>7}{copied:>18}")
    for r in rounds:
        for m in methods:
            rep, x = r[m].get("replay"), r[m]
            if rep:
                lines.append(f"round {r['round']} {m} replay: drafts {rep['drafts']} (vLLM {x['num_drafts']}), "
                             f"accepted {rep['accepted']} (vLLM {x['num_accepted_tokens']}), copied from a tool "
                             f"output {rep['accepted_from_tool']} (of {x['accepted_after_tool']} accepted after a "
                             "tool message)")
    if rounds and "none" in rounds[0]:
        for m in methods:
            if m != "none":
                ratios = [r[m]["seconds"] / r["none"]["seconds"] for r in rounds]
                lines.append(f"{m} / none seconds: median {statistics.median(ratios):.3f}, range "
                             f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(rounds: list[dict], methods: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    drafted = [m for m in methods if m != "none"]
    for i, key in enumerate(("acceptance_length_first_turn", "acceptance_length_after_tool")):
        vals = [statistics.mean([r[m][key] for r in rounds if r[m].get(key) is not None] or [0]) for m in drafted]
        a.bar([x + 0.4 * i for x in range(len(drafted))], vals, 0.4, label=key.split("acceptance_length_")[1])
    a.set_xticks([x + 0.2 for x in range(len(drafted))], drafted)
    a.set(ylabel="acceptance length (mean over rounds)", title="first turns and turns after a tool")
    a.legend()
    for m in methods:
        b.plot([r["round"] for r in rounds], [r[m]["seconds"] for r in rounds], "o-", label=m)
    b.set(xlabel="round", ylabel="rollout seconds", title="one multi-turn rollout")
    b.grid(alpha=0.3)
    b.legend()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from rayspec.models import resolve_model_path

    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"error: --methods {args.methods}: unknown {unknown} (of {sorted(METHODS)})", file=sys.stderr)
        return 2
    if "eagle3" in methods and args.head is None:
        methods.remove("eagle3")
        print("eagle3 left out: no --head", file=sys.stderr)
    model_dir = resolve_model_path(args.model, args.cache_dir)
    rows = example_rows(args.rounds * args.prompts)
    engines = {m: engine(model_dir, m, args.head, args.max_turns) for m in methods}
    replays = {m: replay(e) for m, e in engines.items()}
    rounds: list[dict] = []
    try:
        agent = next(iter(engines.values())).agent
        for e in engines.values():  # warm-up: the first call of an engine pays one-time costs
            e.generate([agent.prompt_ids(rows[0]["prompt"])], n=1, max_tokens=8, rows=rows[:1])
        for r in range(args.rounds):
            part = rows[r * args.prompts:(r + 1) * args.prompts]
            prompts = [agent.prompt_ids(x["prompt"]) for x in part]
            order = methods if r % 2 == 0 else methods[::-1]
            row = {"round": r, "order": order}
            for m in order:
                t0 = time.perf_counter()
                batch, stats = engines[m].generate(prompts, n=args.group_size, temperature=1.0,
                                                   max_tokens=args.max_tokens, rows=part, seed=r)
                row[m] = measure(batch, stats, time.perf_counter() - t0, replays[m])
            rounds.append(row)
            print("\n".join(format_table([row], methods).splitlines()[1:len(methods) + 1]), flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    print(format_table(rounds, methods))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "methods": methods, "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {out} and {plot(rounds, methods, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
