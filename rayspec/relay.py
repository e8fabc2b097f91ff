"""rayspec's warnings from every role's process to the driver's console.

With ``logging.verbose`` off Ray streams no worker's output to the driver
(``ray.init(log_to_driver=False)``: all of it or none). What rayspec's code
in a role says at WARNING or above (a replica that died and a rollout shard
sent again, the Train workers resumed from a checkpoint, a slower path
taken) still has to reach the person: ``RelayHandler`` on the ``rayspec``
logger of each role's process posts it to ``ConsoleRelay``, an actor on the
driver's node that the driver's console drains (``rayspec.console``), as
node losses reach rank 0 (``rayspec.scheduler.recovery.NodeEvents``).
"""

from __future__ import annotations

import logging
import os
import time

import ray

from rayspec.config import NAMESPACE

RELAY_NAME = "rayspec-console"


class ConsoleRelay:
    """Lines for the driver's console from rayspec's loggers in the roles'
    processes (a Ray actor on the driver's node, named ``RELAY_NAME``)."""

    def __init__(self):
        self._lines: list[str] = []

    def post(self, line: str) -> None:
        self._lines.append(line)

    def take(self) -> list[str]:
        out, self._lines = self._lines, []
        return out


def start_console_relay():
    """The run's ``ConsoleRelay`` actor, on this process's node (the driver's)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(ConsoleRelay).options(name=RELAY_NAME, num_cpus=0, scheduling_strategy=here).remote()


class RelayHandler(logging.Handler):
    """Posts the records it gets (WARNING and above) to the run's
    ``ConsoleRelay``, without waiting; nothing where no relay runs (a
    ``logging.verbose`` run, where Ray streams the whole output, or a test
    without a driver). Looked up once a minute at most: a role's process
    outlives no run."""

    def __init__(self, namespace: str):
        super().__init__(logging.WARNING)
        self.namespace = namespace
        self._relay, self._looked_at = None, float("-inf")
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._relay is None and time.monotonic() - self._looked_at > 60:
                self._looked_at = time.monotonic()
                try:
                    self._relay = ray.get_actor(RELAY_NAME, namespace=self.namespace)
                except ValueError:  # no relay: Ray streams this process's output, or nobody reads it
                    return
            if self._relay is not None:
                ctx = ray.get_runtime_context()
                who = f"{ctx.get_actor_name() or f'pid={os.getpid()}'} on node {ctx.get_node_id()[:8]}"
                self._relay.post.remote(f"({who}) {self.format(record)}")
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


def relay_warnings() -> None:
    """In a role's process (a Ray actor: a Train worker, a Serve replica,
    the DraftTrainer), rayspec's WARNING records also go to the driver's
    console (``RelayHandler``, added once per process). Elsewhere (the
    driver, a test driving a role in its own process) nothing changes."""
    ours = logging.getLogger("rayspec")
    if (ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
            and not any(isinstance(h, RelayHandler) for h in ours.handlers)):
        ours.addHandler(RelayHandler(NAMESPACE))
