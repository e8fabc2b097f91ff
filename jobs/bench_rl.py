"""RL benchmark: the same GRPO run without speculation, with a frozen
warm-started EAGLE-3 head, and with that head trained online.

    python -m jobs.bench_rl [--warm-head runs/warm/draft_head] [--steps 10] [--runs none,online]
        [--out bench_rl.json] [--run-dir runs/bench_rl] [preset.yaml] [key=value ...]

Every run uses the preset (default ``jobs/configs/default.yaml``, the
learning preset: SmolLM2-135M on one-operation arithmetic, on which the
policy's reward rises within 30 steps and the policy drifts from where the
head was trained), the same seed and therefore the same prompts; the bench
sets ``rollout.speculative_config``, ``rollout.adaptive_k.enabled``,
``draft.enabled``, ``trainer.steps`` and ``trainer.run_dir`` itself:

- ``none``: ``speculative_config.method=null``;
- ``frozen``: eagle3 with ``--warm-head`` (from ``jobs.warmstart_draft``),
  ``draft.enabled=false``, k fixed: the head never changes while the policy
  drifts;
- ``online``: eagle3 with ``--warm-head`` and online draft training, k fixed;
- ``adaptive`` (not in the default ``--runs``): ``frozen`` with the adaptive
  k controller (``rollout.adaptive_k.enabled``), which should bring the
  rollout back to at least the speed of ``none`` where speculation does not
  pay; ``online-adaptive``: ``online`` with it (without ``--warm-head``, the
  default preset's own setting: a fresh head trained online).
- ``suffix`` and ``suffix-group`` (not in the default ``--runs``): vLLM's
  suffix decoding, drafts of up to 8 tokens. ``suffix`` drafts from the
  sequence's own prompt and response only
  (``suffix_decoding_max_cached_requests=0``); ``suffix-group`` also from
  the other responses on its replica, those of its GRPO group being written
  beside it and earlier steps' rollouts (vLLM's window of 10000 responses).
  Both draft at a fixed budget of 8; ``suffix-group-adaptive`` lets the
  adaptive controller set the budget per batch size (0 where drafting does
  not pay, the most in the long tail).

RL equivalence: ``--none-seeds 1,2`` adds ``none`` runs at other
``trainer.seed`` values (the same prompts: ``data.seed`` is fixed). Each
speculative run's mean distance to all ``none`` seeds (mean per-step
|reward difference|) is reported against the seed-to-seed spread, how far the
most atypical ``none`` seed sits from the others (``compare_to_none``):
speculation is lossless, so it may change the curve only as much as another
sampling seed does. Every run also reports its logprob agreement: the median over steps
of ``token_mult_prob_error`` (mean |p_trainer / p_vllm - 1| of the sampled
tokens, NeMo-RL's name).

Per step and run: acceptance length, rollout tokens/s, reward, policy drift
(``kl``: per-token KL of the policy to the initial one on the step's
samples, where the preset has ``grpo.kl_coef`` > 0) and step seconds; per
held-out evaluation (``trainer.eval_every``): reward and the acceptance
length on the fixed held-out prompts. Prints a table (per step), writes JSON
(one object per run with the per-step lists) and ``<run-dir>/rl.png`` (the
runs' curves overlaid).

Resumable: a run whose ``<run-dir>/<run>/metrics.jsonl`` already holds
``--steps`` records is read back, not run again (each run takes tens of
minutes on a CPU); an unfinished run (or one with fewer steps) continues
from its last checkpoint; one without a checkpoint is refused, never
overwritten. A run that finished has its checkpoints deleted once its
metrics are read (``--keep-checkpoints`` keeps them, e.g. to extend it to
more steps later): on 2 CPU cores each 10-step GSM8K run left 9.5 GB of
DeepSpeed and DraftTrainer states, and nine runs filled the disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
from pathlib import Path

from jobs.cli import split_args
from rayspec.config import ConfigError, load_config
from rayspec.metrics import read_metrics
SERIES = ("acceptance_length", "rollout_tokens_per_s", "reward_mean", "kl", "time_step_s", "time_rollout_s",
          "time_policy_s", "time_draft_s", "time_sync_s", "draft_trained", "token_mult_prob_error")
SUFFIX_K = 8  # the most a suffix draft may hold; its length follows the match (see SpeculativeConfig)
EVAL_SERIES = ("policy_version", "reward_greedy", "reward_sampled", "acceptance_length", "greedy_changed")


def runs(warm_head: str | None) -> dict[str, list[str]]:
    """The overrides of each run. Without a warm head ``online`` starts from a
    fresh head and the runs that never train it are not offered."""
    fixed, adapt = "rollout.adaptive_k.enabled=false", "rollout.adaptive_k.enabled=true"
    eagle = ["rollout.speculative_config.method=eagle3",
             f"rollout.speculative_config.model={warm_head if warm_head else 'null'}"]
    suffix = ["rollout.speculative_config.method=suffix", "rollout.speculative_config.model=null",
              f"rollout.speculative_config.num_speculative_tokens={SUFFIX_K}", "draft.enabled=false"]
    table = {"none": ["rollout.speculative_config.method=null", "draft.enabled=false"],
             "online": eagle + ["draft.enabled=true", fixed],
             "online-adaptive": eagle + ["draft.enabled=true", adapt],
             "suffix": suffix + ["rollout.speculative_config.suffix_decoding_max_cached_requests=0", fixed],
             "suffix-group": suffix + [fixed],
             "suffix-group-adaptive": suffix + [adapt]}
    if warm_head:
        table["frozen"] = eagle + ["draft.enabled=false", fixed]
        table["adaptive"] = eagle + ["draft.enabled=false", adapt]
    return table


def _distance(a: dict, b: dict, steps: int) -> float:
    """Mean over the first ``steps`` steps of |reward_a - reward_b|."""
    return statistics.mean(abs(a["reward_mean"][t] - b["reward_mean"][t]) for t in range(steps))


def compare_to_none(rows: list[dict]) -> None:
    """RL equivalence, symmetric in the seeds. The distance between two runs
    is their mean per-step |reward difference|. The seed-to-seed spread is
    the largest, over the ``none`` seeds, of one seed's mean distance to the
    other ``none`` seeds (how far the most atypical non-speculative run sits
    from its peers); a speculative run is within it when its mean distance to
    all ``none`` seeds is no larger. So speculation, which is lossless, may
    move the curve as much as another sampling seed does, whichever seed the
    speculative run shares.

    Adds ``seed_spread`` (float) and ``seed_distances`` ({"none~none@1": d})
    to the first ``none`` row, and ``reward_dist_to_none`` ({none run: d}),
    ``reward_dist_to_none_mean`` and ``within_seed_spread`` to each
    speculative row. Needs >= 2 none runs; with 2 the spread is one draw."""
    nones = [r for r in rows if r["run"].split("@")[0] == "none"]
    if len(nones) < 2:
        return
    steps = min(r["steps"] for r in rows)
    nones[0]["seed_distances"] = {f"{a['run']}~{b['run']}": _distance(a, b, steps)
                                  for i, a in enumerate(nones) for b in nones[i + 1:]}
    nones[0]["seed_spread"] = max(
        statistics.mean(_distance(a, b, steps) for b in nones if b is not a) for a in nones)
    for r in rows:
        if r["run"].split("@")[0] == "none":
            continue
        r["reward_dist_to_none"] = {n["run"]: _distance(r, n, steps) for n in nones}
        r["reward_dist_to_none_mean"] = statistics.mean(r["reward_dist_to_none"].values())
        r["within_seed_spread"] = r["reward_dist_to_none_mean"] <= nones[0]["seed_spread"]


def estimate_pairs(records: list[dict]) -> list[dict]:
    """Each step's DraftTrainer estimate (``draft_acceptance_estimate``: the
    replicas' drafting replayed with the head that drafted the step's
    rollout, on its responses) beside the acceptance rates per position that
    rollout measured: [{"step", "estimated", "measured"[,
    "estimated_where_drafted"]}], positions both have. Steps that drafted
    nothing are left out; where adaptive k drafted fewer than k tokens at
    some batch sizes the later positions were measured on fewer drafts than
    the replay makes. ``estimated_where_drafted`` (one replica, with the
    replay by share of the rollout in flight): the estimate over the batch
    sizes where the step's schedule drafted, as the controller weighs it
    (``AdaptiveK.rates_where``)."""
    from rayspec.rollout.adaptive import AdaptiveK

    out = []
    for r in records:
        est, meas = r.get("draft_acceptance_estimate") or [], r.get("acceptance_rate_per_pos") or []
        if est and meas and r.get("num_drafts", 0) > 0:
            n = min(len(est), len(meas))
            pair = {"step": r.get("step"), "estimated": est[:n], "measured": meas[:n]}
            reps = list(r.get("replicas", {}).values())
            if r.get("draft_acceptance_by_share") and len(reps) == 1 and reps[0].get("k_schedule"):
                lens = r["response_lens"]
                # no step cost: only the rates and the rollout's shape are read
                ctl = AdaptiveK(len(est), len(lens))
                ctl.observe(lens)
                ctl.draft_estimated(est, r["draft_acceptance_by_share"])
                pair["estimated_where_drafted"] = ctl.rates_where([tuple(x) for x in reps[0]["k_schedule"]])[:n]
            out.append(pair)
    return out


def summarize(name: str, records: list[dict]) -> dict:
    """One run's per-step series (lists, one entry per step) and their medians
    (NaN where a step lacks the key); ``steps_seconds_total`` is the sum of step
    seconds (startup excluded); ``eval`` holds the held-out evaluations'
    series (``EVAL_SERIES``, one entry per evaluation); ``estimate_pairs``
    (``estimate_pairs``) and, where there are some, their means per position
    ``acceptance_estimated_mean`` / ``acceptance_measured_mean``."""
    out = {"run": name, "steps": len(records),
           "steps_seconds_total": sum(r["time_step_s"] for r in records)}
    for key in SERIES:
        out[key] = [float("nan") if r.get(key) is None else r[key] for r in records]
        out[f"{key}_median"] = statistics.median(out[key])
    evals = [e for r in records for e in r.get("evals", [])]
    out["eval"] = {key: [e.get(key, float("nan")) for e in evals] for key in EVAL_SERIES}
    out["estimate_pairs"] = pairs = estimate_pairs(records)
    if pairs:
        n = min(len(p["estimated"]) for p in pairs)
        for key in ("estimated", "measured"):
            out[f"acceptance_{key}_mean"] = [statistics.mean(p[key][i] for p in pairs) for i in range(n)]
        where = [p for p in pairs if "estimated_where_drafted" in p]
        if where:  # the steps that have it, with what they measured
            out["acceptance_where_drafted_mean"] = [
                [statistics.mean(p[key][i] for p in where) for i in range(n)]
                for key in ("estimated_where_drafted", "measured")]
    return out


def format_table(rows: list[dict]) -> str:
    lines = [f"{'step':>4}  " + "  ".join(f"{r['run'] + ' acc/tok/s/reward/kl':>36}" for r in rows)]
    for i in range(max(r["steps"] for r in rows)):
        cells = []
        for r in rows:
            cells.append(f"{r['acceptance_length'][i]:>10.2f}{r['rollout_tokens_per_s'][i]:>9.1f}"
                         f"{r['reward_mean'][i]:>9.3f}{r['kl'][i]:>8.4f}" if i < r["steps"] else " " * 36)
        lines.append(f"{i + 1:>4}  " + "  ".join(cells))
    lines.append("median  " + "  ".join(
        f"{r['acceptance_length_median']:>10.2f}{r['rollout_tokens_per_s_median']:>9.1f}"
        f"{statistics.mean(r['reward_mean']):>9.3f}{r['kl_median']:>8.4f}" for r in rows)
        + "   (reward: mean)")
    for r in rows:
        ev = r.get("eval", {})
        if ev.get("policy_version"):
            lines.append(f"{r['run']} held-out (after step: greedy reward / sampled reward / acceptance "
                         "length): " + ", ".join(
                             f"{v}: {g:.3f}/{s:.3f}/{a:.2f}" for v, g, s, a in zip(
                                 ev["policy_version"], ev["reward_greedy"], ev["reward_sampled"],
                                 ev["acceptance_length"])))
    for r in rows:
        if r.get("estimate_pairs"):
            fmt = lambda xs: "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"  # noqa: E731
            lines.append(f"{r['run']} acceptance rate per position, replayed by the DraftTrainer / measured "
                         f"by the replicas (mean over {len(r['estimate_pairs'])} steps): "
                         f"{fmt(r['acceptance_estimated_mean'])} / {fmt(r['acceptance_measured_mean'])}")
            if r.get("acceptance_where_drafted_mean"):
                est, meas = r["acceptance_where_drafted_mean"]
                lines.append(f"{r['run']}   replayed where the schedule drafted / measured (mean over "
                             f"the {sum('estimated_where_drafted' in p for p in r['estimate_pairs'])} of "
                             f"them replayed by share): {fmt(est)} / {fmt(meas)}")
    lines.append("logprob agreement (token_mult_prob_error, median over steps): " + ", ".join(
        f"{r['run']} {r['token_mult_prob_error_median']:.2e}" for r in rows))
    spread = next((r for r in rows if "seed_spread" in r), None)
    if spread is not None:
        lines.append("reward distance (mean over steps of |reward difference|) between none seeds: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in spread["seed_distances"].items())
                     + f"; seed-to-seed spread {spread['seed_spread']:.3f}")
        lines += [f"  {r['run']}: mean distance to the none seeds {r['reward_dist_to_none_mean']:.3f} ("
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["reward_dist_to_none"].items()) + ") -> "
                  f"{'within' if r['within_seed_spread'] else 'OUTSIDE'} the spread"
                  for r in rows if "reward_dist_to_none" in r]
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> Path:
    """Acceptance length, rollout tokens/s, reward and policy drift (KL to
    the initial policy) per step, runs overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 4, figsize=(18, 4), constrained_layout=True)
    for ax, key, title in zip(axes, ("acceptance_length", "rollout_tokens_per_s", "reward_mean", "kl"),
                              ("acceptance length (tokens / verification)", "rollout tokens/s",
                               "reward (mean over samples)", "drift: KL(policy || initial) per token")):
        for r in rows:
            ax.plot(range(1, r["steps"] + 1), r[key], "o-", label=r["run"])
        ax.set(title=title, xlabel="RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def choose_runs(runs_arg: str | None, table: dict, warm_head: bool) -> list[str]:
    """The runs ``--runs`` names (default: none,frozen,online with a warm
    head, none,online-adaptive without one).

    Raises:
        ValueError: a run not in ``table`` (named; frozen and adaptive need a warm head).
    """
    names = [n for n in (runs_arg or ("none,frozen,online" if warm_head else "none,online-adaptive")).split(",")
             if n]
    bad = [n for n in names if n not in table]
    if bad:
        raise ValueError(f"--runs: unknown {bad}, expected some of {list(table)}"
                         + ("" if warm_head else " (frozen and adaptive need --warm-head)"))
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_rl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm-head", help="EAGLE-3 head from jobs.warmstart_draft (needed by frozen, "
                    "adaptive; without it online starts from a fresh head)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", help="which of none,frozen,online,adaptive,online-adaptive,suffix,suffix-group,"
                                   "suffix-group-adaptive (default: none,frozen,online with --warm-head, "
                                   "else none,online-adaptive)")
    ap.add_argument("--none-seeds", default="",
                    help="further trainer.seed values for extra `none` runs (none@<seed>): the "
                    "seed-to-seed reward spread the speculative runs are compared with")
    ap.add_argument("--out", default="bench_rl.json")
    ap.add_argument("--run-dir", default="runs/bench_rl")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep each finished run's checkpoints (deleted by default: gigabytes per run)")
    ap.add_argument("args", nargs="*", help="[preset.yaml] key=value overrides")
    ns = ap.parse_intermixed_args(argv)
    try:
        preset, overrides = split_args(ns.args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(ns.run_dir)
    table = runs(str(Path(ns.warm_head).resolve()) if ns.warm_head else None)
    try:
        names = choose_runs(ns.runs, table, bool(ns.warm_head))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in ns.none_seeds.split(",") if x]
    except ValueError:
        print(f"error: --none-seeds={ns.none_seeds}: expected comma-separated integers", file=sys.stderr)
        return 2
    try:
        cfgs = [(n, load_config(preset, overrides + table[n] + [
            f"trainer.steps={ns.steps}", f"trainer.run_dir={root / n}"])) for n in names]
        cfgs += [(f"none@{s}", load_config(preset, overrides + table["none"] + [
            f"trainer.steps={ns.steps}", f"trainer.seed={s}", f"trainer.run_dir={root / f'none-seed{s}'}"]))
            for s in seeds]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rayspec.driver import init_ray, run
    from rayspec.train.checkpoint import TRAIN_STORAGE, checkpoints, train_storage

    done, resume = {}, set()
    for name, cfg in cfgs:
        run_dir = Path(cfg.trainer.run_dir)
        if not run_dir.exists() or not any(run_dir.iterdir()):
            continue
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if len(records) < ns.steps:
            if checkpoints(train_storage(cfg.trainer)):
                resume.add(name)  # continued from its last checkpoint below
                continue
            print(f"error: {run_dir} holds an unfinished run ({len(records)} of {ns.steps} steps) "
                  "without a checkpoint; remove it to run it again", file=sys.stderr)
            return 2
        done[name] = summarize(name, records[:ns.steps])
    logging.basicConfig(level=cfgs[0][1].logging.level, format="%(asctime)s %(name)s: %(message)s")
    if len(done) < len(cfgs):
        init_ray(cfgs[0][1])
    rows = []
    for name, cfg in cfgs:
        if name in done:
            print(f"=== {name}: finished in {cfg.trainer.run_dir}, read back", flush=True)
            rows.append(done[name])
            continue
        print(f"=== {name}: {ns.steps} steps -> {cfg.trainer.run_dir}", flush=True)
        run(cfg, resume=name in resume)
        rows.append(summarize(name, read_metrics(cfg.trainer.run_dir)))
        if not ns.keep_checkpoints:
            # the default storage (a trainer.storage_path elsewhere keeps its checkpoints)
            shutil.rmtree(Path(cfg.trainer.run_dir) / TRAIN_STORAGE, ignore_errors=True)
    compare_to_none(rows)
    print(format_table(rows))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {ns.out} and {plot(rows, root / 'rl.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
