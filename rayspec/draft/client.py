"""The DraftTrainer as the RL step sees it: one object for the draft head's
whole lifecycle in a run (whether it trains this step, where the verifier's
features go, the step's result and the head to send at the refit, its
checkpoint state, and its death), and ``NullDraft`` with the same methods for
runs without online training, so the step never branches on the draft.

Every Train rank holds one: all of them submit features; rank 0 decides,
waits and fetches the head. The client never calls the policy or the
replicas: the policy update is handed a ``FeatureSink``, and the step's
refit takes the head from the ``DraftStep`` that ``finish`` returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import ray
import torch

from rayspec.draft.state import DRAFT_FILES, restore_draft_state, stage_draft_state
from rayspec.draft.trainer import TrainingCadence
from rayspec.files import checkpoint_files

log = logging.getLogger(__name__)

DRAFT_TRAINER_NAME = "rayspec-draft-trainer"  # the actor's name in the run's namespace
RESTART_WAIT_S = 120.0  # how long a step's start waits for a restarting DraftTrainer (then: the next step)


class FeatureSink:
    """Where one rank's verifier features go during a step's policy update,
    where the head trains that step (``DraftClient.begin``).

    The update ``start``s it with the verifier's output layer, then
    ``submit``s each micro-batch's features; the sink keeps this rank's
    feature ObjectRefs alive until ``DraftClient.finish`` (the DraftTrainer
    reads them while the update runs and after).

    Args:
        actor: the DraftTrainer's actor handle.
        aux_layer_ids: the verifier layers to capture.
        rows: rank 0: the draft vocabulary's token ids ([N] int64, draft
            order), the rows of the verifier's output layer the head needs;
            None on the other ranks.
        steps: the head's optimizer steps this RL step.
    """

    def __init__(self, actor, aux_layer_ids: list[int], rows: Optional[torch.Tensor], steps: int):
        self.actor, self.aux_layer_ids, self.rows, self.steps = actor, aux_layer_ids, rows, steps
        self.call = None  # rank 0: the DraftTrainer's train call (an ObjectRef of its result)
        self.refs: list = []  # this rank's feature ObjectRefs (owned here: alive while held)

    def start(self, verifier: Optional[dict[str, torch.Tensor]], chunks: int) -> None:
        """Start the DraftTrainer's training before the first micro-batch:
        on rank 0, which gives ``verifier``
        (``rayspec.train.policy.verifier_output_weights``: the embedding and
        the output layer's ``rows``, bf16 host tensors), with the step's
        ``chunks`` (every rank's micro-batches), which it trains on as they
        come; the other ranks pass None and start nothing."""
        if verifier is not None:
            self.call = self.actor.train.remote(ray.put(verifier), self.steps, expect=chunks)

    def submit(self, ref, chunk: int) -> None:
        """Hand the DraftTrainer one micro-batch's features (an ObjectRef) as
        chunk ``chunk`` of the step (micro-batch-major over the ranks: the
        same order whatever the ranks' timing)."""
        self.refs.append(ref)
        self.actor.submit_features.remote([ref], [chunk])


@dataclass
class HeadWeights:
    """A draft head to send to the replicas: vLLM-named host tensors, as ``version``."""

    version: int
    weights: dict[str, torch.Tensor]


@dataclass
class DraftStep:
    """The draft head's part of one RL step, as the refit and the step record take it.

    Attributes:
        version: the head's version the replicas hold once the step's refit landed.
        result: the DraftTrainer's ``train`` result ({} where the head did
            not train this step, or the DraftTrainer died meanwhile).
        head: the head the refit sends (rank 0), or None: nothing to send.
        fields: the record's lifecycle keys (``DraftClient.finish``).
        busy: [(start, end)] epoch seconds the DraftTrainer trained during
            the step, or None where none was alive at its start (the record
            then has no ``idle_draft_s``).
    """

    version: int = 0
    result: dict[str, Any] = field(default_factory=dict)
    head: Optional[HeadWeights] = None
    fields: dict[str, Any] = field(default_factory=dict)
    busy: Optional[list[tuple[float, float]]] = None


class NullDraft:
    """No online draft training: nothing trains, nothing is sent, and the
    records hold no draft lifecycle fields."""

    alive = False  # a DraftTrainer answers
    version = 0  # the head's version the replicas hold
    acceptance: Optional[tuple] = None  # (version, rates, by share) the next rollouts carry

    def begin(self, rollout) -> Optional[FeatureSink]:
        return None

    def finish(self) -> DraftStep:
        return DraftStep()

    def head(self, version: Optional[int]) -> Optional[HeadWeights]:
        return None

    def stage(self, step: int):
        return None

    def restore(self):
        return None

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

    Ray restarts a DraftTrainer that dies (``draft.max_restarts``). At each
    step's start rank 0 asks it for its incarnation. A new one means a
    restart, whether or not a call failed: the step restores it from the
    draft state of the newest checkpoint that has one (else it keeps its
    initial head); where that is not the head the replicas hold, it numbers
    it past their version and sends it to them at the step's refit. Only
    once Ray gives up does the run go on with the replicas' head, no longer
    trained; that is logged once, as an error.

    Args:
        actor: the DraftTrainer's actor handle (``DRAFT_TRAINER_NAME``).
        ranks: this rank among the Train workers (``rayspec.train.ranks.Ranks``).
        aux_layer_ids: the verifier layers the head reads.
        steps_per_rl_step: the head's optimizer steps per RL step (0: it
            never trains, ``draft.steps_per_rl_step``).
        cadence: which steps train it (rank 0; ``TrainingCadence``).
        checkpoints: lists the run's checkpoints (``ray.train.Checkpoint``),
            oldest first (where a restarted DraftTrainer is restored from).

    Attributes:
        alive: the actor answers (rank 0's view).
        version: the head's version the replicas hold.
        acceptance: the DraftTrainer's last estimate (version, rates per
            position, by share), which the next rollouts carry to the replicas.
        restarts: restarts taken over in the run.
        versions_lost: head updates those restarts lost (trained after the
            checkpoint each was restored from).
        estimate: (the DraftTrainer's last estimate of the head's acceptance
            length on a step's rollouts, steps since it was made), carried
            through the steps where the head does not train; None before the
            first.
    """

    def __init__(self, actor, ranks, aux_layer_ids: list[int], steps_per_rl_step: int,
                 cadence: TrainingCadence, checkpoints: Callable[[], list] = list):
        self.actor, self.ranks, self.aux_layer_ids = actor, ranks, aux_layer_ids
        self.steps_per_rl_step, self.cadence = steps_per_rl_step, cadence
        self.checkpoints = checkpoints
        self.alive = True
        self.version = 0
        self.acceptance = None
        self.restarts = self.versions_lost = 0
        self.estimate: Optional[tuple[float, int]] = None
        self._incarnation = None  # rank 0: the DraftTrainer start this client works with
        self._given_up = False  # Ray will not restart it again
        self._resend = False  # rank 0: a restored head the replicas have yet to get
        self._training = False  # this step trains the head
        self._alive_at_start = True  # rank 0: the DraftTrainer was alive when the step began
        self._sink: Optional[FeatureSink] = None  # where this step's features go, while the head trains
        self._ids = None  # rank 0: (DraftTrainer.draft_ids(),) once asked (_check_incarnation)

    def connect(self) -> None:
        """As the Train workers start, rank 0 notes the DraftTrainer's
        incarnation (one that does not answer is taken over at a step's
        start, ``begin``); nothing on the other ranks."""
        if not self.ranks.is_driver:
            return
        try:
            self._incarnation = ray.get(self.actor.incarnation.remote(), timeout=RESTART_WAIT_S)[0]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._died("the start", e)

    def lost(self) -> None:
        """The DraftTrainer died for good before these Train workers started."""
        self.alive, self._given_up = False, True

    def begin(self, rollout) -> Optional[FeatureSink]:
        """Where this rank's verifier features go this step, or None where
        the head does not train (collective: rank 0 decides from the
        rollout's drafted share, ``TrainingCadence.due``, after taking over a
        DraftTrainer Ray restarted; never while it is dead)."""
        due = None
        if self.ranks.is_driver:
            if not self._given_up:
                self._check_incarnation()
            self._alive_at_start = self.alive
            due = self.alive and self.steps_per_rl_step > 0 and self.cadence.due(rollout.stats.drafted_share)
        self._training = bool(self.ranks.broadcast(due))
        # rank 0: the draft vocabulary's rows (asked with the incarnation, _check_incarnation)
        rows = self._ids[0] if self.ranks.is_driver and self._training else None
        self._sink = FeatureSink(self.actor, self.aux_layer_ids, rows, self.steps_per_rl_step) \
            if self._training else None
        return self._sink

    def _check_incarnation(self) -> None:
        deadline = time.monotonic() + RESTART_WAIT_S
        try:
            while True:
                try:
                    incarnation, _ = ray.get(self.actor.incarnation.remote(),
                                             timeout=max(0.1, deadline - time.monotonic()))
                    if self._ids is None:  # head_dir's vocabulary: the same after a restart
                        self._ids = (ray.get(self.actor.draft_ids.remote(),
                                             timeout=max(0.1, deadline - time.monotonic())),)
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting
                    if time.monotonic() > deadline:
                        raise ray.exceptions.GetTimeoutError() from None
                    time.sleep(0.5)
        except ray.exceptions.GetTimeoutError:
            self.alive = False  # still restarting: the next step asks again
            log.warning("the DraftTrainer did not answer within %.0f s: the head does not train this step",
                        RESTART_WAIT_S)
            return
        except ray.exceptions.RayActorError as e:
            self.alive, self._given_up = False, True
            log.error("the DraftTrainer is dead and Ray will not restart it again (draft.max_restarts; %s): "
                      "the run continues with draft head version %d on the replicas, NO LONGER TRAINED, and "
                      "checkpoints from now on hold no draft state (restarts taken over: %d)",
                      type(e).__name__, self.version, self.restarts)
            return
        if incarnation != self._incarnation:
            self._rejoin(incarnation)
        else:
            self.alive = True

    def _rejoin(self, incarnation: str) -> None:
        """Take over a DraftTrainer Ray restarted (rank 0)."""
        held, restored, source = self.version, 0, "its initial head (no checkpoint has a readable draft state)"
        try:
            found = self.checkpoints()
        except (OSError, ValueError) as e:  # an unreadable checkpoint snapshot, storage out of reach
            log.warning("the run's checkpoints cannot be listed (%s)", e)
            found = []
        try:
            for c in reversed(found):
                try:
                    with checkpoint_files(c, DRAFT_FILES) as d:  # None: one without draft state
                        if d is not None:
                            restored, source = restore_draft_state(self.actor, d), c.path
                            break
                except (ray.exceptions.RayTaskError, OSError, ValueError) as e:  # e.g. a half-written file
                    log.warning("the draft state in %s does not load (%s); trying an older checkpoint", c.path,
                                type(e).__name__)
                    ray.get(self.actor.reset.remote())  # nothing half-loaded stays
            if restored != held:  # another head than the replicas': a new version for them
                self.version = ray.get(self.actor.set_version.remote(held + 1))
        except ray.exceptions.RayActorError as e:
            self._died("its restart", e)
            return
        self.restarts += 1
        self.versions_lost += max(0, held - restored)
        self._incarnation, self.alive, self._resend = incarnation, True, restored != held
        if restored != held:
            self.acceptance = None
        log.warning("the DraftTrainer was restarted (restart %d in the run): restored from %s (draft version "
                    "%d; the %d update(s) after it are lost)%s", self.restarts, source, restored,
                    max(0, held - restored), f", sent to the replicas as version {self.version}" if self._resend
                    else ": the head the replicas hold")

    def finish(self) -> DraftStep:
        """The head's part of the step (collective where it trained: rank 0
        waits for the DraftTrainer's result, and every rank keeps its feature
        ObjectRefs until then). Rank 0 fetches the head the step trained, or
        a restarted DraftTrainer's restored one, for the refit (``head``).

        ``fields`` holds ``draft_alive``, ``draft_restarts`` and
        ``draft_versions_lost`` (so far in the run),
        ``draft_acceptance_length_estimate`` and ``draft_estimate_age`` (the
        last estimate of the head's acceptance length, 1 + the sum of its
        per-position rates, and the steps since: 0 where this step made it;
        absent before the first), and where the DraftTrainer was alive at the
        step's start ``draft_trained``; ``busy`` then says when it trained.
        """
        sink, self._sink = self._sink, None
        result = {}
        if sink is not None:
            result = self._result(sink.call) if sink.call is not None else {}
            self.ranks.barrier()  # the DraftTrainer has read every rank's features (sink.refs) by now
        head = self._fetch_head(self.version, "the refit") if (result or self._resend) and self.alive else None
        if head is not None:
            self._resend = False
        rates = result.get("draft_acceptance_estimate")
        if rates:
            self.estimate = (1.0 + sum(rates), 0)
        elif self.estimate is not None:
            self.estimate = (self.estimate[0], self.estimate[1] + 1)
        fields = {"draft_alive": int(self.alive), "draft_restarts": self.restarts,
                  "draft_versions_lost": self.versions_lost}
        if self.estimate is not None:
            fields.update(draft_acceptance_length_estimate=self.estimate[0], draft_estimate_age=self.estimate[1])
        busy = None
        if self._alive_at_start:
            fields["draft_trained"] = int(self._training)
            busy = [(result["start_time"], result["end_time"])] if result else []
        return DraftStep(self.version, result, head, fields, busy)

    def _result(self, call) -> dict[str, Any]:
        """Rank 0: the step's training result ({} where the DraftTrainer died meanwhile)."""
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

    def _fetch_head(self, version: int, when: str) -> Optional[HeadWeights]:
        """Rank 0: the DraftTrainer's head as ``version``, or None where it died."""
        try:
            return HeadWeights(version, ray.get(self.actor.vllm_weights.remote()))
        except ray.exceptions.RayActorError as e:
            self._died(when, e)
            return None

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

    def head(self, version: Optional[int]) -> Optional[HeadWeights]:
        """Rank 0: the DraftTrainer's head, numbered ``version`` from now on,
        for a refit outside the steps (a resume, a reset); None where
        ``version`` is None (a checkpoint without draft state), the
        DraftTrainer died, or on the other ranks."""
        if version is None or not (self.ranks.is_driver and self.alive):
            return None
        self.version = version
        return self._fetch_head(version, "a refit")

    def reset(self) -> bool:
        """Rank 0: back to the initial head (``DraftTrainer.reset``); True
        where it had trained. False on the other ranks."""
        if not (self.ranks.is_driver and self.alive):
            return False
        try:
            return bool(ray.get(self.actor.reset.remote()))
        except ray.exceptions.RayActorError as e:
            self._died("the start", e)
            return False

    def state_dict(self) -> dict[str, Any]:
        return {"draft_version": self.version, "draft_cadence": self.cadence.state_dict(),
                "draft_restarts": self.restarts, "draft_versions_lost": self.versions_lost,
                "draft_estimate": self.estimate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = state.get("draft_version", 0)
        self.restarts = state.get("draft_restarts", 0)
        self.versions_lost = state.get("draft_versions_lost", 0)
        estimate = state.get("draft_estimate")  # absent from checkpoints before it was carried
        self.estimate = tuple(estimate) if estimate else None
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
        """The DraftTrainer died: the run goes on with the head the replicas
        hold until a restart rejoins (``begin``)."""
        self.alive = False
        log.warning("%s: the DraftTrainer died (%s); draft head version %d stays on the replicas, untrained, "
                    "until Ray restarts it (draft.max_restarts) and a step's start restores it",
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
