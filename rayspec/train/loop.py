"""The RL step, run inside Ray Train workers.

Rank 0 drives the step through its ``Coordinator`` (rollouts through the
replicas' client, rewards, weight refits, the record); every rank holds a
DeepSpeed ZeRO shard of the policy (``PolicyWorker``) and trains on its
slice of the batch, with the draft head training beside it (``DraftClient``,
or ``NullDraft`` without online training).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import ray
import torch

from rayspec.config import ConfigError, RunConfig
from rayspec.relay import relay_warnings
from rayspec.data.files import DataFileError
from rayspec.devices import assigned_gpu
from rayspec.draft.client import DraftClient, NullDraft, find_draft_trainer
from rayspec.draft.trainer import TrainingCadence
from rayspec.files import write_dir_atomic
from rayspec.metrics import PhaseTimer, plot_run
from rayspec.reward.functions import RewardFunctionError
from rayspec.reward.pool import RewardError
from rayspec.scheduler.placement import ClusterFitError
from rayspec.train.checkpoint import checkpoints, train_storage
from rayspec.sync import make_source
from rayspec.train.coordinator import Coordinator, Follower
from rayspec.train.lora import AdapterOff, adapter_config, adapter_parameters, is_lora, wrap_lora
from rayspec.train.policy import Policy, PolicyWorker, build_engine, deepspeed_config, zero3_init
from rayspec.train.ranks import Ranks, RunAborted, report_aborts

log = logging.getLogger(__name__)

REPORTED = ("step", "policy_version", "reward_mean", "acceptance_length", "time_step_s")
# what rank 0 may meet that a restart of the workers would meet again: the run stops (RunAborted)
USER_ERRORS = (ConfigError, DataFileError, RewardError, RewardFunctionError)
# and where rank 0 works with the replicas: the driver stopping the run (rayspec.scheduler.recovery.stopping_run)
STOP_ERRORS = USER_ERRORS + (ClusterFitError,)


def rl_step(step: int, version: int, coord: Coordinator | Follower, policy: Policy,
            draft: DraftClient | NullDraft) -> dict[str, Any] | None:
    """One GRPO step training policy ``version``, collective over the Train
    ranks. Its phases, each timed (the record's ``time_<phase>_s``): rollout,
    reward, advantages, policy (the update, the draft head training beside
    it on the verifier's features), draft (its training beyond the update
    and the policy's refit) and sync (the refit: the policy's weights, then
    the head's). Returns rank 0's record (None elsewhere)."""
    timer = PhaseTimer()
    with policy.ranks.stop_on(STOP_ERRORS):  # a reward function that raises, or the driver's stop, stops every rank
        with timer("rollout"):
            rollout = coord.next_rollout(version)  # generated ahead of this step in async mode
        with timer("reward"):
            coord.reward(rollout)
        with timer("advantages"):
            coord.advantages(rollout)
    with timer("policy"):
        coord.release_replicas()  # colocated: replicas sleep while the policy trains
        features = draft.begin(rollout)  # where the verifier's features go; None: the head does not train
        metrics = policy.update(policy.share(rollout), features)
    with timer("sync"):
        with timer("gather"):  # the weight source: rank 0's host copy, its device weights or every rank's export
            weights = policy.refit_weights()
        coord.refit(version + 1, weights)  # the policy's weights first: the head's last steps train meanwhile
        del weights
        policy.refit_sent()  # colocated: the device back before the next rollout
    with timer("draft"):
        drafted = draft.finish()
    with timer("sync"):
        coord.refit(version + 1, head=drafted.head)
    return coord.record(step, rollout, metrics, drafted, timer)


def run_steps(cfg: RunConfig, coord: Coordinator | Follower, policy: Policy, draft: DraftClient | NullDraft,
              version: int) -> None:
    """RL steps after ``version`` up to ``trainer.steps``: each step's record
    is finished by rank 0 (evaluation, log), and a checkpoint is written
    every ``trainer.save_steps`` and after the last.

    Where the driver stops the run (a node died and the nodes left cannot
    hold the layout: ``recovery.stopping_run``), the state after the last
    step finished is checkpointed before the ``RunAborted`` ends the
    workers, so ``resume=`` loses no step.

    Raises:
        RunAborted: on every rank (``USER_ERRORS``, or the driver's ``ClusterFitError``).
    """
    saved = version  # the checkpoint this attempt started from (0: none)
    for step in range(version + 1, cfg.trainer.steps + 1):
        try:
            record = rl_step(step, version, coord, policy, draft)
            version += 1
            with policy.ranks.stop_on(STOP_ERRORS):  # held-out evaluation scores with the reward functions
                coord.finish_step(version, record)
        except RunAborted as e:
            if e.kind == ClusterFitError.__name__ and version > saved:
                if policy.ranks.is_driver:
                    log.warning("the run stops: saving the state after step %d first", version)
                policy.checkpoint({"step": version}, coord.trainer_state(version, version, draft.state_dict()),
                                  draft.stage(version))
            raise
        # what Ray Train keeps with each report (it logs each whole, on every rank; the rest is in metrics.jsonl)
        metrics = {k: v for k, v in (record or {"step": step}).items() if k in REPORTED}
        every = cfg.trainer.save_steps
        if step == cfg.trainer.steps or (every and step % every == 0):
            policy.checkpoint(metrics, coord.trainer_state(step, version, draft.state_dict()), draft.stage(step))
            saved = version
        else:
            policy.report(metrics)


@report_aborts
def rl_worker_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (a ``RunAborted`` ends
    it without a failure: ``report_aborts``).

    Args:
        config: {"cfg": RunConfig, "aux_layer_ids": list | None,
            "cores": {node id: CPU cores} of the train role, or absent,
            "draft_prior": the head's recorded acceptance length
            (``TrainingCadence``'s prior), None or absent}.
    """
    import ray.train
    import ray.train.torch

    from rayspec.models import load_policy, load_tokenizer, resolve_model_path

    cfg: RunConfig = config["cfg"]
    cores = (config.get("cores") or {}).get(ray.get_runtime_context().get_node_id())
    if cores:
        os.sched_setaffinity(0, cores)  # the placement plan's cores, before torch starts threads
    # Ray Train gives the root logger its console handler (and routes print()
    # through it too, twice on some stdout setups): log, and add no handler.
    logging.getLogger("rayspec").setLevel(cfg.logging.level)
    relay_warnings()  # and to the driver's console (rayspec.console)
    if cfg.train.torch_threads_per_worker:
        torch.set_num_threads(cfg.train.torch_threads_per_worker)
    torch.manual_seed(cfg.trainer.seed)
    tctx = ray.train.get_context()
    ranks = Ranks(tctx.get_world_rank(), tctx.get_world_size())
    # the policy as this node has it: a bundled model is in this node's own model.cache_dir
    model_dir = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    tokenizer = load_tokenizer(model_dir)
    # The GPU Ray Train gave this worker. DeepSpeed would take cuda:<LOCAL_RANK>, but Ray
    # Train numbers local ranks per node IP and shares CUDA_VISIBLE_DEVICES per Ray node,
    # which disagree where one host runs several Ray nodes.
    gpu_index = ray.train.torch.get_device().index if cfg.train.num_gpus_per_worker > 0 else None
    device = torch.device("cuda", gpu_index) if gpu_index is not None else torch.device("cpu")
    draft = open_draft(cfg, ranks, config["aux_layer_ids"], config.get("draft_prior"))
    with ranks.stop_on(USER_ERRORS):  # the dataset and the reward functions load on rank 0
        coord = Coordinator.start(cfg, tokenizer, device, lambda: draft.acceptance) if ranks.is_driver \
            else Follower()
    coord.release_replicas(refit_next=False)  # before DeepSpeed allocates on their devices (the ranks wait below)
    check_devices(cfg, coord, draft, ranks, gpu_index)
    ds_config = deepspeed_config(cfg, ranks.world)
    with zero3_init(ds_config, gpu_index):
        model = load_policy(model_dir, training_load_dtype(cfg))
    if cfg.train.gradient_checkpointing:  # the EAGLE-3 capture hooks are gone before the recompute
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.train.lora.enabled:  # the same seed on every rank: the same initial adapter
        model = wrap_lora(model, cfg.train.lora)
    engine = build_engine(model, ds_config, device_rank=gpu_index)
    ref_model = None
    if cfg.grpo.kl_coef > 0 and is_lora(engine.module):  # the base model: the policy with its adapter off
        ref_model = AdapterOff(engine.module)
    elif cfg.grpo.kl_coef > 0:  # frozen, beside the policy on its device, in its compute dtype
        ref_model = load_policy(model_dir, next(engine.module.parameters()).dtype)
        ref_model = ref_model.eval().requires_grad_(False).to(engine.device)
    policy = PolicyWorker(engine, cfg, ranks, tokenizer.pad_token_id, _dtype(cfg.model.dtype), ref_model,
                          make_source(cfg, ranks, device, adapter_config(engine.module) if is_lora(engine.module)
                                      else None))
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        version = resume(checkpoint, policy, coord, draft)
    else:
        version = 0
        start_over(policy, coord, draft, lora=cfg.train.lora.enabled)
    run_steps(cfg, coord, policy, draft, version)
    coord.close()
    run_dir = Path(cfg.trainer.run_dir)
    if cfg.train.lora.enabled:
        save_adapter(policy, run_dir / "adapter")
    if not cfg.train.lora.enabled or cfg.train.lora.save_merged:
        save_policy(policy, tokenizer, run_dir / "policy")
    if ranks.is_driver:
        log.info("curves: %s", plot_run(cfg.trainer.run_dir))


def training_load_dtype(cfg: RunConfig) -> torch.dtype:
    """The dtype a Train worker loads the policy in: bf16 where DeepSpeed
    trains in bf16, since it casts the module to bf16 before its optimizer
    copies the fp32 master weights from it (``DeepSpeedEngine.
    _configure_distributed_model``, 0.19.8): an fp32 load builds the same
    engine from twice the host memory (4 bytes a parameter per worker while
    it builds: 33 GB at 8B). fp32 otherwise."""
    bf16 = cfg.train.deepspeed.get("bf16") or {}
    return torch.bfloat16 if bf16.get("enabled") else torch.float32


def open_draft(cfg: RunConfig, ranks: Ranks, aux_layer_ids, prior) -> DraftClient | NullDraft:
    """The run's draft client on every rank: ``NullDraft`` without online
    training, else a ``DraftClient`` of the DraftTrainer actor (a dead one,
    where it died before these Train workers started)."""
    if not aux_layer_ids:
        return NullDraft()
    actor, lost = find_draft_trainer(ranks, True)
    client = DraftClient(actor, ranks, aux_layer_ids, cfg.draft.steps_per_rl_step,
                         TrainingCadence(cfg.draft.idle_train_every, cfg.draft.min_acceptance_gain,
                                         cfg.draft.min_drafted_share, prior=prior,
                                         max_idle_every=cfg.draft.idle_train_max_every),
                         checkpoints=lambda: checkpoints(train_storage(cfg.trainer)))
    if lost:
        client.lost()
    else:
        client.connect()
    return client


def check_devices(cfg: RunConfig, coord, draft, ranks: Ranks, gpu_index: int | None) -> None:
    """Collective, before DeepSpeed allocates: the GPU each Train rank uses
    (entry ``gpu_index`` of its CUDA_VISIBLE_DEVICES), each replica's and the
    DraftTrainer's, checked against the layout (``check_device_sharing``);
    rank 0 logs the device table. Raises RunAborted (naming the
    ClusterFitError) on every rank where a device holds what the layout
    does not allow."""
    gpu = assigned_gpu(gpu_index) if gpu_index is not None else None
    train = ranks.all_gather((ray.get_runtime_context().get_node_id(), gpu))
    error = ranks.broadcast(coord.check_devices(train, draft))
    if error:  # on every rank; a restart would place the roles the same way
        raise RunAborted(f"ClusterFitError: {error}")


def resume(checkpoint, policy: Policy, coord: Coordinator | Follower, draft: DraftClient | NullDraft) -> int:
    """Restore a checkpoint (a resumed run, or Train workers restarted after a
    failure) and send its weights to the replicas; returns the policy version
    (= the last step the checkpoint finished). Collective."""
    state, draft_version = policy.restore(checkpoint, draft.restore())
    version = state["policy_version"]
    coord.restore(state)
    draft.load_state_dict(state)
    coord.refit(version, policy.refit_weights(), draft.head(draft_version))
    coord.wait_refits()
    policy.refit_sent()
    if policy.ranks.is_driver:
        if draft_version is None and draft.alive:
            log.warning("checkpoint %s holds no draft state: the DraftTrainer continues from its current head",
                        checkpoint.path)
        # a warning: after a failure, the console's only word that the Train workers restarted (rayspec.console)
        log.warning("the Train workers resumed from %s after step %d (policy version %d, draft version %d, "
                    "prompt cursor %s)", checkpoint.path, state["step"], version, draft.version, state["prompts"])
    return version


def start_over(policy: Policy, coord: Coordinator | Follower, draft: DraftClient | NullDraft,
               lora: bool = False) -> None:
    """Starting at version 0 (no checkpoint): the records of an attempt that
    failed before any checkpoint are discarded, and where the replicas hold
    a later policy or draft, or the DraftTrainer a trained head (the worker
    group restarted before the first checkpoint), the DraftTrainer goes back
    to its initial head and the replicas get this policy and that head;
    a LoRA policy's (``lora``) replicas get its initial adapter (B = 0: the base
    model's outputs) in any case, so that from the first request they serve
    what every later version costs (adaptive k measures its costs on it);
    then the initial policy is evaluated. Collective."""
    stale = False
    if policy.ranks.is_driver:
        coord.discard_after(0)
        trained = draft.reset()
        stale = trained or any(v["policy"] != 0 or (draft.alive and v["draft"] != 0)
                               for v in coord.replica_versions())
        if stale:
            log.warning("no checkpoint to restore: the run starts over from step 1 and resets the replicas%s",
                        " and the draft head" if draft.alive else "")
    if policy.ranks.broadcast(stale) or lora:
        coord.refit(0, policy.refit_weights(), draft.head(0) if stale else None)
        coord.wait_refits()
        policy.refit_sent()
    with policy.ranks.stop_on(STOP_ERRORS):
        coord.evaluate(0)


def save_adapter(policy: PolicyWorker, out: Path) -> None:
    """Write a LoRA policy's adapter in peft's format (rank 0:
    ``adapter_model.safetensors`` in the serving dtype, ``adapter_config.json``),
    into a temp dir renamed into place."""
    if not policy.ranks.is_driver:
        return
    from rayspec.sync.lora import write_adapter

    module = policy.engine.module
    tensors = {name: t.detach().to("cpu", policy.serve_dtype) for name, t, _ in adapter_parameters(module)}
    with write_dir_atomic(out) as tmp:
        write_adapter(tensors, adapter_config(module), tmp)


def save_policy(policy: PolicyWorker, tokenizer, out: Path) -> None:
    """Write the trained policy as an HF directory (rank 0; collective under
    ZeRO-3), into a temp dir renamed into place so a crash never leaves a
    partial model. A LoRA policy is written with its adapter merged into
    the base weights (peft's ``merge_and_unload``: the run is over)."""
    model = policy.engine.module
    if is_lora(model):
        model = model.merge_and_unload()
        sd = {name: t.detach().to("cpu", policy.serve_dtype) for name, t in model.state_dict().items()} \
            if policy.ranks.is_driver else None
    else:
        sd = policy.full_state_dict()
    if not policy.ranks.is_driver:
        return
    if not sys.stderr.isatty():  # transformers' "Writing model shards" bar: only where someone watches
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with write_dir_atomic(out) as tmp:
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
