"""The console a person reads: the driver's own lines (the plan, the memory
check, node losses), a progress bar over the RL steps, each step line and
held-out evaluation as metrics.jsonl receives them, and the warnings of
rayspec's code in every role (``rayspec.relay``); the libraries' output
(vLLM, Ray Serve, Ray Train, DeepSpeed, transformers: every worker's stdout
and stderr) stays in Ray's worker logs on each node.

That split is Ray's own switch, ``ray.init(log_to_driver=...)``
(``logging.verbose``): Ray streams either all of a worker's output to the
driver or none of it. Errors reach the driver as exceptions.
"""

from __future__ import annotations

import sys
from typing import Any

import ray

from rayspec.metrics import format_eval_line, format_step_line
from rayspec.tracking import Tracker

class Console(Tracker):
    """The driver's progress bar over ``steps`` RL steps (tqdm: a widget in
    a notebook, text elsewhere; the step's seconds and the ETA), with each
    record's step line and evaluations above it, and the relayed warnings.

    Args:
        steps: the run's ``trainer.steps``.
        done: steps already done (a resumed run).
        lines: print the step and evaluation lines (off where Ray streams
            rank 0's own, ``logging.verbose``).
        relay: the ``ConsoleRelay`` to drain, or None.
        file: where the bar and lines go (stderr, beside the log).
    """

    name = "console"

    def __init__(self, steps: int, done: int = 0, lines: bool = True, relay=None, file=None):
        try:  # a widget in a notebook with ipywidgets; without it tqdm.auto warns, then writes text
            import ipywidgets  # noqa: F401
            from tqdm.auto import tqdm
        except ImportError:
            from tqdm import tqdm

        self.lines, self.relay, self.file = lines, relay, file or sys.stderr
        self.bar = tqdm(total=steps, initial=done, desc="RL steps", unit="step", file=self.file, dynamic_ncols=True,
                        # ETA from recent steps (half weight on the last): the first interval holds the start-up
                        smoothing=0.5,
                        bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")
        self.bar.set_postfix_str("first step: rollout, policy update, refit")
        self._live = type(self.bar).__module__ == "tqdm.notebook" or bool(getattr(self.file, "isatty", bool)())

    def write(self, line: str) -> None:
        self.bar.write(line, file=self.file)

    def log(self, record: dict[str, Any]) -> None:
        if self.lines:
            for ev in record.get("evals", []):
                self.write(format_eval_line(ev))
            self.write(format_step_line(record))
        self.bar.set_postfix_str(f"last step {record.get('time_step_s', float('nan')):.1f}s", refresh=False)
        self.bar.update(max(0, record["step"] - self.bar.n))

    def tick(self) -> None:
        if self._live:  # the elapsed time moves on a terminal or a notebook's widget; not in a log file
            self.bar.refresh()
        if self.relay is not None:
            for line in ray.get(self.relay.take.remote(), timeout=60):
                self.write(line)

    def finish(self, outputs, failed: bool = False) -> None:
        self.tick()
        self.bar.close()
        if self.relay is not None:
            ray.kill(self.relay)
