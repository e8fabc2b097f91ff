"""The DraftTrainer as the RL step sees it: one object for the draft head's
whole lifecycle in a run (whether it trains this step, the verifier's
features flowing to it, its result and refit, its checkpoint state, and its
death), and ``NullDraft`` with the same methods for runs without online
training, so the step never branches on the draft.

Every Train rank holds one: all of them submit features; rank 0 decides,
waits and refits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import ray

from rayspec.draft.state import restore_draft_state, stage_draft_state
from rayspec.draft.trainer import TrainingCadence

log = logging.getLogger(__name__)

DRAFT_TRAINER_NAME = "rayspec-draft-trainer"  # the actor's name in the run's namespace


class FeatureSink:
    """Where a rank's verifier features go during the policy update: the
    layers to capture and the DraftTrainer's ``submit_features``."""

    def __init__(self, actor, aux_layer_ids: list[int]):
        self.actor, self.aux_layer_ids = actor, aux_layer_ids

    def submit(self, ref, chunk: int) -> None:
        """Hand the DraftTrainer one micro-batch's features (an ObjectRef) as
        chunk ``chunk`` of the step (micro-batch-major over the ranks: the
        same order whatever the ranks' timing)."""
        self.actor.submit_features.remote([ref], [chunk])


class NullDraft:
    """No online draft training: nothing trains, nothing is sent, and the
    records hold no draft lifecycle fields."""

    alive = False  # a DraftTrainer answers
    version = 0  # the head's version the replicas hold
    acceptance: Optional[tuple] = None  # (version, rates, by share) the next rollouts carry

    def begin(self, rollout) -> bool:
        return False

    def start(self, policy, shard) -> Optional[FeatureSink]:
        return None

    def finish(self) -> dict[str, Any]:
        return {}

    def refit(self, coordinator, result: dict[str, Any]) -> None:
        pass

    def record(self, result: dict[str, Any], start: float, end: float) -> dict[str, Any]:
        return {}

    def stage(self, step: int):
        return None

    def restore(self):
        return None

    def send_weights(self, coordinator, version: int) -> bool:
        return False

    def reset(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"draft_version": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def node_and_gpu(self) -> list:
        return []


class DraftClient(NullDraft):
    """Online EAGLE-3 training through the DraftTrainer actor.

    Args:
        actor: the DraftTrainer's actor handle (``DRAFT_TRAINER_NAME``).
        ranks: this rank among the Train workers (``rayspec.train.ranks.Ranks``).
        aux_layer_ids: the verifier layers the head reads.
        steps_per_rl_step: the head's optimizer steps per RL step (0: it
            never trains, ``draft.steps_per_rl_step``).
        cadence: which steps train it (rank 0; ``TrainingCadence``).

    Attributes:
        alive: the actor answers (rank 0's view; a dead one is not called again).
        version: the head's version the replicas hold.
        acceptance: the DraftTrainer's last estimate (version, rates per
            position, by share), which the next rollouts carry to the replicas.
    """

    def __init__(self, actor, ranks, aux_layer_ids: list[int], steps_per_rl_step: int,
                 cadence: TrainingCadence):
        self.actor, self.ranks, self.aux_layer_ids = actor, ranks, aux_layer_ids
        self.steps_per_rl_step, self.cadence = steps_per_rl_step, cadence
        self.alive = True
        self.version = 0
        self.acceptance = None
        self._training = False  # this step trains the head
        self._alive_at_start = True  # rank 0: the DraftTrainer was alive when the step began
        self._call = None  # rank 0: the step's DraftTrainer.train call

    def begin(self, rollout) -> bool:
        """Whether this step trains the head (collective: rank 0 decides from
        the rollout's drafted share, ``TrainingCadence.due``; never once the
        DraftTrainer died)."""
        due = None
        if self.ranks.is_driver:
            self._alive_at_start = self.alive
            due = self.alive and self.steps_per_rl_step > 0 and self.cadence.due(rollout.stats.drafted_share)
        self._training = bool(self.ranks.broadcast(due))
        return self._training

    def start(self, policy, shard) -> Optional[FeatureSink]:
        """Start the head's training beside the policy update (collective):
        rank 0 sends the verifier's output layer before the update (the
        features come from it) and the DraftTrainer then trains on each
        micro-batch's features as they come. Returns where this rank's
        features go, or None where the head does not train this step."""
        if not self._training:
            return None
        verifier = policy.output_weights()
        if self.ranks.is_driver:
            self._call = self.actor.train.remote(ray.put(verifier), self.steps_per_rl_step,
                                                 expect=policy.feature_chunks(shard))
        return FeatureSink(self.actor, self.aux_layer_ids)

    def finish(self) -> dict[str, Any]:
        """Rank 0: wait for the step's training; returns its result ({} where
        it did not train or the DraftTrainer died meanwhile)."""
        call, self._call = self._call, None
        if call is None:
            return {}
        try:
            result = ray.get(call)
        except ray.exceptions.RayActorError as e:
            self._died("this step", e)
            return {}
        self.version = result["draft_version"]
        self.cadence.trained(result["draft_acceptance_estimate"], result["draft_acceptance_se"],
                             result["draft_acceptance_clusters"])
        # replayed with the head the step began with; it goes out with the newer head
        # (the replicas' measured / estimated calibration absorbs the difference)
        self.acceptance = (self.version, result["draft_acceptance_estimate"], result["draft_acceptance_by_share"])
        return result

    def refit(self, coordinator, result: dict[str, Any]) -> None:
        """Send the head the step trained to the replicas (rank 0)."""
        if result:
            coordinator.refit("draft", ray.get(self.actor.vllm_weights.remote()), self.version)

    def record(self, result: dict[str, Any], start: float, end: float) -> dict[str, Any]:
        """The step record's lifecycle fields: ``draft_alive``, and where the
        DraftTrainer was alive at the step's start ``draft_trained`` and
        ``idle_draft_s`` (seconds of [start, end] it was not training)."""
        out = {"draft_alive": int(self.alive)}
        if self._alive_at_start:
            busy = max(0.0, min(result["end_time"], end) - max(result["start_time"], start)) if result else 0.0
            out.update(draft_trained=int(self._training), idle_draft_s=max(0.0, (end - start) - busy))
        return out

    def stage(self, step: int):
        """What a checkpoint after ``step`` calls to write the DraftTrainer's
        state into its staging directory (rank 0), or None once it died."""
        if not (self.ranks.is_driver and self.alive):
            return None

        def stage_draft(d: Path) -> None:
            try:
                stage_draft_state(self.actor, d)
            except ray.exceptions.RayActorError as e:
                self._died(f"step {step}", e)

        return stage_draft

    def restore(self):
        """What a resume calls with a checkpoint directory holding draft state
        (rank 0): loads it into the DraftTrainer, returns its version."""
        if not self.ranks.is_driver:
            return None

        def restore_draft(d: Path, state: dict[str, Any]) -> int | None:
            try:
                return restore_draft_state(self.actor, d)
            except ray.exceptions.RayActorError as e:
                self._died(f"step {state['step']}", e)

        return restore_draft

    def send_weights(self, coordinator, version: int) -> bool:
        """Rank 0: send the DraftTrainer's head to the replicas as ``version``
        (a resume, or a reset); False where it died."""
        if not self.alive:
            return False
        try:
            self.version = version
            coordinator.refit("draft", ray.get(self.actor.vllm_weights.remote()), version)
            return True
        except ray.exceptions.RayActorError as e:
            self._died("a refit", e)
            return False

    def reset(self) -> bool:
        """Rank 0: back to the initial head (``DraftTrainer.reset``); True
        where it had trained."""
        if not self.alive:
            return False
        try:
            return bool(ray.get(self.actor.reset.remote()))
        except ray.exceptions.RayActorError as e:
            self._died("the start", e)
            return False

    def state_dict(self) -> dict[str, Any]:
        return {"draft_version": self.version, "draft_cadence": self.cadence.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = state.get("draft_version", 0)
        if "draft_cadence" in state:  # absent from checkpoints written before the cadence
            self.cadence.load_state_dict(state["draft_cadence"])

    def node_and_gpu(self) -> list:
        """[(node id, GPU id or None)] of the DraftTrainer, or [] where it died."""
        if not self.alive:
            return []
        try:
            return [ray.get(self.actor.node_and_gpu.remote())]
        except ray.exceptions.RayActorError:
            return []  # the first step finds it dead and goes on without it

    def _died(self, when: str, err: Exception) -> None:
        """The DraftTrainer is gone: the run goes on with the head the replicas hold."""
        self.alive = False
        log.warning("%s: the DraftTrainer died (%s); the run continues with draft head version %d on the "
                    "replicas, no longer trained (checkpoints from now on hold no draft state)",
                    when, type(err).__name__, self.version)


def find_draft_trainer(ranks, online: bool):
    """The DraftTrainer's actor handle on every rank, or None on every rank
    where the run trains no draft online or the DraftTrainer died before
    these Train workers started (a worker group restarted after a failure:
    the run goes on with the head the replicas hold). Collective: the ranks
    agree, since each one submits features to it.

    Returns:
        (handle or None, whether it was lost: online but gone).
    """
    if not online:
        return None, False
    try:
        handle = ray.get_actor(DRAFT_TRAINER_NAME)
    except ValueError:  # a dead actor (max_restarts 0) leaves the name registry
        handle = None
    if all(ranks.all_gather(handle is not None)):
        return handle, False
    if ranks.is_driver:
        log.warning("the DraftTrainer is gone (it died before these Train workers started); the run "
                    "continues with the draft head on the replicas, no longer trained")
    return None, True
