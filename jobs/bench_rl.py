"""RL benchmark: the same GRPO run without speculation, with a frozen
warm-started EAGLE-3 head, and with that head trained online.

    python -m jobs.bench_rl --warm-head runs/warm/draft_head [--steps 10]
        [--out bench_rl.json] [--run-dir runs/bench_rl] [preset.yaml] [key=value ...]

Every run uses the preset (default ``jobs/configs/gsm8k.yaml``: SmolLM2-135M,
GSM8K train prompts), the same seed and therefore the same prompts; the bench
sets ``rollout.speculative_config``, ``draft.enabled``, ``trainer.steps`` and
``trainer.run_dir`` itself:

- ``none``: ``speculative_config.method=null``;
- ``frozen``: eagle3 with ``--warm-head`` (from ``jobs.warmstart_draft``),
  ``draft.enabled=false``: the head never changes while the policy drifts;
- ``online``: eagle3 with ``--warm-head`` and online draft training;
- ``adaptive`` (not in the default ``--runs``): ``frozen`` with the adaptive
  k controller (``rollout.adaptive_k.enabled``), which should bring the
  rollout back to at least the speed of ``none`` where speculation does not
  pay.

Per step and run: acceptance length, rollout tokens/s, reward and step
seconds. Prints a table (per step), writes JSON (one object per run with the
per-step lists) and ``<run-dir>/rl.png`` (the runs' curves overlaid).

Resumable: a run whose ``<run-dir>/<run>/metrics.jsonl`` already holds
``--steps`` records is read back, not run again (each run takes tens of
minutes on a CPU); an unfinished run (or one with fewer steps) continues
from its last checkpoint; one without a checkpoint is refused, never
overwritten.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

from rayspec.config import ConfigError, load_config
from rayspec.metrics import read_metrics

DEFAULT_PRESET = Path(__file__).parent / "configs" / "gsm8k.yaml"
SERIES = ("acceptance_length", "rollout_tokens_per_s", "reward_mean", "time_step_s", "time_rollout_s")


def runs(warm_head: str) -> dict[str, list[str]]:
    """The overrides of each run."""
    eagle = ["rollout.speculative_config.method=eagle3", f"rollout.speculative_config.model={warm_head}"]
    return {"none": ["rollout.speculative_config.method=null", "draft.enabled=false"],
            "frozen": eagle + ["draft.enabled=false"],
            "online": eagle + ["draft.enabled=true"],
            "adaptive": eagle + ["draft.enabled=false", "rollout.adaptive_k.enabled=true"]}


def summarize(name: str, records: list[dict]) -> dict:
    """One run's per-step series (lists, one entry per step) and their medians;
    ``steps_seconds_total`` is the sum of step seconds (startup excluded)."""
    out = {"run": name, "steps": len(records),
           "steps_seconds_total": sum(r["time_step_s"] for r in records)}
    for key in SERIES:
        out[key] = [r[key] for r in records]
        out[f"{key}_median"] = statistics.median(out[key])
    return out


def format_table(rows: list[dict]) -> str:
    lines = [f"{'step':>4}  " + "  ".join(f"{r['run'] + ' acc/tok/s/reward':>28}" for r in rows)]
    for i in range(max(r["steps"] for r in rows)):
        cells = []
        for r in rows:
            cells.append(f"{r['acceptance_length'][i]:>10.2f}{r['rollout_tokens_per_s'][i]:>9.1f}"
                         f"{r['reward_mean'][i]:>9.3f}" if i < r["steps"] else " " * 28)
        lines.append(f"{i + 1:>4}  " + "  ".join(cells))
    lines.append("median  " + "  ".join(
        f"{r['acceptance_length_median']:>10.2f}{r['rollout_tokens_per_s_median']:>9.1f}"
        f"{statistics.mean(r['reward_mean']):>9.3f}" for r in rows) + "   (reward: mean)")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> Path:
    """Acceptance length, rollout tokens/s and reward per step, runs overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), constrained_layout=True)
    for ax, key, title in zip(axes, ("acceptance_length", "rollout_tokens_per_s", "reward_mean"),
                              ("acceptance length (tokens / verification)", "rollout tokens/s",
                               "reward (mean over samples)")):
        for r in rows:
            ax.plot(range(1, r["steps"] + 1), r[key], "o-", label=r["run"])
        ax.set(title=title, xlabel="RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_rl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm-head", required=True, help="EAGLE-3 head from jobs.warmstart_draft")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", default="none,frozen,online", help="which of none,frozen,online,adaptive")
    ap.add_argument("--out", default="bench_rl.json")
    ap.add_argument("--run-dir", default="runs/bench_rl")
    ap.add_argument("args", nargs="*", help="[preset.yaml] key=value overrides")
    ns = ap.parse_args(argv)
    preset, overrides = DEFAULT_PRESET, list(ns.args)
    if overrides and overrides[0].endswith((".yaml", ".yml")):
        preset = Path(overrides.pop(0))
    root = Path(ns.run_dir)
    table = runs(str(Path(ns.warm_head).resolve()))
    names = [n for n in ns.runs.split(",") if n]
    bad = [n for n in names if n not in table]
    if bad:
        print(f"error: --runs: unknown {bad}, expected some of {list(table)}", file=sys.stderr)
        return 2
    try:
        cfgs = [(n, load_config(preset, overrides + table[n] + [
            f"trainer.steps={ns.steps}", f"trainer.run_dir={root / n}"])) for n in names]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rayspec.scheduler import checkpoints, init_ray, run

    done, resume = {}, set()
    for name, cfg in cfgs:
        run_dir = Path(cfg.trainer.run_dir)
        if not run_dir.exists() or not any(run_dir.iterdir()):
            continue
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if len(records) < ns.steps:
            if checkpoints(run_dir):
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
    print(format_table(rows))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {ns.out} and {plot(rows, root / 'rl.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
