"""Scheduler benchmark: the same RL steps in sync-colocate, sync-split and
async-split, side by side.

    python -m jobs.bench_pipeline [preset.yaml] [key=value ...] [--steps 5]
        [--out bench_pipeline.json] [--run-dir runs/bench_pipeline]

Every configuration runs the same preset, seed and prompts (default: the
offline default job, SmolLM2-135M with EAGLE-3 k=3) on one Ray cluster, one
after the other; the bench sets ``scheduler.layout``/``mode``,
``trainer.steps`` (``--steps``) and ``trainer.run_dir`` (below ``--run-dir``)
itself, over any override of them. Per configuration it reports the median over steps of the
step seconds, the exposed rollout seconds (what the trainer waited for its
batch), and each role's idle seconds, plus the ratio of sync-colocate's median
step to this one's. Prints a table, writes JSON (a list, one object per
configuration) and ``<run-dir>/pipeline.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from jobs.cli import split_args
from rayspec.config import ConfigError, load_config
from rayspec.metrics import read_metrics

CONFIGS = (("colocate", "sync"), ("split", "sync"), ("split", "async"))
ROLES = ("rollout", "train", "draft")


def summarize(layout: str, mode: str, records: list[dict], wall_s: float) -> dict:
    """One configuration's figures from its metrics.jsonl records (medians over steps)."""
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    out = {
        "layout": layout, "mode": mode, "steps": len(records),
        "step_seconds_median": med("time_step_s"),
        "step_seconds": [r["time_step_s"] for r in records],
        "exposed_rollout_seconds": med("time_rollout_s"),
        "rollout_generation_seconds": med("rollout_generation_s"),
        "policy_seconds": med("time_policy_s"),
        "policy_lag_max": max(r["policy_lag"] for r in records),
        "rollout_tokens_per_s": med("rollout_tokens_per_s"),
        "acceptance_length": med("acceptance_length"),
        "reward_mean": statistics.mean(r["reward_mean"] for r in records),
        "run_wall_seconds": wall_s,
    }
    for role in ROLES:
        if all(f"idle_{role}_s" in r for r in records):
            out[f"idle_{role}_seconds"] = med(f"idle_{role}_s")
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'layout/mode':<16}{'step s':>8}{'exposed rollout s':>19}{'gen s':>7}{'policy s':>9}"
            f"{'idle rollout':>13}{'idle train':>11}{'idle draft':>11}{'lag':>5}{'tok/s':>7}"
            f"{'vs sync-colocate':>18}")
    lines = [head, "-" * len(head)]
    for r in rows:
        idle = [f"{r[f'idle_{role}_seconds']:.1f}" if f"idle_{role}_seconds" in r else "-"
                for role in ROLES]
        lines.append(
            f"{r['layout'] + '/' + r['mode']:<16}{r['step_seconds_median']:>8.1f}"
            f"{r['exposed_rollout_seconds']:>19.1f}{r['rollout_generation_seconds']:>7.1f}"
            f"{r['policy_seconds']:>9.1f}{idle[0]:>13}{idle[1]:>11}{idle[2]:>11}"
            f"{r['policy_lag_max']:>5}{r['rollout_tokens_per_s']:>7.0f}"
            f"{r['speedup_vs_sync_colocate']:>17.2f}x")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> Path:
    """Step seconds per step, and median idle seconds per role, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for r in rows:
        ax[0].plot(range(1, len(r["step_seconds"]) + 1), r["step_seconds"], "o-",
                   label=f"{r['layout']}/{r['mode']}")
    ax[0].set(title="seconds per RL step", xlabel="RL step", ylabel="s")
    ax[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    ax[0].legend()
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        vals = [r.get(f"idle_{role}_seconds", 0.0) for role in ROLES]
        ax[1].bar([j + i * width for j in range(len(ROLES))], vals, width,
                  label=f"{r['layout']}/{r['mode']}")
    ax[1].set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(ROLES))], ROLES)
    ax[1].set(title="idle seconds per step (median), by role", ylabel="s")
    ax[1].legend()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="RL steps per configuration (default 5)")
    ap.add_argument("--out", default="bench_pipeline.json", help="JSON results file")
    ap.add_argument("--run-dir", default="runs/bench_pipeline", help="one run directory per configuration below it")
    ap.add_argument("args", nargs="*", help="[preset.yaml] key=value overrides")
    ns = ap.parse_intermixed_args(argv)
    try:
        preset, overrides = split_args(ns.args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(ns.run_dir)
    if root.exists() and any(root.iterdir()):
        # each configuration must start from the same fresh draft head and empty logs
        print(f"error: --run-dir {root} is not empty; remove it or choose another", file=sys.stderr)
        return 2
    cfgs = []
    try:
        for layout, mode in CONFIGS:
            cfgs.append(load_config(preset, overrides + [
                f"scheduler.layout={layout}", f"scheduler.mode={mode}", f"trainer.steps={ns.steps}",
                f"trainer.run_dir={root / f'{mode}-{layout}'}"]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfgs[0].logging.level, format="%(asctime)s %(name)s: %(message)s")
    from rayspec.driver import init_ray, run

    init_ray(cfgs[0])
    rows = []
    for cfg in cfgs:
        run_dir = Path(cfg.trainer.run_dir)
        print(f"=== {cfg.scheduler.mode}-{cfg.scheduler.layout}: {ns.steps} steps -> {run_dir}", flush=True)
        t0 = time.perf_counter()
        run(cfg)
        rows.append(summarize(cfg.scheduler.layout, cfg.scheduler.mode, read_metrics(run_dir),
                              time.perf_counter() - t0))
    base = rows[0]["step_seconds_median"]
    for r in rows:
        r["speedup_vs_sync_colocate"] = base / r["step_seconds_median"]
    print(format_table(rows))
    Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {ns.out} and {plot(rows, root / 'pipeline.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
