"""Per-step metrics: phase timers, the step line, and metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any


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
    return (f"step {m['step']:>4} | reward {m['reward_mean']:.3f} | "
            f"accept_len {m['acceptance_length']:.2f} | accept/pos [{rates}] | "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s | "
            f"t rollout {m['time_rollout_s']:.1f}s policy {m['time_policy_s']:.1f}s "
            f"draft {m['time_draft_s']:.1f}s sync {m['time_sync_s']:.1f}s | "
            f"v{m['policy_version']}")


class MetricsLog:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl``.

    Each line is written and flushed whole, so a crash never leaves a partial
    record behind earlier steps. Non-finite floats are written as null.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())
