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
import os
import queue
import random
import time
from pathlib import Path
from typing import Any

import ray
import torch

from rayspec.draft.eagle3 import Eagle3Head, load_head, save_head, vllm_state_dict
from rayspec.draft.loss import eagle3_loss


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
    """

    def __init__(self, head_dir: str, lr: float, ttt_steps: int, num_threads: int = 1,
                 buffer_steps: int = 1, seed: int = 0, cores: list[int] | None = None):
        if cores:
            os.sched_setaffinity(0, cores)
            num_threads = min(num_threads, len(cores))
        torch.set_num_threads(num_threads)
        self.head: Eagle3Head = load_head(head_dir)
        # The output layer is the verifier's, frozen and refreshed each step:
        # vLLM drafts with the verifier's own lm_head when the head's equals it
        # at start (init_head copies it), so a separately trained one would
        # not be what the replicas draft with.
        self.head.lm_head.weight.requires_grad_(False)
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad],
                                     lr=lr, weight_decay=0.0)
        self.ttt_steps = ttt_steps
        self.version = 0
        self._pending: queue.Queue = queue.Queue()
        self._buffer: collections.deque = collections.deque(maxlen=max(1, buffer_steps))
        self._rng = random.Random(seed)

    def submit_features(self, feature_refs: list) -> int:
        """Queue features for the (running or next) ``train`` call; returns the queue length.

        Args:
            feature_refs: ObjectRefs (or dicts) of features, each a dict with
                input_ids [B, L], aux_hidden [B, L, 3H], final_hidden [B, L, H],
                loss_mask [B, L-1] (see ``eagle3_loss``). Passing them through
                an actor call keeps Ray's ownership tracking intact.
        """
        for r in feature_refs:
            self._pending.put(r)
        return self._pending.qsize()

    def _take(self, timeout_s: float):
        try:
            r = self._pending.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"DraftTrainer.train: no features arrived within {timeout_s:.0f} s "
                               f"(a Train worker failed before submitting its features?)") from None
        return ray.get(r) if isinstance(r, ray.ObjectRef) else r

    def train(self, verifier_ref, steps: int, expect: int | None = None,
              timeout_s: float = 600.0) -> dict[str, Any]:
        """Run ``steps`` optimizer steps on this RL step's features, then replay.

        Args:
            verifier_ref: ObjectRef (or dict) with ``embed`` and ``lm_head``
                weights [V, H] of the verifier that produced the features.
            steps: optimizer steps, one feature chunk (micro-batch) each: this
                step's chunks first, in arrival order, then replayed ones
                (older steps' shuffled, then this step's), cycling.
            expect: chunks this RL step delivers (all ranks' micro-batches);
                the call waits for them as they arrive, so it can start before
                the policy update. None: the chunks queued so far.
            timeout_s: longest wait for one chunk (seconds).

        Returns:
            {"draft_loss", "draft_top1_per_step" (list), "draft_version",
            "time_s" (seconds of this call), "start_time"/"end_time" (epoch s)}.

        Raises:
            RuntimeError: no features were submitted, or an expected chunk
                did not arrive within ``timeout_s``.
        """
        t_start = time.time()
        t0 = time.perf_counter()
        if expect is None:
            expect = self._pending.qsize()
        if expect < 1:
            raise RuntimeError("DraftTrainer.train: no features submitted")
        ver = ray.get(verifier_ref) if isinstance(verifier_ref, ray.ObjectRef) else verifier_ref
        embed = ver["embed"].float()
        lm_head = ver["lm_head"].float()
        with torch.no_grad():
            self.head.lm_head.weight.copy_(lm_head)
        newest: list = []
        older = [f for step in self._buffer for f in step]
        self._rng.shuffle(older)
        self.head.train()
        losses, agree = [], []
        for i in range(steps):
            if len(newest) < expect:
                newest.append(self._take(timeout_s))
                f = newest[-1]
            else:
                replay = older + newest
                f = replay[(i - expect) % len(replay)]
            loss, acc = eagle3_loss(self.head, f["input_ids"], f["aux_hidden"], f["final_hidden"],
                                    f["loss_mask"], embed, lm_head, self.ttt_steps)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.opt.step()
            losses.append(loss.item())
            agree.append(acc)
        while len(newest) < expect:  # fewer steps than chunks: keep the rest for replay
            newest.append(self._take(timeout_s))
        self._buffer.append(newest)
        if steps:
            self.version += 1
        per_step = [sum(a[j] for a in agree if len(a) > j) / max(1, sum(len(a) > j for a in agree))
                    for j in range(max((len(a) for a in agree), default=0))]
        return {"draft_loss": sum(losses) / len(losses) if losses else float("nan"),
                "draft_top1_per_step": per_step, "draft_version": self.version,
                "time_s": time.perf_counter() - t0, "start_time": t_start, "end_time": time.time()}

    def vllm_weights(self) -> dict[str, torch.Tensor]:
        """Current head weights under vLLM's checkpoint names (bf16)."""
        return vllm_state_dict(self.head)

    def save(self, out_dir: str) -> str:
        """Write the head atomically; returns the directory."""
        return str(save_head(self.head, Path(out_dir)))
