"""The policy as a DeepSpeed ZeRO engine: GRPO update with EAGLE-3 feature
capture, and gathering full weights for the refit."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import ray
import torch

from rayspec.batch import RolloutBatch
from rayspec.config import target_temperatures
from rayspec.devices import to_host
from rayspec.draft.capture import capture_eagle3_features
from rayspec.draft.client import FeatureSink
from rayspec.draft.loss import verifier_normalizers
from rayspec.sync.interfaces import HostGather, host_copies, resident
from rayspec.train.grpo import grpo_loss, token_logprobs, token_mult_prob_error
from rayspec.train.lora import adapter_parameters, causal_lm, is_lora
from rayspec.train.ranks import Ranks


def deepspeed_config(cfg, world_size: int) -> dict[str, Any]:
    """``train.deepspeed`` with batch sizes derived so one RL step is one
    optimizer step: train_batch_size = prompts_per_step * group_size."""
    ds = copy.deepcopy(dict(cfg.train.deepspeed))
    seqs = cfg.data.prompts_per_step * cfg.grpo.group_size
    per_rank = seqs // world_size
    micro = min(int(ds.get("train_micro_batch_size_per_gpu", 1)), per_rank)
    while per_rank % micro:
        micro -= 1
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = per_rank // micro
    ds["train_batch_size"] = seqs
    return ds


def use_venv_ninja() -> None:
    """Put this Python's own bin directory (the venv's, which holds the
    ``ninja`` DeepSpeed depends on) first on this process's PATH, before
    DeepSpeed JIT-builds its CPU ops (FusedAdam, the shared-memory
    all-reduce) with the first ``ninja`` on PATH.

    Why: ninja's build log hashes each command, and ninja 1.13 hashes them
    differently from 1.11, so ops built by one count as changed for the
    other and are built again. ``cluster/install_node.sh`` builds them with
    the venv first on PATH (DeepSpeed's ninja, 1.13), while a run started as
    ``.venv/bin/python -m jobs.grpo`` finds the system's (Debian's 1.11): on a
    fresh 2-core host every first run built both ops again, 75 s before
    step 1. Ray starts its workers with the driver's Python, so this is the
    venv wherever the run was started from. Called where DeepSpeed starts
    (``zero3_init``, ``build_engine``)."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[:1] != [bin_dir]:
        os.environ["PATH"] = bin_dir + os.pathsep + path


def build_engine(model, ds_config: dict, device_rank: int | None = None):
    """deepspeed.initialize over an already initialised torch.distributed group.

    Args:
        device_rank: the accelerator index the engine computes on (None:
            DeepSpeed's own choice, ``LOCAL_RANK``).
    """
    use_venv_ninja()
    import deepspeed

    args = SimpleNamespace(device_rank=device_rank) if device_rank is not None else None
    # the trainable parameters only: a LoRA policy's optimizer holds its adapter's states alone
    engine, *_ = deepspeed.initialize(args=args, model=model,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    return engine


@contextlib.contextmanager
def zero3_init(ds_config: dict, device_rank: int | None = None) -> Iterator[None]:
    """Models loaded inside are partitioned as they are built, where
    ``ds_config`` is ZeRO-3 (elsewhere a no-op).

    transformers' ``HfDeepSpeedConfig`` makes ``from_pretrained`` build the
    module under ``deepspeed.zero.Init``, each layer partitioned onto the
    rank's device as it is built, and copy each checkpoint tensor into its
    gathered parameter on rank 0 (``_load_state_dict_into_zero3_model``,
    transformers 5.19; the checkpoint is memory-mapped). Without it
    DeepSpeed moves the whole module to every device before partitioning it
    (``_configure_distributed_model``, 0.19.8): 16 GB at 8B in bf16, 65 GB
    at 32B, on GPUs a colocated replica shares. TRL and accelerate load
    ZeRO-3 models the same way. The config is unset on exit: a model loaded
    after it (the GRPO reference policy) is whole. Collective: every rank
    enters it.

    Args:
        ds_config: the engine's DeepSpeed config (``deepspeed_config``).
        device_rank: the accelerator index the partitions go to (as
            ``build_engine``'s); None: ``LOCAL_RANK``'s (CPU: host memory).
    """
    if (ds_config.get("zero_optimization") or {}).get("stage") != 3:
        yield
        return
    use_venv_ninja()
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed.init_distributed()  # zero.Init reads the world size from DeepSpeed's group (Ray Train made torch's)
    local_rank = os.environ.get("LOCAL_RANK")
    if device_rank is not None:
        # zero.Init places partitions on <accelerator>:<LOCAL_RANK> (partition_parameters.py, 0.19.8),
        # which is not the GPU Ray gave this worker where one host runs several Ray nodes
        os.environ["LOCAL_RANK"] = str(device_rank)
    config = HfDeepSpeedConfig(ds_config)  # transformers keeps a weak reference: hold it while loading
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del config
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = local_rank


def num_micro_batches(engine, rows: int) -> int:
    """Micro-batches (= feature chunks) one rank's ``rows`` sequences make."""
    micro = engine.train_micro_batch_size_per_gpu()
    return -(-rows // micro)


def captured_rows(rows: int, share: float, rng: torch.Generator | None) -> torch.Tensor | None:
    """The rows of a micro-batch of ``rows`` sequences whose features are
    captured: max(1, round(share x rows)) of them drawn by ``rng``, in
    order ([n] int64); None for all (share 1)."""
    if share >= 1:
        return None
    n = max(1, round(share * rows))
    return torch.randperm(rows, generator=rng)[:n].sort().values


def policy_update(engine, batch: RolloutBatch, cfg, pad_id: int, aux_layer_ids: list[int] | None,
                  ref_model=None, on_features=None,
                  capture_rng: torch.Generator | None = None) -> tuple[dict[str, float], list]:
    """One GRPO optimizer step on this rank's shard of the batch.

    Every micro-batch forward is with the weights that sampled the batch
    (one optimizer step per RL step), so the captured features are the
    verifier's own. Inputs go to ``engine.device`` (DeepSpeed moves the
    module there, never the inputs); the reference policy must already be
    there. Features enter the object store as host copies.

    Args:
        engine: DeepSpeed engine of the policy.
        batch: this rank's rows (advantages set).
        cfg: RunConfig.
        pad_id: tokenizer pad id.
        aux_layer_ids: EAGLE-3 aux layers to capture, or None for no capture.
        ref_model: frozen reference policy for the KL term (kl_coef > 0),
            on ``engine.device``: a model, or a LoRA policy's own module with
            the adapter off (``rayspec.train.lora.AdapterOff``).
        on_features: called with each micro-batch's feature ObjectRef and
            the micro-batch's index as soon as it exists (the DraftTrainer
            trains while this runs).
        capture_rng: draws the sequences captured where
            ``cfg.draft.capture_share`` < 1 (``captured_rows``).

    Returns:
        (metrics averaged over micro-batches, list of ObjectRefs of feature
        dicts (``rayspec.draft.loss.FEATURE_KEYS`` and ``group``, the
        normalisers at ``rayspec.config.target_temperatures``), one per
        micro-batch; empty without capture).
    """
    micro = engine.train_micro_batch_size_per_gpu()
    engine.train()
    sums: dict[str, float] = {}
    feature_refs = []
    n_micro = 0
    for start in range(0, len(batch), micro):
        part = batch.select(slice(start, start + micro))
        t = part.to_padded(pad_id, engine.device)
        with (capture_eagle3_features(causal_lm(engine.module), aux_layer_ids) if aux_layer_ids
              else contextlib.nullcontext({})) as feats:
            logits = engine(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
        if aux_layer_ids:  # before the step: the normalisers are of the weights that made the features
            rows = captured_rows(len(part), cfg.draft.capture_share, capture_rng)
            pick = (lambda x: x) if rows is None else (lambda x: x[rows.to(x.device)])  # noqa: E731
            out_layer = causal_lm(engine.module).lm_head.weight
            with _gathered(engine, [out_layer]):
                normalizers = verifier_normalizers(pick(feats["final_hidden"]), pick(t["response_mask"]),
                                                   out_layer, target_temperatures(cfg))
        logprobs = token_logprobs(logits, t["input_ids"], cfg.grpo.temperature)
        ref_lp = None
        if ref_model is not None and cfg.grpo.kl_coef > 0:
            with torch.no_grad():
                ref_logits = ref_model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
                ref_lp = token_logprobs(ref_logits, t["input_ids"], cfg.grpo.temperature)
        loss, m = grpo_loss(logprobs, t["rollout_logprobs"], t["advantages"], t["response_mask"],
                            cfg.grpo.clip_range, ref_lp, cfg.grpo.kl_coef, cfg.grpo.kl_type,
                            cfg.grpo.loss_agg_mode, cfg.grpo.max_new_tokens)
        engine.backward(loss)
        engine.step()
        m["loss"] = loss.item()
        m["token_mult_prob_error"] = token_mult_prob_error(
            logprobs.detach(), t["rollout_logprobs"], t["response_mask"])
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
        n_micro += 1
        if aux_layer_ids:
            feature_refs.append(ray.put({
                **to_host({"input_ids": pick(t["input_ids"]), "loss_mask": pick(t["response_mask"]),
                           **normalizers}),
                "group": pick(torch.tensor(part.group)),  # [B] GRPO group ids: the estimate's clusters
                **to_host({"aux_hidden": pick(feats["aux_hidden"]), "final_hidden": pick(feats["final_hidden"])},
                          torch.bfloat16),
            }))
            if on_features is not None:
                on_features(feature_refs[-1], n_micro - 1)
    return {k: v / n_micro for k, v in sums.items()}, feature_refs


def full_parameters(engine) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """The policy's full HF-named weights on this rank's device, one at a
    time: (name, tensor, persistent). Stages 0-2 hold full parameters on
    every rank: the state dict's own tensors (persistent True). ZeRO-3
    shards them: each is gathered in turn (a collective, so every rank must
    iterate them all, in the same order) and freed when the next is asked
    for (persistent False: copy it before), so no device ever holds more
    than one gathered parameter (at 8B, 1.2 GB: the embedding) where a
    gather of the whole model would hold all of it. Tied parameters come
    once, under their first name (vLLM and HF tie them themselves), then
    the state dict's buffers, which ZeRO-3 does not partition."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        yield from resident(module.state_dict())
        return
    import deepspeed

    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield name, p.data, False
    in_state_dict = set(module.state_dict())
    yield from ((name, b, True) for name, b in module.named_buffers() if name in in_state_dict)


def full_state_dict(engine, dtype: torch.dtype, rank: int) -> dict[str, torch.Tensor] | None:
    """Full HF-named policy weights on rank 0 (None elsewhere), in ``dtype``,
    as host (CPU) copies. Collective under ZeRO-3 (``full_parameters``)."""
    return host_copies(full_parameters(engine), dtype, keep=rank == 0)


def _gathered(engine, params: list[torch.Tensor]):
    """A context in which ``params`` are whole on this rank's device:
    gathered under ZeRO-3 (a collective: every rank enters it), as they are
    under stages 0-2."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def verifier_output_weights(engine, rank: int, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
    """What the DraftTrainer needs of the verifier, on rank 0 (None on the
    others): ``embed``, its embedding [V, H] (the head embeds any token),
    and ``lm_head_rows``, the rows ``rows`` [N] (int64 token ids, the draft
    vocabulary in draft order: ``Eagle3Head.draft_ids``) of its output layer,
    [N, H] (the whole layer [V, H] where ``rows`` is None); bf16 host
    copies. Only the draft rows cross: the Train ranks already took the
    whole vocabulary's share of the targets (``loss.verifier_normalizers``).
    With tied embeddings the output layer is ``embed``, already sent: no
    ``lm_head_rows``. Collective under ZeRO-3."""
    module = causal_lm(engine.module)
    params = [module.model.embed_tokens.weight, module.lm_head.weight]
    with _gathered(engine, params):
        if rank != 0:
            return None
        out = {"embed": params[0]}
        if params[1] is not params[0]:
            out["lm_head_rows"] = params[1] if rows is None else params[1][rows.to(params[1].device)]
        return to_host(out, torch.bfloat16)


@runtime_checkable
class Policy(Protocol):
    """A Train rank's policy as the RL loop uses it (``rayspec.train.loop``:
    the step, checkpoints, resume): ``PolicyWorker``, and the fake policy
    of ``tests/test_step.py``, whose methods a test holds to these. Every
    method is collective (every rank calls it, in the same order)."""

    ranks: Ranks

    def share(self, rollout) -> RolloutBatch:
        """Rank 0's rollout (None elsewhere) on every rank, as this rank's shard."""

    def update(self, shard: RolloutBatch, features: FeatureSink | None = None) -> dict[str, float]:
        """One GRPO optimizer step on ``shard``; the verifier's features to ``features``; its metrics."""

    def refit_weights(self) -> Any:
        """What a policy refit sends (rank 0; None elsewhere)."""

    def refit_sent(self) -> None:
        """After rank 0 sent the refit: what the weight source holds is let go."""

    def checkpoint(self, metrics: dict[str, Any], trainer_state: dict[str, Any] | None,
                   stage_draft: Callable[[Any], None] | None) -> None:
        """Write and report a checkpoint (rank 0 gives ``trainer_state`` and ``stage_draft``)."""

    def report(self, metrics: dict[str, Any]) -> None:
        """Report a step's metrics to Ray Train without a checkpoint."""

    def restore(self, checkpoint, restore_draft: Callable[..., Any] | None = None) -> tuple[dict[str, Any], Any]:
        """Load ``checkpoint``: (its trainer state, what ``restore_draft`` returned)."""


class PolicyWorker:
    """This Train rank's part of the policy: its DeepSpeed ZeRO engine, the
    frozen reference policy (KL term), and the collectives of an RL step.

    Args:
        engine: the policy's DeepSpeed engine (``build_engine``).
        cfg: RunConfig.
        ranks: this rank among the Train workers.
        pad_id: the tokenizer's pad id.
        serve_dtype: dtype the replicas serve the policy in (``model.dtype``):
            refits are sent in it.
        ref_model: frozen reference policy on ``engine.device``, or None.
        source: what this rank gives a refit (``rayspec.sync.make_source``:
            rank 0's host copies, rank 0's weights on its device for the
            collective, or every rank's device export for cuda_ipc); None:
            ``HostGather``.
    """

    def __init__(self, engine, cfg, ranks, pad_id: int, serve_dtype: torch.dtype, ref_model=None, source=None):
        self.engine, self.cfg, self.ranks = engine, cfg, ranks
        self.pad_id, self.serve_dtype, self.ref_model = pad_id, serve_dtype, ref_model
        self.source = source if source is not None else HostGather(ranks)
        self.offloaded = False  # DeepSpeed's states in host memory (``release``)
        # the sequences whose features are captured (draft.capture_share < 1), each rank its own draw
        self.capture_rng = torch.Generator().manual_seed(cfg.trainer.seed * 65537 + ranks.rank)

    def release(self) -> None:
        """Give this rank's device memory back before colocated replicas wake
        (for the refit, then the next rollout). With ``train.offload_states``:
        DeepSpeed's ``offload_states()``, the ZeRO optimizer's states (Adam
        moments, fp32 master weights, gradients, bf16 weights) to pinned host
        memory, then torch's cache emptied (DeepSpeed does both). Without it,
        on a GPU: ``torch.cuda.empty_cache()``, else the update's activations
        and logits stay reserved by torch's caching allocator while the
        replicas roll out. Every method that reads the engine brings the
        states back first (``_reload``)."""
        if self.cfg.train.offload_states:
            if not self.offloaded:
                self.engine.offload_states()
                self.offloaded = True
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _reload(self) -> None:
        """DeepSpeed's ``reload_states()`` after a ``release`` (no-op otherwise)."""
        if self.offloaded:
            self.engine.reload_states()
            self.offloaded = False

    def share(self, rollout) -> RolloutBatch:
        """Rank 0's rollout batch (``Coordinator.next_rollout``; None on the
        other ranks) on every rank (collective), as this rank's shard."""
        # a multi-turn rollout's messages and environments are the reward's, not the trainer's
        batch = self.ranks.broadcast(dataclasses.replace(rollout.batch, completions=[], environments=[])
                                     if rollout is not None else None)
        return batch.shard(self.ranks.rank, self.ranks.world)

    def update(self, shard: RolloutBatch, features: FeatureSink | None = None) -> dict[str, float]:
        """One GRPO optimizer step on this rank's shard (``policy_update``;
        collective).

        Args:
            shard: this rank's rows (``share``), advantages set.
            features: where the verifier's EAGLE-3 features go where the
                draft head trains this step (``DraftClient.begin``): first
                the verifier's output layer, for the DraftTrainer to start
                on (``verifier_output_weights`` of the sink's ``rows``;
                collective under ZeRO-3), then each micro-batch's features
                (its ``aux_layer_ids`` captured), which the sink holds.
                None: no capture.

        Returns:
            the update's metrics, averaged over micro-batches.
        """
        self._reload()
        if features is None:
            return policy_update(self.engine, shard, self.cfg, self.pad_id, None, self.ref_model)[0]
        world, rank = self.ranks.world, self.ranks.rank
        # the DraftTrainer starts before the first micro-batch and trains on each as it arrives
        features.start(verifier_output_weights(self.engine, rank, features.rows),
                       world * num_micro_batches(self.engine, len(shard)))
        metrics, _ = policy_update(self.engine, shard, self.cfg, self.pad_id, features.aux_layer_ids,
                                   self.ref_model, lambda ref, micro: features.submit(ref, micro * world + rank),
                                   self.capture_rng)
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full policy in the serving dtype as host copies on rank 0
        (collective under ZeRO-3): checkpoints and the saved model."""
        self._reload()
        return full_state_dict(self.engine, self.serve_dtype, self.ranks.rank)

    def refit_weights(self):
        """What a policy refit sends, from this rank's weight source
        (``source.collect``; collective): rank 0's host copies, its weights
        on its device (the collective), or with cuda_ipc the handles to
        every rank's device copy, on rank 0 (None elsewhere); a LoRA
        policy's adapter only (``rayspec.sync.lora.AdapterGather``). Where
        the source leaves the device unread, it is given back here (``release``), before colocated replicas wake for the
        refit; else in ``refit_sent``."""
        self._reload()
        weights = self.source.collect(adapter_parameters(self.engine.module) if is_lora(self.engine.module)
                                      else full_parameters(self.engine), self.serve_dtype)
        if not self.source.reads_device:
            self.release()
        return weights

    def refit_sent(self) -> None:
        """After rank 0 sent the refit (sync mode: and it landed): what the
        source exported is dropped (cuda_ipc: collective) and the device
        given back (``release``)."""
        self.source.done()
        self.release()

    def checkpoint(self, metrics: dict[str, Any], trainer_state: dict[str, Any] | None, stage_draft) -> None:
        """Write and report a checkpoint (collective, ``report_checkpoint``)."""
        from rayspec.train.checkpoint import report_checkpoint

        released = self.offloaded
        self._reload()
        report_checkpoint(metrics, self.engine, self.ranks.rank, trainer_state, stage_draft)
        if released:  # the next rollout follows
            self.release()

    def report(self, metrics: dict[str, Any]) -> None:
        """Report a step's numeric metrics to Ray Train without a checkpoint."""
        import ray.train

        ray.train.report(metrics)

    def restore(self, checkpoint, restore_draft=None) -> tuple[dict[str, Any], Any]:
        """Load a checkpoint into the engine and this rank's RNGs (collective,
        ``restore_checkpoint``): (trainer state, ``restore_draft``'s result)."""
        from rayspec.train.checkpoint import restore_checkpoint

        self._reload()
        return restore_checkpoint(checkpoint, self.engine, self.ranks.rank, restore_draft)
