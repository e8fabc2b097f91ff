"""Rollout benchmark: speculative methods side by side on the same prompts.

    python -m jobs.bench_rollout [--quick] [--out bench_rollout.json]
        [--data-path ../shared/data/gsm8k] [--first-prompt 1000] [--eagle3 NAME=DIR ...]
        [--draft-layers 6] [--k 1,2,3,4,5] [--concurrency 1,8,32,128]
        [--temperature 1.0,0] [--max-tokens 64] [--dtype float32] [--repeats 1]
        [--fixed-group-size 1] [--fresh-prompts] [--no-untrained-head]
        [--draft-linear-dtype auto[,float32,bfloat16]]

One engine per method (no speculation, eagle3, eagle3-sampled, draft_model,
ngram, suffix, suffix-group),
built once per round with the largest k and a batch-size schedule, so k is
switched at run time (``rayspec.rollout.adaptive``) instead of rebuilding;
EAGLE-3 heads are swapped into the same engine through the refit path. Every cell runs the
same GSM8K prompts (chat template) at a fixed concurrency: ``concurrency``
sequences start together and each generates ``--max-tokens`` tokens
(ignore_eos, so the concurrency holds for the whole cell), one prompt per
sequence or, with ``--fixed-group-size G``, G samples of each prompt as a
GRPO group (4 prompts x 8 at 32 sequences, 4 samples of one prompt at 4);
speculative
engines also run k = 0, which shows what the engine costs when it drafts
nothing (k = 0 at every batch size idles the drafter:
``rayspec.rollout.adaptive``). ``rollout`` cells
then run one GRPO-shaped rollout (``--rollout-prompts`` x
``--group-size`` samples, natural EOS, so the batch drains into a long
tail) for no speculation, the best fixed k and the adaptive controller.
Sequence i of every cell samples with seed i: where a speculative engine
samples as the plain one does (k = 0 at every batch size), it draws the very
same responses (``responses_sha1``), so its rollout runs the same tail and
differs from the plain one only in what the engine costs.

``eagle3-sampled`` runs the same heads with ``draft_sample_method:
probabilistic`` (vLLM's key): each draft is sampled from the head's
distribution q and accepted with probability min(1, p/q), so a position is
accepted with probability sum_v min(p, q), where greedy drafts are accepted
with p(argmax q), at most E[max_v p(v)].

Suffix decoding (vLLM's ``suffix`` method, Arctic Inference's suffix tree)
runs twice: ``suffix`` drafts from the sequence's own prompt and response
(``suffix_decoding_max_cached_requests=0``), ``suffix-group`` also from every
response the engine keeps (vLLM's default window): the group's other samples
written beside it and every earlier cell's. Since that window would also hold
earlier cells' responses to the same prompts, ``--fresh-prompts`` gives
every fixed cell of every round prompts of its own (the plain cell at a
concurrency and each engine's k = 0 cell there share theirs, so their seeded
responses still match), and a ``suffix-group`` cell drafts from its own group
and from other problems' responses only, as a first epoch of RL would; what
earlier epochs add is ``jobs.bench_rl``'s to show.

Per cell: output tokens/s, acceptance length, acceptance rate per position,
speedup against no speculation in the same run, and the physical limit
(1 + f (E - 1)) / (1 + k c), with E = (1 - a^(k+1)) / (1 - a) from the
measured per-token acceptance rate a (``geometric_rate`` of the per-position
rates), f the fraction of sequence-steps that carried a draft
(``draft_fraction``: 1 for a model drafter, the share with a match for
n-gram and suffix; column f) and c the
measured cost of one draft token in plain steps: c = (t_k / t_0 - 1) / k, t_k
the cell's seconds per verification step (wall / (drafts / concurrency)) and
t_0 the no-speculation cell's seconds per step (wall / tokens per sequence)
at the same concurrency and temperature. c therefore counts drafting *and*
verifying the extra token, which on a CPU is most of it. ``draft_length``
(column d len): draft tokens per draft, k for a model drafter, up to k for
n-gram and suffix, whose drafts end where their match does (c is then per
draft slot, not per token verified).

``--repeats N`` runs the whole grid N times in rounds, engines rebuilt each
round and their order reversed every other round (A B C, C B A, ...), so a
slow drift of the machine lands on every method alike. Each cell's speedup is
then the median over rounds of its tokens/s over the same round's
no-speculation cell (a paired ratio: what drifts between rounds cancels), with
the smallest and largest of those ratios beside it; tokens/s, seconds per
step, c and the limit are medians. The plain cells' own spread over rounds is
printed as the noise a speedup has to clear.

Prints a table, writes JSON (``--out``: a list of cells) and a plot of speedup
against concurrency per method (``--plot``, default beside ``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from rayspec.rollout.adaptive import format_schedule, geometric_rate, physical_limit, uniform
from rayspec.tools.bench import (Cell, bench_speculative_config, draft_linear_dtypes, floats, ints, measure_cell,
                                 untrained_head, work_dir_for)

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
METHODS = ("none", "eagle3", "eagle3-sampled", "draft_model", "ngram", "suffix", "suffix-group")
FULL = {"k": [1, 2, 3, 4, 5], "concurrency": [1, 8, 32, 128], "temperature": [1.0, 0.0],
        "max_tokens": 64, "methods": list(METHODS), "rollout_prompts": 8, "group_size": 8,
        "rollout_max_tokens": 256}
QUICK = {"k": [1, 3], "concurrency": [1, 8, 32], "temperature": [1.0], "max_tokens": 32,
         "methods": ["none", "eagle3", "ngram"], "rollout_prompts": 4, "group_size": 4,
         "rollout_max_tokens": 128}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="reduced grid for what is not given (k 1,3; concurrency 1,8,32; "
                         "T=1.0; 32 tokens; none/eagle3/ngram; rollout 4x4, 128 tokens)")
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--dtype", default="float32", help="serving dtype (bf16 is emulated on AVX2 CPUs)")
    ap.add_argument("--data-path", default=str(SHARED_GSM8K), help="GSM8K jsonl directory")
    ap.add_argument("--first-prompt", type=int, default=1000,
                    help="index of the first GSM8K train problem used (the shared copy has no test "
                         "split; jobs.warmstart_draft trains on the first ones, and a head whose "
                         "acceptance.json records those as train_prompts is refused on them)")
    ap.add_argument("--methods", help=f"default {','.join(METHODS)}")
    ap.add_argument("--eagle3", action="append", default=[], metavar="NAME=DIR",
                    help="an EAGLE-3 head to bench (e.g. warm=runs/warm/draft_head); "
                         "an untrained head is always benched as 'untrained'")
    ap.add_argument("--draft-layers", type=int, default=6,
                    help="draft_model: the policy's first N layers (layer-truncated copy)")
    ap.add_argument("--draft-linear-dtype", default="auto",
                    help="vLLM additional_config.rayspec_draft_linear_dtype of the EAGLE-3 engines "
                         "(rayspec.vllm.cpu_fixes.draft_linear_dtype; the presets' CPU default is auto); "
                         "several, comma-separated: one engine each, its drafts named head@dtype")
    ap.add_argument("--k", type=ints, help="default 1,2,3,4,5")
    ap.add_argument("--concurrency", type=ints, help="sequences in flight; default 1,8,32,128")
    ap.add_argument("--temperature", type=floats, help="default 1.0,0 (0: greedy)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per sequence in fixed cells; default 64")
    ap.add_argument("--fixed-group-size", type=int, default=1,
                    help="samples of each prompt in the fixed cells (a GRPO group; 1: a prompt per sequence)")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="every fixed cell of every round its own prompts (no suffix-group cell drafts "
                         "from an earlier cell's responses to the same problem)")
    ap.add_argument("--untrained-head", action=argparse.BooleanOptionalAction, default=True,
                    help="bench an untrained EAGLE-3 head beside the --eagle3 ones (default on)")
    ap.add_argument("--rollout-prompts", type=int, help="prompts of the rollout cells (0: no rollout cells); default 8")
    ap.add_argument("--group-size", type=int, help="samples per prompt in the rollout cells; default 8")
    ap.add_argument("--rollout-max-tokens", type=int, help="response cap of the rollout cells; default 256")
    ap.add_argument("--adaptive-margin", type=float, default=1.05)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over the whole grid, method order reversed every other round; "
                         "speedups are medians of per-round paired ratios")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--out", default="bench_rollout.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--work-dir", default="/tmp/rayspec-bench-rollout",
                    help="untrained head and truncated draft model go here (one folder per policy)")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if isinstance(args.methods, str):
        args.methods = [m for m in args.methods.split(",") if m]
    args.draft_linear_dtype = draft_linear_dtypes(ap, args.draft_linear_dtype)
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}, expected some of {METHODS}")
    for key in ("repeats", "fixed_group_size"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}: {getattr(args, key)}, expected >= 1")
    if args.rollout_prompts < 0:
        ap.error(f"--rollout-prompts: {args.rollout_prompts}, expected >= 0")
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    return args


def _record(method: str, draft: str, k: int, conc, temperature: float, cell: Cell, shape: str,
            **extra) -> dict:
    stats, step_s, tps, digest, lens = cell
    rates = stats.acceptance_rate_per_pos[:k] if k else []
    if shape == "rollout":  # how the batch drained (rayspec.perfmodel replays it)
        extra["response_lens"] = lens
    # each sequence-step emits one token plus its accepted drafts
    seq_steps = max(stats.output_tokens - stats.num_accepted_tokens, 1)
    return {"method": method, "draft": draft, "k": k, "concurrency": conc, "temperature": temperature,
            "shape": shape, "tokens_per_s": tps, "output_tokens": stats.output_tokens, "responses_sha1": digest,
            "wall_s": stats.wall_s, "seconds_per_step": step_s,
            "acceptance_length": stats.acceptance_length, "acceptance_rate_per_pos": rates,
            "draft_fraction": stats.num_drafts / seq_steps if k else None,
            "draft_length": stats.num_draft_tokens / stats.num_drafts if k and stats.num_drafts else None,
            **extra}


def _finish(cells: list[dict]) -> None:
    """Speedup against the no-speculation cell of the same shape, concurrency
    and temperature; cost ratio c and the physical limit where k > 0."""
    base = {(c["shape"], c["concurrency"], c["temperature"]): c for c in cells if c["method"] == "none"}
    for c in cells:
        b = base.get((c["shape"], c["concurrency"], c["temperature"]))
        c["speedup"] = c["tokens_per_s"] / b["tokens_per_s"] if b else None
        c["cost_ratio"] = c["physical_limit"] = c["acceptance_rate"] = None
        if c["k"] and b and c["shape"] == "fixed":
            a = geometric_rate(c["acceptance_rate_per_pos"])
            cr = (c["seconds_per_step"] / b["seconds_per_step"] - 1.0) / c["k"]
            c.update(acceptance_rate=a, cost_ratio=cr,
                     physical_limit=physical_limit(a, c["k"], cr, c["draft_fraction"]))


MEDIAN_KEYS = ("tokens_per_s", "speedup", "wall_s", "seconds_per_step", "acceptance_length",
               "acceptance_rate", "cost_ratio", "physical_limit", "draft_fraction", "draft_length")


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One cell per (method, draft, shape, k, concurrency, temperature) from
    ``rounds`` (each a list of cells already through ``_finish``).

    ``MEDIAN_KEYS`` and the per-position acceptance rates become medians over
    rounds; ``speedup`` is thus the median of paired per-round ratios.
    Added: ``repeats`` (rounds), ``tokens_per_s_runs`` and ``speedup_runs``
    (per round), ``speedup_min`` / ``speedup_max``; ``k_schedule_runs``
    where the adaptive controller chose differently between rounds and
    ``responses_sha1_runs`` where the seeded responses differed. Other
    fields (response lengths) come from the first round.

    Raises:
        ValueError: a cell is missing from some round (the rounds ran
            different grids).
    """
    key = lambda c: (c["method"], c["draft"], c["shape"], c["k"], c["concurrency"], c["temperature"])  # noqa: E731
    groups: dict[tuple, list[dict]] = {}
    for cells in rounds:
        for c in cells:
            groups.setdefault(key(c), []).append(c)
    out = []
    for k, runs in groups.items():
        if len(runs) != len(rounds):
            raise ValueError(f"cell {k} ran in {len(runs)} of {len(rounds)} rounds")
        cell = dict(runs[0], repeats=len(runs), tokens_per_s_runs=[r["tokens_per_s"] for r in runs])
        for name in MEDIAN_KEYS:
            values = [r[name] for r in runs if r.get(name) is not None]
            cell[name] = statistics.median(values) if values else None
        cell["acceptance_rate_per_pos"] = [statistics.median(p) for p in
                                           zip(*(r["acceptance_rate_per_pos"] for r in runs))]
        speedups = [r["speedup"] for r in runs if r["speedup"] is not None]
        cell.update(speedup_runs=speedups, speedup_min=min(speedups, default=None),
                    speedup_max=max(speedups, default=None))
        for name in ("k_schedule", "responses_sha1"):
            values = [r.get(name) for r in runs]
            if len(set(values)) > 1:
                cell[f"{name}_runs"] = values
        out.append(cell)
    return out


def plain_noise(cells: list[dict]) -> float | None:
    """Largest relative spread of a no-speculation cell's tokens/s over
    rounds, (max - min) / median; None with one round."""
    spreads = [(max(c["tokens_per_s_runs"]) - min(c["tokens_per_s_runs"])) / c["tokens_per_s"]
               for c in cells if c["method"] == "none" and len(c.get("tokens_per_s_runs", [])) > 1]
    return max(spreads, default=None)


def _range(c: dict) -> str:
    """Smallest-largest paired speedup over rounds; '-' for one round."""
    if c.get("repeats", 1) < 2 or c.get("speedup_min") is None:
        return "-"
    return f"{c['speedup_min']:.2f}-{c['speedup_max']:.2f}"


def format_table(cells: list[dict]) -> str:
    head = (f"{'method':<10}{'draft':<12}{'shape':<8}{'T':>4}{'conc':>6}{'k':>3}{'tok/s':>8}{'speedup':>8}"
            f"{'range':>11}{'acc len':>8}{'a':>6}{'f':>6}{'d len':>6}{'c':>6}{'limit':>7}  accept/pos | k schedule")
    rows = [head, "-" * len(head)]
    # a missing figure keeps the column's width: ">6.2f" -> "-" formatted ">6"
    f = lambda v, spec: format(v, spec) if v is not None else format("-", spec[:-3])  # noqa: E731
    for c in cells:
        rates = ",".join(f"{r:.2f}" for r in c["acceptance_rate_per_pos"])
        rows.append(f"{c['method']:<10}{c['draft']:<12}{c['shape']:<8}{c['temperature']:>4.1f}"
                    f"{c['concurrency']:>6}{c['k']:>3}{c['tokens_per_s']:>8.1f}{f(c['speedup'], '>8.2f')}"
                    f"{_range(c):>11}"
                    f"{c['acceptance_length']:>8.2f}{f(c['acceptance_rate'], '>6.2f')}"
                    f"{f(c.get('draft_fraction'), '>6.2f')}{f(c.get('draft_length'), '>6.2f')}"
                    f"{f(c['cost_ratio'], '>6.2f')}{f(c['physical_limit'], '>7.2f')}  [{rates}]"
                    + (f" | {c['k_schedule']}" if c.get("k_schedule") else ""))
    return "\n".join(rows)


def plot(cells: list[dict], path: str) -> None:
    """Speedup vs concurrency per method (best k per cell), one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({c["temperature"] for c in cells}, reverse=True)
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        fixed = [c for c in cells if c["shape"] == "fixed" and c["temperature"] == t and c["speedup"]]
        for label in sorted({(c["method"], c["draft"]) for c in fixed}):
            best: dict[int, dict] = {}
            for c in fixed:
                b = best.get(c["concurrency"])
                if (c["method"], c["draft"]) == label and (b is None or c["speedup"] > b["speedup"]):
                    best[c["concurrency"]] = c
            xs = sorted(best)
            ys = [best[x]["speedup"] for x in xs]
            # bars: smallest to largest paired speedup over rounds (none with one round)
            err = [[y - best[x].get("speedup_min", y) for x, y in zip(xs, ys)],
                   [best[x].get("speedup_max", y) - y for x, y in zip(xs, ys)]]
            name = label[0] if label[0] == label[1] or not label[1] else f"{label[0]} ({label[1]})"
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3,
                        label=name + ("" if label[0] == "none" else ", best k"))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequences in flight", ylabel="speedup vs no speculation", title=f"temperature {t}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def engine_units(methods: list[str], heads: dict[str, Path], draft_model, draft_layers: int) -> list:
    """[(method, [(draft name, draft dir), ...]), ...]: one engine each, in
    ``methods`` order. EAGLE-3 heads share an engine (swapped in by refit)
    when their draft vocabularies have the same size: vLLM sizes the
    drafter's output layer and d2t map from the first head's config."""
    units = []
    for method in methods:
        if method in ("eagle3", "eagle3-sampled"):
            by_vocab: dict[int, list] = {}
            for name, d in heads.items():
                cfg = json.loads((Path(d) / "config.json").read_text())
                by_vocab.setdefault(cfg.get("draft_vocab_size") or cfg["vocab_size"], []).append((name, d))
            units.extend((method, group) for group in by_vocab.values())
        elif method == "draft_model":
            units.append((method, [(f"layers{draft_layers}", draft_model())]))
        else:
            units.append((method, [("", None)]))
    return units


def with_draft_linear_dtypes(units: list, dtypes: list[str]) -> list:
    """[(method, drafts, additional_config), ...]: each EAGLE-3 unit once per
    drafter linear dtype (its drafts renamed ``name@dtype`` where there are
    several), other methods once with an empty additional_config."""
    from rayspec.config import DRAFT_LINEAR_DTYPE

    out = []
    for method, drafts in units:
        if not method.startswith("eagle3"):
            out.append((method, drafts, {}))
            continue
        for d in dtypes:
            named = drafts if len(dtypes) == 1 else [(f"{name}@{d}", path) for name, path in drafts]
            out.append((method, named, {DRAFT_LINEAR_DTYPE: d}))
    return out


def fixed_cell_prompts(pool_size: int, grid: list[tuple], repeats: int, group_size: int,
                       fresh: bool) -> dict:
    """Which prompts each fixed cell runs: {(round, temperature, concurrency,
    k): [index into the prompt pool, one per sequence]}, ceil(c / group_size)
    prompts each taken ``group_size`` times in a row (a GRPO group). Without
    ``fresh`` every cell starts at prompt 0; with it each (round, grid cell)
    has prompts of its own, so no cell sees another's problems.

    Raises:
        ValueError: the pool of ``pool_size`` prompts is too short (the
            message says how many are needed).
    """
    groups = lambda c: -(-c // group_size)  # noqa: E731
    need = (repeats * sum(groups(c) for _, c, _ in grid) if fresh
            else max((groups(c) for _, c, _ in grid), default=0))
    if need > pool_size:
        raise ValueError(f"{need} prompts needed for the fixed cells, {pool_size} available")
    out, start = {}, 0
    for r in range(repeats):
        for t, c, k in grid:
            out[r, t, c, k] = [i for i in range(start, start + groups(c)) for _ in range(group_size)][:c]
            start += groups(c) if fresh else 0
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from rayspec.data import prompt_ids, load_gsm8k
    from rayspec.draft.eagle3 import load_head, vllm_state_dict
    from rayspec.draft.warmstart import trained_prompt_overlap
    from rayspec.models import load_tokenizer, resolve_model_path, truncated_copy
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    model_dir = resolve_model_path(args.model, args.cache_dir)
    # the untrained head and truncated draft are made once per policy
    work = work_dir_for(args.work_dir, model_dir)
    tok = load_tokenizer(model_dir)
    try:
        problems = load_gsm8k(args.data_path, "train")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: --data-path: {e}", file=sys.stderr)
        return 2
    # k = 0 on a speculative engine: what speculation costs when it drafts nothing
    grid = [(t, c, k) for t in args.temperature for c in args.concurrency for k in sorted({0, *args.k})]
    # rollout cells on the first prompts, fixed cells on the ones after them
    start = args.first_prompt + args.rollout_prompts
    pool = problems[start:]
    try:
        fixed = fixed_cell_prompts(len(pool), grid, args.repeats, args.fixed_group_size, args.fresh_prompts)
    except ValueError as e:
        print(f"error: --first-prompt {args.first_prompt}: {args.data_path} has {len(problems)} train "
              f"problems; after the {args.rollout_prompts} rollout prompts, {e}", file=sys.stderr)
        return 2
    used = sorted({i for v in fixed.values() for i in v})
    ids = {i: prompt_ids(tok, pool[i]) for i in used}
    bench_indices = [*range(args.first_prompt, start), *(start + i for i in used)]  # into the train split
    fixed = {key: [ids[i] for i in v] for key, v in fixed.items()}
    prompts = [prompt_ids(tok, p) for p in problems[args.first_prompt:args.first_prompt + args.rollout_prompts]]
    heads = {"untrained": untrained_head(model_dir, work)} if args.untrained_head else {}
    for spec in args.eagle3:
        name, _, d = spec.partition("=")
        if not d or not (Path(d) / "config.json").is_file():
            print(f"error: --eagle3 {spec}: expected NAME=DIR with an EAGLE-3 head", file=sys.stderr)
            return 2
        heads[name] = Path(d)
        try:
            trained = trained_prompt_overlap(d, "gsm8k", bench_indices)
        except ValueError as e:
            print(f"error: --eagle3 {spec}: {e}", file=sys.stderr)
            return 2
        if trained:
            print(f"error: --first-prompt {args.first_prompt}: {len(trained)} of the bench's GSM8K train "
                  f"prompts (indices {trained[0]}-{trained[-1]}) are in the warm-start corpus of --eagle3 "
                  f"{spec} (train_prompts in its acceptance.json): start past them", file=sys.stderr)
            return 2
    if {"eagle3", "eagle3-sampled"} & set(args.methods) and not heads:
        print("error: --no-untrained-head: method eagle3 then needs --eagle3 NAME=DIR", file=sys.stderr)
        return 2
    units = engine_units(args.methods, heads, lambda: truncated_copy(
        model_dir, work / f"draft_{args.draft_layers}l", args.draft_layers), args.draft_layers)
    units = with_draft_linear_dtypes(units, args.draft_linear_dtype)
    kmax = max(args.k)
    max_seqs = max(args.concurrency + [args.rollout_prompts * args.group_size])
    engine_kwargs = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": max_seqs, "seed": 0,
                     # repeated prompts across cells must not get cheaper by caching
                     "enable_prefix_caching": False}
    env = cpu_engine_env(args.kv_cache_gib, "all")
    rounds: list[list[dict]] = []
    costs: dict = {}  # (method, temperature) -> the step costs adaptive rollouts measured
    k_best: dict = {}  # (method, draft, temperature) -> the rollout's fixed k, chosen in round 1
    t_start = time.time()
    for r in range(args.repeats):
        cells: list[dict] = []
        for method, drafts, additional in units if r % 2 == 0 else units[::-1]:
            spec = bench_speculative_config(method, drafts[0][1], kmax, max_seqs)
            engine = SpecVLLMEngine(str(model_dir), spec, dtype=args.dtype, env=env,
                                    engine_kwargs={**engine_kwargs, "additional_config": additional})
            try:
                measure_cell(engine, fixed[0, *grid[0]], 2, 1.0, 8, ignore_eos=True)  # first-call warm-up, untimed
                for draft, d in drafts:
                    if method.startswith("eagle3") and d != drafts[0][1]:
                        engine.receive_refit("draft", vllm_state_dict(load_head(d)), engine.draft_version + 1)
                    todo = [(t, c, 0) for t in args.temperature for c in args.concurrency] if method == "none" else grid
                    desc = f"{method} {draft}".strip() + (f", round {r + 1}/{args.repeats}" if args.repeats > 1 else "")
                    for t, c, k in tqdm(todo, desc=desc, disable=None):
                        if spec is not None:
                            engine.set_k_schedule(uniform(k, max_seqs))
                        cells.append(_record(method, draft or method, k, c, t,
                                             measure_cell(engine, fixed[r, t, c, k], c, t, args.max_tokens,
                                                   ignore_eos=True), "fixed"))
                    if args.rollout_prompts:
                        cells.extend(_rollout_cells(engine, method, draft or method, prompts, args, cells,
                                                    max_seqs, costs, k_best))
            finally:
                engine.shutdown()
        _finish(cells)
        rounds.append(cells)
    cells = combine_rounds(rounds)
    print(format_table(cells))
    noise = plain_noise(cells)
    print(f"({len(cells)} cells x {args.repeats} rounds in {time.time() - t_start:.0f} s"
          + (f"; no speculation's own tokens/s spread over rounds: up to {noise:.0%})" if noise is not None else ")"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(cells, indent=1))
    plot(cells, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _rollout_cells(engine, method: str, draft: str, prompts, args, cells, max_seqs, costs,
                   k_best: dict) -> list[dict]:
    """GRPO-shaped rollouts (natural EOS, draining batch) at each temperature:
    no speculation; else the best fixed k >= 1 of the fixed cells at full
    concurrency (chosen in the first round, then kept in ``k_best``), then
    the adaptive controller, told the acceptance that rollout measured."""
    n = args.rollout_prompts * args.group_size
    rollout_prompts = [p for p in prompts[:args.rollout_prompts] for _ in range(args.group_size)]
    out = []
    for t in args.temperature:
        if method == "none":
            out.append(_record("none", "none", 0, n, t,
                               measure_cell(engine, rollout_prompts, n, t, args.rollout_max_tokens, ignore_eos=False),
                               "rollout"))
            continue
        if (method, draft, t) not in k_best:
            mine = [c for c in cells if c["method"] == method and c["draft"] == draft and c["temperature"] == t
                    and c["shape"] == "fixed" and c["k"]]
            k_best[method, draft, t] = max(
                mine, key=lambda c: (c["concurrency"] == max(args.concurrency), c["tokens_per_s"]))["k"]
        k = k_best[method, draft, t]
        engine.set_k_schedule(uniform(k, max_seqs))
        cell = measure_cell(engine, rollout_prompts, n, t, args.rollout_max_tokens, ignore_eos=False)
        out.append(_record(method, draft, k, n, t, cell, "rollout"))
        # a fresh controller, given this draft's acceptance at this temperature
        # and the rollout's shape from the fixed-k rollout just run (rates=[]:
        # not the warm head's recorded held-out rates), and the step costs of
        # this method's earlier rollouts; where it lacks some, its own untimed
        # rollouts measure them first (AdaptiveK.schedule)
        engine.enable_adaptive(margin=args.adaptive_margin, cost=costs.get((method, t)), rates=[], temperature=t)
        engine.adaptive.update(cell.stats.accepted_per_pos, cell.stats.num_drafts, k,
                               cell.stats.output_tokens - cell.stats.num_accepted_tokens)
        engine.adaptive.observe(cell.response_lens)
        for _ in range(2):
            engine.set_k_schedule(engine.adaptive.schedule())
            if "measuring" not in engine.adaptive.reason:
                break
            engine.generate(rollout_prompts, temperature=t, max_tokens=args.rollout_max_tokens)
            engine.adaptive.observe(cell.response_lens)
        costs[method, t] = engine.adaptive.cost
        out.append(_record("adaptive", draft, engine.adaptive.k_max, n, t,
                           measure_cell(engine, rollout_prompts, n, t, args.rollout_max_tokens, ignore_eos=False),
                           "rollout",
                           k_schedule=format_schedule(engine.k_schedule), rates_used=engine.adaptive.rates[:]))
        engine.adaptive = None
        engine.set_k_schedule(uniform(engine.speculative_config["num_speculative_tokens"], max_seqs))
    return out


if __name__ == "__main__":
    sys.exit(main())
