"""When rollouts run relative to the policy update: sync, or async with a
bounded policy lag.

Policy versions count optimizer steps: the trainer at RL step t holds version
t-1 and produces version t. A batch's policy lag is the trainer's version when
it trains on the batch minus the version that sampled it.

- sync (lag 0): step t's batch is sampled after step t-1's weight sync.
- async (lag <= max_policy_lag): up to ``max_policy_lag`` batches are
  generating ahead on the replicas, with the weights they hold, while the
  trainer works on the current one (one-step off-policy RL as in AReaL /
  NeMo-RL async GRPO). The trainer corrects for the lag with the importance
  ratio against the rollout (behaviour) logprobs: the PPO clipped surrogate
  (Schulman et al. 2017) with pi_old = the behaviour policy, i.e. the
  "decoupled" objective with the proximal policy set to the behaviour policy
  (Hilton et al. 2022, arXiv 2110.00641); see ``rayspec.train.grpo``.

Weight syncs (refits) are sent without waiting: a refit reaches a replica
while it is still generating an older-version batch and waits for it there
(the engine's lock). Before a new batch is submitted every pending refit has
landed, so each new batch samples the newest policy the trainer has sent.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import ray

log = logging.getLogger(__name__)


class PolicyLagError(RuntimeError):
    """A batch would train with more policy lag than ``max_policy_lag`` allows."""


class RolloutPipeline:
    """Rank 0's rollout queue across RL steps.

    Args:
        submit: starts one batch on the replicas and returns
            ``(pending, extra)``: ``pending.result()`` gives
            ``(RolloutBatch, SpecStats)``; ``extra`` travels with it (the
            batch's prompts).
        max_policy_lag: 0 for sync; async keeps this many batches in flight
            ahead of the one being trained.
        last_version: the trainer version of the run's last step
            (``trainer.steps`` - 1): no batch is generated ahead for a step
            past it (None: no end).
    """

    def __init__(self, submit: Callable[[], tuple[Any, Any]], max_policy_lag: int,
                 last_version: int | None = None):
        self._submit = submit
        self.max_policy_lag = max_policy_lag
        self.last_version = last_version
        self._ahead: collections.deque = collections.deque()
        self._refits: list = []
        self.last_retries = 0  # shards of the last batch retried after their replica died

    def refit(self, refit) -> None:
        """Track a refit sent to the replicas (anything with ``results()``
        that returns once it has landed: ``rayspec.sync.transport.Refit``)."""
        self._refits.append(refit)

    def wait_refits(self) -> float:
        """Wait until every pending refit has landed; returns seconds waited.
        A replica that died meanwhile is skipped: the one Serve starts in its
        place loads the newest weights before its first rollout (``refits``
        of ``SpecVLLMEngine.generate``).

        Raises:
            Whatever a live replica raised while loading the weights.
        """
        t0 = time.perf_counter()
        refits, self._refits = self._refits, []
        for r in refits:
            try:
                r.results()
            except ray.exceptions.RayActorError as e:
                log.warning("a rollout replica died during a weight sync (%s); its replacement "
                            "catches up before generating", type(e).__name__)
        return time.perf_counter() - t0

    def next(self, trainer_version: int):
        """The batch to train at ``trainer_version``, after topping up the
        batches generating ahead (up to ``max_policy_lag``, none for steps
        past ``last_version``).

        Returns:
            (RolloutBatch, SpecStats, extra, policy lag in versions).

        Raises:
            PolicyLagError: the batch is older than ``max_policy_lag`` allows
                (or newer than the trainer).
        """
        self.wait_refits()
        if not self._ahead:
            self._ahead.append(self._submit())
        pending, extra = self._ahead[0]
        batch, stats = pending.result()
        self._ahead.popleft()  # not before: a batch that failed is still ahead (a checkpoint's cursor is before it)
        self.last_retries = getattr(pending, "retries", 0)
        lag = trainer_version - batch.policy_version
        if not 0 <= lag <= self.max_policy_lag:
            raise PolicyLagError(
                f"batch sampled by policy version {batch.policy_version} would train at version "
                f"{trainer_version}: lag {lag}, allowed 0..{self.max_policy_lag}")
        ahead = self.max_policy_lag
        if self.last_version is not None:
            ahead = min(ahead, self.last_version - trainer_version)
        while len(self._ahead) < ahead:
            self._ahead.append(self._submit())
        return batch, stats, extra, lag

    def ahead(self) -> list:
        """The ``extra`` of each batch generating ahead, oldest first."""
        return [extra for _, extra in self._ahead]

    def close(self) -> None:
        """End of run: cancel the batches generated ahead (nothing will train
        on them) and stop tracking refits still queued behind them (the
        trained policy is saved from the trainer, not the replicas)."""
        while self._ahead:
            self._ahead.popleft()[0].cancel()
        self._refits = []
