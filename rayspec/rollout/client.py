"""The trainer's client of the rollout replicas: rollouts spread over them
(prompt groups as request units, or shards), and every call the RL step and
the weight transports make on all of them.

``RolloutClient`` wraps a Ray Serve ``DeploymentHandle`` of
``SpecVLLMEngine`` replicas in production, or ``LocalReplicas`` (engines, or
fakes of them, in this process) in benchmarks and tests: both give
``generate.remote(**kw)`` (one replica, load-balanced) and
``broadcast(method_name, *args)`` (every replica), as Serve's handle does.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
from typing import Any, Callable, Optional

import ray

from rayspec.batch import RolloutBatch
from rayspec.rollout.engine import ReplicaBehind, SpecVLLMEngine
from rayspec.rollout.spec_stats import SpecStats

log = logging.getLogger(__name__)


class RolloutStopped(RuntimeError):
    """A rollout given up because the run stops (the reason: the message)."""


class PendingRollout:
    """Rollout request units (prompt groups, or shards of them) in flight on
    the replicas (``RolloutClient.submit``); ``result()`` joins them.

    A shard whose replica dies mid-generation is sent again through the
    handle (Serve routes it to a live replica, or queues it until the
    controller has replaced the dead one); the lost attempt returns nothing,
    so no sample is duplicated, and with a seed the retry draws the same
    samples (each request has its own generator).

    A shard that reaches a replica outside the weight-sync group, holding
    older weights (``ReplicaBehind``), is sent again with ``catch_up``'s
    refits (the weights as ObjectRefs); that is not a retry.

    While it waits, ``stopped`` is asked every ``poll_s`` seconds why the
    run stops, if it does: a request queued for a deployment that is deleted
    meanwhile (the driver stops a run whose replicas have nowhere to go)
    waits in Serve's router for ever (Ray 2.60), so the rollout gives up
    then with ``RolloutStopped``.
    """

    def __init__(self, handle, shards: list[dict[str, Any]], max_retries: int = 2,
                 catch_up: Optional[Callable[[dict], dict]] = None,
                 stopped: Optional[Callable[[], Optional[str]]] = None, poll_s: float = 5.0):
        self._handle, self._shards, self.max_retries = handle, shards, max_retries
        self._catch_up, self._stopped, self.poll_s = catch_up, stopped, poll_s
        self._responses = [handle.generate.remote(**kw) for kw in shards]
        self.retries = 0

    def _response(self, i: int):
        """Shard ``i``'s result, asking ``stopped`` between waits of ``poll_s``.

        Raises:
            RolloutStopped: ``stopped`` gave a reason (every shard cancelled).
        """
        if self._stopped is None:
            return self._responses[i].result()
        while True:
            try:
                return self._responses[i].result(timeout_s=self.poll_s)
            except TimeoutError as e:
                if isinstance(e, ray.exceptions.RayTaskError):  # the replica's own error (Ray adds its type)
                    raise
                reason = self._stopped()
                if reason is not None:
                    self.cancel()
                    raise RolloutStopped(reason) from None

    def _shard_result(self, i: int):
        attempt = 0
        while True:
            try:
                return self._response(i)
            except ReplicaBehind as e:
                if self._catch_up is None:
                    raise
                log.warning("%s; sending the shard again with the weights through the object store",
                            str(e).strip().splitlines()[-1])  # the message, not Ray's remote traceback
                kw = self._shards[i] = dict(self._shards[i], refits=self._catch_up(self._shards[i]["refits"]))
                self._responses[i] = self._handle.generate.remote(**kw)
            except ray.exceptions.RayActorError as e:
                if attempt == self.max_retries:
                    raise
                attempt += 1
                kw = self._shards[i]
                log.warning("rollout replica died generating prompts %d..%d (%s); retrying the shard "
                            "(%d/%d)", kw["group_offset"], kw["group_offset"] + len(kw["prompt_ids"]) - 1,
                            type(e).__name__, attempt, self.max_retries)
                self.retries += 1
                self._responses[i] = self._handle.generate.remote(**kw)

    def result(self) -> tuple[RolloutBatch, SpecStats]:
        """Wait for every shard, retrying those whose replica died.

        Returns:
            (RolloutBatch grouped by prompt in input order, SpecStats summed
            over replicas, with each replica's own in ``.replicas``).

        Raises:
            ray.exceptions.RayActorError: a shard's replica died on every
                one of its ``max_retries + 1`` attempts.
            RolloutStopped: the run stops (``stopped``).
        """
        parts = [self._shard_result(i) for i in range(len(self._responses))]
        stats = SpecStats()
        for _, s in parts:
            stats = stats + s
        return RolloutBatch.concat([b for b, _ in parts]), stats

    def cancel(self) -> None:
        """Give up on the shards (a replica finishes a generate it started)."""
        for r in self._responses:
            r.cancel()


class RolloutClient:
    """The rollout replicas as the RL step and the weight senders see them.

    Args:
        handle: a Serve ``DeploymentHandle`` of ``SpecVLLMEngine``, or
            ``LocalReplicas``.
        num_shards: how many shards a rollout's prompts are split into
            where ``by_group`` is off (the replica count: contiguous shards,
            one per replica).
        by_group: each prompt's group is one request unit (its ``n``
            samples stay together, as group drafting needs), sent at once
            and spread by the handle's router, for replicas that batch
            requests continuously (``AsyncEngine``): one replica's long tail
            then holds up only its own groups. Off: one shard per replica,
            for replicas that take one call at a time (``OfflineEngine``).
        stopped: asked while a rollout waits why the run stops, if it does
            (``PendingRollout``; the run's: ``rayspec.scheduler.recovery.stop_reason``).
    """

    def __init__(self, handle, num_shards: int, by_group: bool = False,
                 stopped: Optional[Callable[[], Optional[str]]] = None):
        self.handle, self.num_shards, self.by_group, self.stopped = handle, num_shards, by_group, stopped

    def submit(self, prompt_ids: list[list[int]], seed: int | None = None,
               catch_up: Optional[Callable[[dict], dict]] = None, rows: Optional[list[dict]] = None,
               **kwargs: Any) -> PendingRollout:
        """Send the prompts to the replicas as request units; returns
        without waiting.

        Args:
            prompt_ids: token ids per prompt.
            seed: the rollout's seed: each prompt's samples draw from their
                own generators, seeded by it and the prompt's index
                (``SpecVLLMEngine.generate``), however the prompts are split
                (None: the replicas' own random streams).
            catch_up: see PendingRollout.
            rows: per prompt, its dataset row (multi-turn rollouts,
                ``SpecVLLMEngine.generate``), split with the prompts.
            kwargs: further ``SpecVLLMEngine.generate`` arguments (sampling,
                ``refits``, ``draft_acceptance``).
        """
        num_shards = len(prompt_ids) if self.by_group else max(1, min(self.num_shards, len(prompt_ids)))
        bounds = [round(i * len(prompt_ids) / num_shards) for i in range(num_shards + 1)]
        return PendingRollout(self.handle, [
            {"prompt_ids": prompt_ids[a:b], "group_offset": a,
             "seed": seed, **kwargs,
             **({"rows": rows[a:b]} if rows is not None else {})}
            for a, b in zip(bounds, bounds[1:]) if b > a], catch_up=catch_up, stopped=self.stopped)

    def generate(self, prompt_ids: list[list[int]], **kwargs: Any) -> tuple[RolloutBatch, SpecStats]:
        """``submit`` and wait: (RolloutBatch in input order, summed SpecStats)."""
        return self.submit(prompt_ids, **kwargs).result()

    def _broadcast(self, method: Callable, *args):
        """Start ``SpecVLLMEngine.<method>`` on every replica; the response's
        ``results()`` waits for them (none where no replica runs)."""
        return _Broadcast(self.handle.broadcast(method.__name__, *args))

    def sleep(self, level: int = 1) -> list[bool]:
        """Every replica releases its memory (``SpecVLLMEngine.sleep`` at
        ``level``); False where it cannot."""
        return self._broadcast(SpecVLLMEngine.sleep, level).results()

    def versions(self) -> list[dict[str, int]]:
        """Each replica's {"policy", "draft"} weight versions."""
        return self._broadcast(SpecVLLMEngine.versions).results()

    def busy_intervals(self, since: float) -> list[list[tuple[float, float]]]:
        """Each replica's engine work since ``since`` (epoch seconds)."""
        return self._broadcast(SpecVLLMEngine.busy_intervals, since).results()

    def node_and_gpu(self) -> list[tuple[str, Optional[str]]]:
        """Each replica's (Ray node id, physical GPU id or None)."""
        return self._broadcast(SpecVLLMEngine.node_and_gpu).results()

    # -- the weight transports' calls (rayspec.sync) --

    def receive_refit(self, target: str, weights, version: int):
        """Every replica loads ``target``'s weights (an ObjectRef) at ``version`` (object store)."""
        return self._broadcast(SpecVLLMEngine.receive_refit, target, weights, version)

    def receive_shared(self, target: str, files: list, version: int):
        """Every replica loads ``target``'s weights from files in /dev/shm
        at ``version`` (``SpecVLLMEngine.receive_shared``)."""
        return self._broadcast(SpecVLLMEngine.receive_shared, target, files, version)

    def receive_ipc(self, target: str, payload: dict, version: int):
        """Every replica loads ``target``'s weights from the Train ranks'
        exports at ``version`` (``SpecVLLMEngine.receive_ipc``)."""
        return self._broadcast(SpecVLLMEngine.receive_ipc, target, payload, version)

    def weight_sync_members(self) -> list[dict[str, Any]]:
        """Each replica's weight-sync membership (``SpecVLLMEngine.weight_sync_member``)."""
        return self._broadcast(SpecVLLMEngine.weight_sync_member).results()

    def running_replicas(self) -> int:
        """How many replicas Serve's controller sees running (``LocalReplicas``:
        its engines), asked of the controller, not of the replicas (one busy
        with a refit would answer after it)."""
        if isinstance(self.handle, LocalReplicas):
            return len(self.handle.engines)
        from ray import serve

        app = serve.status().applications.get(self.handle.app_name)
        deployment = app.deployments.get(self.handle.deployment_name) if app else None
        return deployment.replica_states.get("RUNNING", 0) if deployment else 0

    def join_weight_sync(self, *args):
        """Every replica joins a weight-sync group (``SpecVLLMEngine.join_weight_sync``)."""
        return self._broadcast(SpecVLLMEngine.join_weight_sync, *args)

    def receive_weights(self, *args):
        """Every replica receives a refit in the group (``SpecVLLMEngine.receive_weights``)."""
        return self._broadcast(SpecVLLMEngine.receive_weights, *args)


class _Broadcast:
    """A broadcast's response whose ``results()`` are empty where Serve has
    no replica running (it is replacing them all, e.g. after their node
    died; Serve raises ``DeploymentUnavailableError``): a refit then reaches
    nobody, and the replacements catch up on the newest weights before
    their first rollout (``refits``). A replica that dies during the call
    (its node died between Serve's listing and the answer) is left out of
    ``results()``; with ``return_exceptions`` its error is returned, as
    Serve does, for the refit's bookkeeping (``all_landed``)."""

    def __init__(self, response):
        self._response = response

    def results(self, return_exceptions: bool = False, **kwargs) -> list:
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            out = self._response.results(return_exceptions=True, **kwargs)
        except DeploymentUnavailableError:
            log.warning("no rollout replica is running (Serve is replacing them): nothing to call")
            return []
        if return_exceptions:
            return out
        dead = [r for r in out if isinstance(r, ray.exceptions.RayActorError)]
        if dead:
            log.warning("%d rollout replica(s) died during the call (%s): left out; Serve replaces them",
                        len(dead), type(dead[0]).__name__)
        for r in out:
            if isinstance(r, Exception) and r not in dead:
                raise r
        return [r for r in out if r not in dead]


class _Future:
    """A call running in a thread, answering as a Serve response does."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout_s: float | None = None):
        return self._future.result(timeout_s)  # concurrent.futures.TimeoutError is TimeoutError

    def cancel(self) -> None:
        self._future.cancel()


class _Responses:
    def __init__(self, futures: list[concurrent.futures.Future]):
        self._futures = futures

    def results(self, return_exceptions: bool = False) -> list:
        if return_exceptions:
            return [f.exception() or f.result() for f in self._futures]
        return [f.result() for f in self._futures]


class LocalReplicas:
    """Serve's handle over ``SpecVLLMEngine``s (or fakes of them) in this
    process, each call in its own thread as replicas run concurrently:
    ``generate.remote(**kw)`` goes to the engines in turn, ``broadcast`` to
    all. Drives a ``RolloutClient`` without Serve (the GPU smoke,
    benchmarks, tests).

    Args:
        engines: the replicas.
        max_ongoing_requests: request units in flight at once, over all
            engines (threads; Serve's per-replica limit, as a deployment's).
    """

    def __init__(self, engines: list, max_ongoing_requests: int = 64):
        self.engines = engines
        self._units = concurrent.futures.ThreadPoolExecutor(max_ongoing_requests,
                                                            thread_name_prefix="rayspec-local-unit")
        # broadcasts (refits) do not queue behind request units
        self._calls = concurrent.futures.ThreadPoolExecutor(max(2, 2 * len(engines)),
                                                            thread_name_prefix="rayspec-local-replica")
        turns = itertools.cycle(engines)

        class _Generate:
            @staticmethod
            def remote(**kw):
                return _Future(self._units.submit(next(turns).generate, **kw))

        self.generate = _Generate()

    def broadcast(self, method: str, *args) -> _Responses:
        return _Responses([self._calls.submit(getattr(e, method), *args) for e in self.engines])
