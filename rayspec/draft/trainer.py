"""DraftTrainer: online EAGLE-3 training on the verifier's features.

A Ray actor with its own resources. Train workers ``ray.put`` the detached
verifier features of each policy micro-batch and hand the ObjectRefs over as
they are made; the trainer fetches them from the object store itself, so the
policy never gets a gradient from the draft and the driver never holds the
tensors. Run as a threaded actor (``max_concurrency=2``), ``train`` consumes
features while the policy update is still producing them: the draft trains
beside the policy update, not after it.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import queue
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import torch

from rayspec.config import DEFAULT_DRAFT_LR, DEFAULT_DRAFT_SAMPLE_METHOD
from rayspec.devices import to_device, to_host, trim_host_heap
from rayspec.draft.eagle3 import Eagle3Head, load_head, save_head, vllm_state_dict
from rayspec.draft.loss import (FEATURE_KEYS, acceptance_by_share, acceptance_length_se, draft_overlap, draft_top1,
                                drafting_clusters, drafting_counts, eagle3_loss, greedy_hits, replay_chains,
                                sampled_hits, verifier_targets)
from rayspec.models.acceptance import ACCEPTANCE_FILE, acceptance_record, read_acceptance
from rayspec.rollout.adaptive import expected_tokens, extrapolate_rates
from rayspec.draft.state import load_draft_state, save_draft_state


def recorded_acceptance_length(head_dir, draft_sample_method: str, k: int) -> float | None:
    """Acceptance length (tokens per verification step) at k drafts of the
    rates recorded beside a head (``models.acceptance.read_acceptance``: None where
    there are none for drafts of ``draft_sample_method``), continued past the
    measured positions geometrically (``adaptive.extrapolate_rates``)."""
    rates = read_acceptance(head_dir, draft_sample_method)
    return expected_tokens(extrapolate_rates(rates, k), k) if rates else None


def online_lr(lr: float | None, head_dir, trained: bool) -> tuple[float, str]:
    """The DraftTrainer's AdamW learning rate and why (for the log).

    ``lr`` (``draft.lr``) where set. Else a fresh head (one the run created)
    learns at ``DEFAULT_DRAFT_LR``, and a ``trained`` one (given as
    ``rollout.speculative_config.model``) continues at the rate its warm
    start ended at (``final_lr`` in its acceptance record, written by
    ``jobs.warmstart_draft``), or at 0.1 x ``DEFAULT_DRAFT_LR`` without one:
    AdamW's first steps from fresh moments move every weight by about the
    learning rate, which at the fresh head's rate undoes a converged head's
    fine structure (one RL step at 1e-3 cost the warm GSM8K head 0.10 of
    acceptance length on unseen responses, 1e-4 and 1e-5 kept it:
    docs/benchmarks.md, "Online training at draft.lr 1e-3").

    Raises:
        ValueError: the record's ``final_lr`` is not a number > 0 (the file
            is named), or the record is not JSON.
    """
    if lr is not None:
        return float(lr), "draft.lr"
    if not trained:
        return DEFAULT_DRAFT_LR, "a fresh head (draft.lr null)"
    final = (acceptance_record(head_dir) or {}).get("final_lr")
    if final is None:
        return 0.1 * DEFAULT_DRAFT_LR, "a trained head without a recorded final_lr (draft.lr null)"
    if not isinstance(final, (int, float)) or isinstance(final, bool) or not final > 0:
        raise ValueError(f"{Path(head_dir) / ACCEPTANCE_FILE}: final_lr must be a number > 0, got {final!r}")
    return float(final), f"the rate its warm start ended at ({Path(head_dir) / ACCEPTANCE_FILE} final_lr)"


class DraftTrainer:
    """Trains one EAGLE-3 head with AdamW.

    Args:
        head_dir: initial checkpoint (``save_head`` format).
        lr: AdamW learning rate.
        ttt_steps: training-time-test unroll depth.
        num_threads: torch intra-op threads of this actor.
        buffer_steps: RL steps of features kept for replay; the newest step's
            features are always trained on, older ones fill the remaining
            optimizer steps (the policy drifts slowly, so recent features stay
            informative and each step's features are used more than once).
        seed: order of replayed chunks.
        cores: CPU cores to pin this actor's threads to (the placement
            plan's cores for the draft role), or None.
        device: where the head trains (``cuda`` where the actor was given a
            GPU: Ray's CUDA_VISIBLE_DEVICES makes it ``cuda:0``). Features
            and the verifier's weights arrive as host tensors and are moved
            here; everything this actor returns is host memory.
        num_speculative_tokens: the replicas' k: ``train`` then replays their
            drafting on each RL step's rollouts (``loss.replay_chains``) to
            estimate the head's acceptance, for adaptive k. None: no estimate.
        draft_sample_method: the replicas' (vLLM's key): ``greedy`` drafts
            replay exactly (``loss.greedy_hits``), ``probabilistic`` ones by
            one draw of each draft's acceptance probability
            (``loss.draft_overlap``, ``loss.sampled_hits``).
        temperature: the rollouts' sampling temperature (0: greedy rollouts,
            where sampled drafts are the greedy ones).
        tv_loss_weight: weight of the total-variation term of
            ``eagle3_loss`` (``draft.tv_loss_weight``).
    """

    def __init__(self, head_dir: str, lr: float, ttt_steps: int, num_threads: int = 1,
                 buffer_steps: int = 1, seed: int = 0, cores: list[int] | None = None,
                 device: str = "cpu", num_speculative_tokens: int | None = None,
                 draft_sample_method: str = DEFAULT_DRAFT_SAMPLE_METHOD, temperature: float = 1.0,
                 tv_loss_weight: float = 0.0):
        from rayspec.relay import relay_warnings

        relay_warnings()  # as an actor, its warnings reach the driver's console
        if cores:
            os.sched_setaffinity(0, cores)
            num_threads = min(num_threads, len(cores))
        torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.ttt_steps = ttt_steps
        self.tv_loss_weight = tv_loss_weight
        self.num_speculative_tokens = num_speculative_tokens
        self.sampled_drafts = draft_sample_method == "probabilistic" and temperature > 0
        self.temperature = temperature
        self._head_dir, self._lr, self._seed = head_dir, lr, seed
        self._pending: queue.Queue = queue.Queue()
        self._buffer: collections.deque = collections.deque(maxlen=max(1, buffer_steps))
        self._lock = threading.Lock()  # optimizer steps vs. get_state / set_state / reset
        # a new id each time Ray (re)starts the actor: a client that sees it change knows the
        # head went back to head_dir's, whatever calls succeeded since (draft.max_restarts)
        self._incarnation = uuid.uuid4().hex
        self._adopted = False  # set_state / set_version on this incarnation
        self._start()

    def _start(self) -> None:
        """The initial state: ``head_dir``'s head, fresh AdamW moments, an
        empty replay buffer, the replay RNG at ``seed``, version 0."""
        self.head: Eagle3Head = load_head(self._head_dir).to(self.device)
        # The output layer is the verifier's (its draft-vocabulary rows), frozen
        # and refreshed each step: with the full vocabulary vLLM drafts with
        # the verifier's own lm_head when the head's equals it at start
        # (init_head copies it), so a separately trained one would not be what
        # the replicas draft with; a reduced one is refit with the head.
        self.head.lm_head.weight.requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad],
                                     lr=self._lr, weight_decay=0.0)
        self._buffer.clear()
        self._rng = random.Random(self._seed)
        self.version = 0

    def _abandon_pending(self) -> None:
        """Drop queued features and wake a ``train`` call waiting for more
        (it raises): they belong to an attempt that failed."""
        stale, self._pending = self._pending, queue.Queue()
        stale.put(_ABANDONED)

    def reset(self) -> int:
        """Back to the initial state (``head_dir``'s head, fresh AdamW
        state, empty replay buffer, version 0): the Train workers restarted
        before the run's first checkpoint, so the run starts over from step
        1 and must train the head as the first attempt did. ``head_dir``
        holds the initial head until the run ends (the driver saves the
        trained one there after ``fit``). Queued features and a waiting
        ``train`` call are abandoned. Returns the version the head had (0:
        it had not trained)."""
        with self._lock:
            had = self.version
            self._abandon_pending()
            self._start()
        return had

    def incarnation(self) -> tuple[str, bool]:
        """(an id of this start of the actor, a restart by Ray gives a new
        one; whether a client took this start over: ``set_state`` or
        ``set_version`` ran on it)."""
        return self._incarnation, self._adopted

    def set_version(self, version: int) -> int:
        """Number the head's next update ``version + 1`` (a client that
        restored this restarted actor from an older checkpoint keeps
        versions increasing past what the replicas held); returns it."""
        with self._lock:
            self.version = int(version)
            self._adopted = True
        return self.version

    def draft_ids(self) -> torch.Tensor | None:
        """[N] int64 token ids of the head's draft vocabulary, in draft order
        (host memory; None: the policy's whole vocabulary): the output
        layer's rows ``train`` takes (``lm_head_rows``)."""
        ids = self.head.draft_ids
        return None if ids is None else ids.cpu()

    def submit_features(self, feature_refs: list, indices: list[int] | None = None) -> int:
        """Queue features for the (running or next) ``train`` call; returns the queue length.

        Args:
            feature_refs: ObjectRefs (or dicts) of features, each a dict with
                input_ids [B, L], aux_hidden [B, L, 3H], final_hidden [B, L, H],
                loss_mask [B, L-1] (see ``eagle3_loss``), the verifier's
                normalisers at T = 1 and, with sampled drafts, at
                ``temperature`` (``loss.verifier_normalizers``), and
                optionally group [B] int64 (GRPO group ids: the clusters of
                the estimate's standard error). Passing them through
                an actor call keeps Ray's ownership tracking intact.
            indices: each chunk's place in the RL step's order (micro-batch *
                world size + rank): ``train`` uses the chunks in this order,
                whatever order the ranks deliver them in, so draft training
                repeats exactly. None: arrival order.
        """
        for j, r in enumerate(feature_refs):
            self._pending.put((None if indices is None else indices[j], r))
        return self._pending.qsize()

    def train(self, verifier_ref, steps: int, expect: int | None = None,
              timeout_s: float = 600.0) -> dict[str, Any]:
        """Run ``steps`` optimizer steps on this RL step's features, then replay.

        Args:
            verifier_ref: ObjectRef (or dict) of the verifier that produced
                the features (``rayspec.train.policy.verifier_output_weights``):
                ``embed`` [V, H] and ``lm_head_rows`` [N, H], its output
                layer's rows of this head's draft vocabulary
                (``draft_ids``), bf16; without ``lm_head_rows`` (tied
                embeddings) the rows are taken from ``embed``.
            steps: optimizer steps, one feature chunk (micro-batch) each:
                this step's chunks first, in the step's order (the indices
                of ``submit_features``), then replayed ones (older steps'
                shuffled, then this step's), cycling.
            expect: chunks this RL step delivers (all ranks' micro-batches);
                the call waits for them as they arrive, so it can start before
                the policy update. None: the chunks queued so far.
            timeout_s: longest wait for one chunk (seconds).

        Returns:
            {"draft_loss", "draft_top1_per_step" (list), "draft_version",
            "draft_feature_bytes" (bytes of this step's feature chunks, as
            fetched from the object store),
            "draft_acceptance_estimate" (per draft position, the share of
            drafts accepted there when the head as it was when this call
            began, the one the replicas drafted this step's rollouts with,
            is replayed on all of this step's responses, which it never
            trained on; empty without ``num_speculative_tokens``),
            "draft_acceptance_by_share" (the same by the share of the
            step's sequences still generating when each draft was made,
            ``loss.acceptance_by_share``: [[share, drafts, rates]]),
            "draft_acceptance_se" (standard error of the estimate's
            acceptance length, ``loss.acceptance_length_se`` clustered by
            the features' ``group`` ids where they carry them; 0.0: unknown),
            "draft_acceptance_clusters" (the clusters that estimate is
            over, ``loss.drafting_clusters``),
            "time_s" (seconds of this call), "start_time"/"end_time" (epoch s)}.

        The heap the call freed goes back to the OS when it returns
        (``trim_host_heap``): the actor idles between calls, beside the
        policy update on a colocated node.

        Raises:
            RuntimeError: no features were submitted, or an expected chunk
                did not arrive within ``timeout_s``.
            ValueError: ``lm_head_rows`` is not [N, H] of this head.
        """
        result = self._train(verifier_ref, steps, expect, timeout_s)
        trim_host_heap()  # here, once _train's locals (verifier layers, activations) are freed
        if self.device.type == "cuda":  # and their device memory, before colocated replicas wake
            torch.cuda.empty_cache()
        return result

    def _train(self, verifier_ref, steps: int, expect: int | None, timeout_s: float) -> dict[str, Any]:
        """``train`` without the heap trim."""
        t_start = time.time()
        t0 = time.perf_counter()
        pending = self._pending  # set_state replaces it: a call it abandons keeps the old one
        if expect is None:
            expect = pending.qsize()
        if expect < 1:
            raise RuntimeError("DraftTrainer.train: no features submitted")
        ver = ray.get(verifier_ref) if isinstance(verifier_ref, ray.ObjectRef) else verifier_ref
        # bf16, as rank 0 sends them (verifier_output_weights): no fp32 copies;
        # the loss casts rows to the head's fp32 as it uses them. Of the output
        # layer only the draft vocabulary's rows: the Train ranks computed the
        # rest's share of the targets (loss.verifier_normalizers)
        embed = ver["embed"].to(self.device)
        # tied embeddings: the output layer is the embedding, sent once; its rows are taken on the device
        out_rows = ver["lm_head_rows"].to(self.device) if "lm_head_rows" in ver else self.head.draft_rows(embed)
        if out_rows.shape != self.head.lm_head.weight.shape:
            raise ValueError(f"DraftTrainer.train: lm_head_rows is {tuple(out_rows.shape)}, this head's "
                             f"output layer {tuple(self.head.lm_head.weight.shape)} (the rows of draft_ids())")
        self.head.set_output_rows(out_rows)
        del ver
        chunks = _StepChunks(pending, timeout_s)
        newest: list = []
        older = [f for step in self._buffer for f in step]
        self._rng.shuffle(older)
        # the replicas' head: later chunks must not be judged by a head
        # trained on their GRPO siblings in earlier chunks
        replay = _DraftingReplay(self.head, embed, self.num_speculative_tokens,
                                 (out_rows, self.temperature, self._rng.getrandbits(63)) if self.sampled_drafts else None)
        self.head.train()
        losses, agree = [], []
        for i in range(steps):
            if len(newest) < expect:
                newest.append(chunks.get(len(newest)))
                f = to_device(newest[-1], self.device)
                targets = replay.add(f)
            else:
                seen = older + newest
                f = to_device(seen[(i - expect) % len(seen)], self.device)  # the buffer keeps host copies
                targets = None
            with self._lock:
                _check_current(pending, self._pending)
                loss, acc = eagle3_loss(self.head, f, embed, out_rows, self.ttt_steps, targets=targets,
                                        tv_weight=self.tv_loss_weight)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
                self.opt.step()
            losses.append(loss.item())
            agree.append(acc)
        while len(newest) < expect:  # fewer steps than chunks: keep the rest for replay
            newest.append(chunks.get(len(newest)))
            replay.add(newest[-1])
        with self._lock:
            _check_current(pending, self._pending)
            self._buffer.append(newest)
            if steps:
                self.version += 1
        per_step = [sum(a[j] for a in agree if len(a) > j) / max(1, sum(len(a) > j for a in agree))
                    for j in range(max((len(a) for a in agree), default=0))]
        feature_bytes = sum(v.nbytes for f in newest for v in f.values() if isinstance(v, torch.Tensor))
        return {"draft_loss": sum(losses) / len(losses) if losses else float("nan"),
                "draft_feature_bytes": feature_bytes,
                "draft_top1_per_step": per_step, "draft_version": self.version,
                "draft_acceptance_estimate": replay.rates(),
                "draft_acceptance_by_share": replay.rates_by_share(),
                "draft_acceptance_se": replay.length_se(),
                "draft_acceptance_clusters": replay.clusters(),
                "time_s": time.perf_counter() - t0, "start_time": t_start, "end_time": time.time()}

    def get_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything a resumed run needs to continue training exactly as
        this one would: (tensors, JSON-able metadata).

        Tensors (host memory): ``head.<name>`` (head weights, fp32), ``opt.<i>.<key>``
        (AdamW state of trainable parameter i), ``buffer.<s>.<c>.<key>``
        (replayed features: RL step s, chunk c). Metadata: draft version,
        optimizer param groups, buffer shape, the replay RNG state.
        """
        with self._lock:
            tensors = {f"head.{k}": v for k, v in self.head.state_dict().items()}
            opt = self.opt.state_dict()
            for i, st in opt["state"].items():
                for k, v in st.items():
                    tensors[f"opt.{i}.{k}"] = torch.as_tensor(v)
            for si, step in enumerate(self._buffer):
                for ci, chunk in enumerate(step):
                    for k, v in chunk.items():
                        tensors[f"buffer.{si}.{ci}.{k}"] = v
            tensors = to_host(tensors)
            meta = {"version": self.version, "param_groups": opt["param_groups"],
                    "opt_params": sorted(opt["state"]), "buffer": [len(st) for st in self._buffer],
                    "rng": self._rng.getstate()}
        return tensors, meta

    def set_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
        """Restore ``get_state``'s output (a run resuming from a checkpoint,
        or Train workers restarted after a failure). Features queued and a
        ``train`` call still waiting for them (from the failed attempt) are
        dropped, and so are replay chunks without the verifier's normalisers
        (checkpoints from before features carried them). Returns the draft
        version."""
        with self._lock:
            self._abandon_pending()
            self.head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
            state = {int(i): {k.split(".", 2)[2]: v for k, v in tensors.items()
                              if k.startswith(f"opt.{i}.")} for i in meta["opt_params"]}
            self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
            self._buffer.clear()
            for si, n in enumerate(meta["buffer"]):
                step = [{k.split(".", 3)[3]: v for k, v in tensors.items()
                         if k.startswith(f"buffer.{si}.{ci}.")} for ci in range(n)]
                # a checkpoint from before the Train ranks sent the normalisers:
                # its chunks cannot be replayed from the draft rows alone
                self._buffer.append([c for c in step if all(k in c for k in FEATURE_KEYS)])
            self._rng.setstate(meta["rng"])
            self.version = int(meta["version"])
            self._adopted = True
        return self.version

    def save_state(self, out_dir: str) -> None:
        """``get_state`` written by this actor as ``out_dir/draft.safetensors``
        + ``draft.json`` (``rayspec.draft.state.save_draft_state``), so
        the state never passes through Ray's object store; ``out_dir`` must
        be on this actor's node.

        Raises:
            OSError: the files could not be written (full or unwritable disk).
        """
        save_draft_state(self.get_state(), Path(out_dir))
        trim_host_heap()  # safetensors' serialized copy of the state

    def load_state(self, in_dir: str) -> int:
        """``set_state`` from what ``save_state`` wrote in ``in_dir`` (on this
        actor's node); returns the draft version.

        Raises:
            FileNotFoundError: ``in_dir`` holds no draft state.
        """
        return self.set_state(*load_draft_state(Path(in_dir)))

    def node_and_gpu(self) -> tuple[str, str | None]:
        """(Ray node id, physical id of the GPU the head trains on, or None)."""
        from rayspec.devices import assigned_gpu

        return ray.get_runtime_context().get_node_id(), assigned_gpu() if self.device.type == "cuda" else None

    def vllm_weights(self) -> dict[str, torch.Tensor]:
        """Current head weights under vLLM's checkpoint names (bf16, host memory)."""
        return vllm_state_dict(self.head)

    def save(self, out_dir: str) -> str:
        """Write the head atomically; returns the directory."""
        return str(save_head(self.head, Path(out_dir)))


_ABANDONED = object()  # wakes a train() call that set_state or reset abandoned


def _check_current(pending: queue.Queue, current: queue.Queue) -> None:
    """A ``train`` call whose feature queue was replaced must not touch the
    restored (or reset) head, optimizer or buffer."""
    if pending is not current:
        raise RuntimeError("DraftTrainer.train: abandoned (the trainer was restored from a checkpoint or reset)")


LEARNING_Z = 2.0  # standard errors a rise of the estimate must exceed to count as learning (many clusters)


def learning_threshold(df: int) -> float:
    """Standard errors a rise must exceed when the estimate's standard error
    rests on ``df`` + 1 clusters: the quantile of Student's t with ``df``
    degrees of freedom at the normal's one-sided level of ``LEARNING_Z``
    (0.977), as cluster-robust inference with few clusters calls for
    (Cameron and Miller, "A Practitioner's Guide to Cluster-Robust
    Inference", J. Human Resources 50(2), 2015, section VI.C: T(G - 1)
    critical values). 4 GRPO groups a step: 3.31 against 2.0. ``df`` < 1
    (unknown): ``LEARNING_Z``."""
    if df < 1:
        return LEARNING_Z
    from scipy import stats

    return float(stats.t.ppf(stats.norm.cdf(LEARNING_Z), df))


class TrainingCadence:
    """Which RL steps train the draft head (rank 0 decides, ``rl_step``).

    The head trains every step while the replicas draft with it or while it
    is still learning; otherwise (adaptive k drafted in less than
    ``min_drafted_share`` of the step's rollout, at most a tail of a few
    sequences, and the head's replayed acceptance length rose less than
    ``min_gain`` between its last two training steps) only at spaced idle
    steps: the ``idle_every``-th, then twice as far apart after each idle
    step that trains it (exponential backoff, up to ``max_idle_every``),
    back to ``idle_every`` once a rollout drafts or the head learns. A rise
    counts as learning where it is at
    least ``min_gain`` and ``learning_threshold`` standard errors of the
    difference of the two estimates (``LEARNING_Z`` = 2 with many GRPO
    groups, more with few: their standard errors rest on the groups that
    drafted): each estimate is a replay of one step's responses,
    and on 16 GSM8K responses consecutive estimates of a warm head trained
    at 1e-4 between them differed by 0.17 (docs/benchmarks.md), so a fixed
    0.02 took noise for learning and trained the head again after each
    idle step that trained it. Training a head that drafts little or
    nothing buys little rollout time, and on a colocated node
    it takes the policy update's cores; the idle steps that do train keep it up with
    the policy and give adaptive k a fresh estimate, which turns drafting
    back on where the head comes to pay. The backoff: an idle training step
    whose estimate shows no learning says the next one most likely will not
    either (a warm head on GSM8K: estimates 1.74-1.90 around its recorded
    1.80 at every idle step that trained it, each such step 6-11 s longer
    than its neighbours, docs/benchmarks.md), so over n idle steps the head
    trains about log2(n) times until ``max_idle_every`` caps the spacing.

    Args:
        idle_every: idle steps before the first idle training step, and
            the spacing the backoff starts from (0: train every step).
        max_idle_every: the largest spacing of idle training steps the
            backoff reaches (None or ``idle_every``: no backoff).
        min_gain: acceptance length (tokens per verification step) the
            replayed estimate must rise by for the head to count as learning.
        min_drafted_share: share of a rollout's generated tokens that steps
            carrying a draft emitted (``SpecStats.drafted_share``) from which
            the rollout counts as drafted.
        prior: acceptance length the head was measured at before the run
            (its warm start's held-out record, ``recorded_acceptance_length``),
            or None (a fresh head). With one, the head does not count as
            learning until an estimate rises above it (as above): the warm
            start trained it until held-out acceptance stopped rising, and
            otherwise the run's first two steps would train it whether or
            not anything drafts with it.
    """

    def __init__(self, idle_every: int, min_gain: float, min_drafted_share: float = 0.0,
                 prior: float | None = None, max_idle_every: int | None = None):
        self.idle_every, self.min_gain, self.min_drafted_share = idle_every, min_gain, min_drafted_share
        self.max_idle_every = max(idle_every, max_idle_every or 0)
        self.learning = prior is None  # no estimate yet
        self.idle_steps = 0  # idle steps since the head last trained
        self.spacing = idle_every  # idle steps between idle training steps (the backoff's)
        self._last: float | None = prior  # acceptance length of the last estimate
        self._last_se = 0.0  # its standard error (the prior's: taken as exact)
        self._last_clusters = 0  # the clusters that standard error rests on (0: none, exact)

    def due(self, drafted_share: float) -> bool:
        """Whether this step trains the head; ``drafted_share``: its
        rollout's ``SpecStats.drafted_share`` (a rollout with no draft: 0)."""
        drafted = drafted_share > 0 and drafted_share >= self.min_drafted_share
        if not self.idle_every or drafted or self.learning:
            self.idle_steps, self.spacing = 0, self.idle_every
            return True
        self.idle_steps += 1
        if self.idle_steps >= self.spacing:
            # the step's estimate showing learning brings the next due() back to every step
            self.idle_steps, self.spacing = 0, min(2 * self.spacing, self.max_idle_every)
            return True
        return False

    def trained(self, estimate: list[float], se: float = 0.0, clusters: int = 0) -> None:
        """A training step's replayed per-position acceptance rates (the
        DraftTrainer's ``draft_acceptance_estimate``; empty: none, the head
        counts as learning), the standard error of their acceptance length
        (``draft_acceptance_se``; 0.0: unknown, ``min_gain`` alone) and the
        clusters it rests on (``draft_acceptance_clusters``; 0: unknown,
        ``LEARNING_Z`` standard errors). The difference's degrees of freedom
        are the fewer of its two estimates' (a conservative choice)."""
        if not estimate:
            self.learning, self._last, self._last_se, self._last_clusters = True, None, 0.0, 0
            return
        length = 1.0 + sum(estimate)
        dfs = [g - 1 for s, g in ((se, clusters), (self._last_se, self._last_clusters)) if s > 0 and g > 1]
        z = learning_threshold(min(dfs)) if dfs else LEARNING_Z
        self.learning = self._last is None or \
            length - self._last >= max(self.min_gain, z * math.hypot(se, self._last_se))
        self._last, self._last_se, self._last_clusters = length, se, clusters

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON): a resumed run trains the head when
        the uninterrupted one would."""
        return {"learning": self.learning, "idle_steps": self.idle_steps, "last": self._last,
                "last_se": self._last_se, "last_clusters": self._last_clusters, "spacing": self.spacing}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.learning, self.idle_steps, self._last = state["learning"], state["idle_steps"], state["last"]
        self._last_se = state.get("last_se", 0.0)  # absent from checkpoints before the standard error
        self.spacing = state.get("spacing", self.idle_every)  # absent from checkpoints before the backoff
        self._last_clusters = state.get("last_clusters", 0)  # absent before the t critical values


class _DraftingReplay:
    """The replicas' drafting replayed on an RL step's chunks
    (``loss.replay_chains``) with a copy of ``head`` as it is now; k None:
    nothing (the rates are empty). ``sampled``: (the verifier's output-layer
    rows of the draft vocabulary [N, H], temperature, seed) where the
    replicas sample their drafts."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, k: int | None,
                 sampled: tuple[torch.Tensor, float, int] | None = None):
        # the output layer is frozen within a train call (set from the verifier
        # at its start): shared, not copied ([N, H])
        out = head.lm_head.weight
        self.head = copy.deepcopy(head, memo={id(out): out}).eval() if k else None
        self.embed, self.k, self.sampled = embed, k, sampled
        self.generator = torch.Generator().manual_seed(sampled[2]) if sampled else None
        self.chains: list = []  # per sequence of the step: (length, [(generated, accepted)])
        self.groups: list[int] = []  # per sequence, its GRPO group (negative: its own, a chunk without ids)

    def add(self, f: dict[str, torch.Tensor]):
        """Replay one chunk (host or device tensors: moved to the head's
        device). Returns the verifier's targets the sampled replay computed
        (``loss.verifier_targets``) where they are the loss's too (T = 1),
        so the chunk's training step does not compute them again; else None."""
        if self.head is None:
            return None
        f = to_device(f, self.embed.device)
        targets = None
        if self.sampled:
            out_rows, temperature, _ = self.sampled
            targets = verifier_targets(f, out_rows, self.head.fc.weight.dtype, temperature)
            hits = sampled_hits(draft_overlap(self.head, f, self.embed, out_rows, self.k, temperature,
                                              targets=targets), self.generator)
        else:
            hits = greedy_hits(draft_top1(self.head, f["input_ids"], f["aux_hidden"], self.embed, self.k),
                               f["input_ids"], self.k)
        self.chains += replay_chains(hits, f["loss_mask"], self.k)
        b = f["loss_mask"].shape[0]
        self.groups += f["group"].tolist() if "group" in f else [-len(self.groups) - i - 1 for i in range(b)]
        return targets if self.sampled and self.sampled[1] == 1.0 else None

    def rates(self) -> list[float]:
        """Accepted drafts per position over drafts made (empty: none)."""
        drafts, accepted = drafting_counts(self.chains, self.k or 0)
        return [a / drafts for a in accepted] if drafts else []

    def length_se(self) -> float:
        """``loss.acceptance_length_se`` of the step with its GRPO groups as
        the clusters (0.0: none)."""
        return acceptance_length_se(self.chains, self.groups)

    def clusters(self) -> int:
        """``loss.drafting_clusters`` of the step (its GRPO groups)."""
        return drafting_clusters(self.chains, self.groups)

    def rates_by_share(self) -> list[list]:
        """``loss.acceptance_by_share`` of the step, as JSON-ready lists."""
        return [[share, n, rates] for share, n, rates in acceptance_by_share(self.chains, self.k)] if self.k else []


class _StepChunks:
    """One RL step's feature chunks in index order, whatever order the ranks
    deliver them in (chunks that come early wait in ``early``)."""

    def __init__(self, pending: queue.Queue, timeout_s: float):
        self.pending, self.timeout_s = pending, timeout_s
        self.early: dict[int, Any] = {}
        self.arrived = 0

    def get(self, i: int):
        """Chunk ``i`` (fetched from the object store).

        Raises:
            RuntimeError: nothing arrived within ``timeout_s``, or the call
                was abandoned by ``DraftTrainer.set_state``.
        """
        while i not in self.early:
            try:
                item = self.pending.get(timeout=self.timeout_s)
            except queue.Empty:
                raise RuntimeError(f"DraftTrainer.train: no features arrived within {self.timeout_s:.0f} s "
                                   f"(a Train worker failed before submitting its features?)") from None
            if item is _ABANDONED:
                raise RuntimeError("DraftTrainer.train: abandoned (the trainer was restored from a checkpoint)")
            index, r = item
            self.early[self.arrived if index is None else index] = r
            self.arrived += 1
        r = self.early.pop(i)
        return ray.get(r) if isinstance(r, ray.ObjectRef) else r
