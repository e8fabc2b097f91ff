"""Per-step metrics: phase timers, the step line, and metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rayspec.rollout.adaptive import format_schedule


class PhaseTimer:
    """Wall-clock seconds per named phase: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def format_step_line(m: dict[str, Any]) -> str:
    """One human-readable line per RL step."""
    rates = ",".join(f"{r:.2f}" for r in m.get("acceptance_rate_per_pos", []))
    line = (f"step {m['step']:>4} | reward {m['reward_mean']:.3f} | "
            f"accept_len {m['acceptance_length']:.2f} | accept/pos [{rates}] | "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s | "
            f"t rollout {m['time_rollout_s']:.1f}s policy {m['time_policy_s']:.1f}s "
            f"draft {m['time_draft_s']:.1f}s sync {m['time_sync_s']:.1f}s")
    # adaptive speculation: k per batch-size range, each distinct schedule once
    schedules = {str(r["k_schedule"]): r["k_schedule"] for r in m.get("replicas", {}).values()
                 if r.get("k_schedule")}
    if schedules:
        line += " | k " + " / ".join(format_schedule(s) for s in schedules.values())
    if "layout" in m:
        idle = " ".join(f"{role} {m[f'idle_{role}_s']:.1f}s" for role in ("rollout", "train", "draft")
                        if f"idle_{role}_s" in m)
        line += (f" | step {m['time_step_s']:.1f}s {m['layout']}/{m['mode']} lag {m['policy_lag']}"
                 f" | idle {idle}")
    return line + f" | v{m['policy_version']}"


class MetricsLog:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` and the
    numeric values as TensorBoard scalars under ``<run_dir>/tensorboard``.

    Each JSON line is written and flushed whole, so a crash never leaves a
    partial record behind earlier steps. Non-finite floats are written as null.
    """

    def __init__(self, run_dir: str | os.PathLike):
        from tensorboardX import SummaryWriter

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())
        step = record["step"]
        for k, v in clean.items():
            if isinstance(v, (int, float)) and k != "step":
                self.tb.add_scalar(k, v, step)
            elif k == "acceptance_rate_per_pos":
                for i, r in enumerate(v):
                    self.tb.add_scalar(f"acceptance_rate/pos{i + 1}", r, step)
        self.tb.flush()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl``, in step order.

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: a line is not JSON (the message names file and line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    return out


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Draw acceptance length, rollout throughput, reward and phase seconds
    per step into ``<run_dir>/curves.png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    ax[0, 0].plot(steps, [r["acceptance_length"] for r in recs], "o-")
    ax[0, 0].set(title="acceptance length (tokens / verify step)", xlabel="RL step")
    ax[0, 1].plot(steps, [r["rollout_tokens_per_s"] for r in recs], "o-")
    ax[0, 1].set(title="rollout output tokens/s", xlabel="RL step")
    ax[1, 0].plot(steps, [r["reward_mean"] for r in recs], "o-")
    ax[1, 0].set(title="mean reward", xlabel="RL step", ylim=(-0.02, 1.02))
    bottom = [0.0] * len(recs)
    # stacked wall time of the step: draft training overlapping the sync is not counted twice
    for label, key in (("rollout", "time_rollout_s"), ("policy", "time_policy_s"),
                       ("draft (exposed)", "time_draft_exposed_s"), ("sync", "time_sync_s")):
        vals = [r.get(key, 0.0) for r in recs]
        ax[1, 1].bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[1, 1].set(title="seconds per step, by phase", xlabel="RL step")
    ax[1, 1].legend()
    for a in ax.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
