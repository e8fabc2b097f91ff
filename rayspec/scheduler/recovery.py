"""When a node dies mid-run: which roles it held, the plan without it
(``placement.replan``, waiting a while for nodes to join where the nodes
left cannot hold the layout), and the record of each loss that the driver
hands to rank 0 for the next step record (``NodeEvents``), or the word
that the run stops because the nodes left cannot hold the layout (rank 0
then saves the last step it finished: ``stopping_run``).

The driver (``rayspec.driver``) follows the new plan: the rollout
deployment and the DraftTrainer move at once, the Train workers once Ray
Train gives up their group (a worker group pinned to a dead node cannot
start: ``FailureConfig(controller_failure_limit=0)`` turns Ray Train's
endless retries into an error) and restart from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

import ray

from rayspec.scheduler.placement import ROLES, ClusterFitError, NodeInfo, PlacementPlan, replan

log = logging.getLogger(__name__)

EVENTS_NAME = "rayspec-node-events"


def alive_node_ids() -> set[str]:
    """Ids of the nodes Ray lists alive (one call to the GCS)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def dead_nodes(plan: PlacementPlan, alive: set[str]) -> list[str]:
    """The nodes ``plan`` gives a role that are not in ``alive``, in plan order."""
    used = {b.node_id for b in plan.bundles}
    return [n.node_id for n in plan.nodes if n.node_id in used and n.node_id not in alive]


def moved_roles(old: PlacementPlan, new: PlacementPlan) -> dict[str, list[str]]:
    """Per role whose bundles ``new`` puts elsewhere: the nodes (first 8 hex
    digits of the id) of all its bundles in ``new``."""
    out = {}
    for role in ROLES:
        before, after = [b.node_id for b in old.role(role)], [b.node_id for b in new.role(role)]
        if before != after:
            out[role] = [n[:8] for n in after]
    return out


def plan_without(cfg, plan: PlacementPlan, nodes: Callable[[], list[NodeInfo]], wait_s: float,
                 poll_s: float = 5.0) -> PlacementPlan:
    """``replan`` of ``plan`` on the nodes alive; where they cannot hold the
    layout, ask again every ``poll_s`` seconds (a node may join, e.g. from
    an autoscaler) for up to ``wait_s`` seconds.

    Args:
        nodes: the cluster's alive nodes (``cluster_nodes``; asked again
            while waiting).

    Raises:
        ClusterFitError: still no fit after ``wait_s`` (the last error, with
            how long the run waited).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return replan(cfg, plan, nodes())
        except ClusterFitError as e:
            if time.monotonic() >= deadline:
                raise ClusterFitError(f"{e}. Waited {wait_s:g} s for nodes to join (scheduler.node_wait_s)") from None
            log.warning("the nodes left cannot hold the layout; waiting up to %.0f s more for nodes to join: %s",
                        deadline - time.monotonic(), e)
            time.sleep(poll_s)


class NodeEvents:
    """Node losses the driver posts for rank 0's next step record, and why
    the run stops where it must (a Ray actor on the driver's node, named
    ``EVENTS_NAME``; ``take_node_events`` and ``stopping_run`` read it)."""

    def __init__(self):
        self._new: list[dict[str, Any]] = []
        self._stop: str | None = None

    def post(self, event: dict[str, Any]) -> None:
        self._new.append(event)

    def take(self) -> list[dict[str, Any]]:
        out, self._new = self._new, []
        return out

    def stop(self, reason: str) -> None:
        """The run stops: ``reason`` is the ``ClusterFitError``'s message."""
        self._stop = reason

    def stop_reason(self) -> str | None:
        return self._stop


def start_node_events():
    """The run's ``NodeEvents`` actor, on this process's node (the driver's)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(NodeEvents).options(name=EVENTS_NAME, num_cpus=0, scheduling_strategy=here).remote()


def _events_actor():
    """The run's ``NodeEvents``, or None (no driver started one: a test's own coordinator)."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(EVENTS_NAME)
    except ValueError:
        return None


def take_node_events() -> list[dict[str, Any]]:
    """The node losses posted since the last call, oldest first ([] where
    no driver posts any)."""
    actor = _events_actor()
    return [] if actor is None else ray.get(actor.take.remote(), timeout=60)


def stop_reason() -> str | None:
    """Why the driver stops the run (a ``ClusterFitError``'s message), or
    None while it goes on (or where no driver posts: a test's own coordinator)."""
    actor = _events_actor()
    return None if actor is None else ray.get(actor.stop_reason.remote(), timeout=60)


@contextlib.contextmanager
def stopping_run() -> Iterator[None]:
    """Rank 0's work with the rollout replicas: where it fails because the
    driver stopped the run (a node died and the nodes left cannot hold the
    layout, after ``scheduler.node_wait_s``: the driver deleted the rollout
    deployment), the error becomes the driver's ``ClusterFitError``, which
    ends the Train workers after they save the last step they finished
    (``rayspec.train.loop.run_steps``). Other errors pass as they are.

    Raises:
        ClusterFitError: the driver's message (the failure as its cause).
    """
    try:
        yield
    except Exception as e:
        reason = stop_reason()
        if reason is None:
            raise
        raise ClusterFitError(reason) from e
