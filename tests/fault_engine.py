"""A rollout engine that kills its own replica while it generates: the
fault tests' replica kill, plugged in through ``rollout.engine_cls``
(``tests.fault_engine:DyingEngine``).

Killing a replica from outside at the right moment needs a guess at when it
generates (a replica taking one call at a time cannot be asked), and a guess
that hit a replica loading a refit instead left the run with no shard to
retry (CI, an async fault run). The engine itself knows.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil

from rayspec.vllm.engines import OfflineEngine

KILL_FILE_ENV = "RAYSPEC_TEST_KILL_FILE"


def arm(trigger: Path, n: int) -> None:
    """Ask one ``DyingEngine`` replica to die during its next (or current)
    call of ``n`` samples per prompt (a rollout's group size; evaluations
    sample fewer)."""
    tmp = trigger.with_name(trigger.name + ".tmp")
    tmp.write_text(str(n))
    tmp.replace(trigger)  # whole, or not there: the watchers never read half of it


def killed(trigger: Path) -> bool:
    """Whether a replica took the trigger (and died)."""
    return any(trigger.parent.glob(trigger.name + ".pid*"))


class _Dying:
    """Mixed into an engine class: SIGKILLs the replica's process tree (its
    engine core's process too, where it has one) while a ``generate`` call
    of the armed ``n`` runs, once the file named by
    ``$RAYSPEC_TEST_KILL_FILE`` exists (``arm``). The replica that renames
    the file away dies; the others, and the replica Serve starts in its
    place, go on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_flight = collections.Counter()  # generate calls running, by samples per prompt
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, args=(Path(os.environ[KILL_FILE_ENV]),), daemon=True).start()

    def generate(self, prompts: list, params, lora_request=None) -> list:
        n = (params[0] if isinstance(params, list) else params).n
        with self._lock:
            self._in_flight[n] += 1
        try:
            return super().generate(prompts, params, lora_request)
        finally:
            with self._lock:
                self._in_flight[n] -= 1

    def _watch(self, trigger: Path) -> None:
        while True:
            time.sleep(0.02)
            try:
                if self._in_flight[int(trigger.read_text())] <= 0:
                    continue
                trigger.rename(trigger.with_name(f"{trigger.name}.pid{os.getpid()}"))
            except FileNotFoundError:  # not armed, or another replica took it
                continue
            me = psutil.Process()
            for p in [*me.children(recursive=True), me]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGKILL)


class DyingEngine(_Dying, OfflineEngine):
    """``OfflineEngine`` (its engine core in the replica's process where
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that dies when armed (``_Dying``)."""

