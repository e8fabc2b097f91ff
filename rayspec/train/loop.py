"""The RL step, run inside Ray Train workers.

Rank 0 drives the step (rollouts through the Serve handle, rewards, the
DraftTrainer, weight sync); every rank holds a DeepSpeed ZeRO shard of the
policy and trains on its slice of the batch.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from rayspec.batch import RolloutBatch
from rayspec.config import RunConfig
from rayspec.data import PromptSource, batch_rewards, chat_prompt_ids, heldout_split, load_problems
from rayspec.draft.trainer import TrainingCadence
from rayspec.metrics import DashboardMetrics, MetricsLog, PhaseTimer, format_step_line, plot_run
from rayspec.rollout import serve as rollout
from rayspec.scheduler.pipeline import RolloutPipeline
from rayspec.scheduler.placement import ClusterFitError, assigned_gpu, check_device_sharing
from rayspec.sync import make_transport
from rayspec.train.checkpoint import report_checkpoint, restore_checkpoint, restore_draft_state, stage_draft_state
from rayspec.train.evaluate import eval_due, read_baseline, score_eval, write_baseline
from rayspec.train.grpo import group_advantages
from rayspec.train.policy import (build_engine, deepspeed_config, full_state_dict, num_micro_batches,
                                  policy_update, verifier_output_weights)

log = logging.getLogger(__name__)

DRAFT_TRAINER_NAME = "rayspec-draft-trainer"
EVAL_SEED_KEY = -1  # shard_seed key of the evaluations' sampling (rollout batches count from 1)


class StepContext:
    """What rank 0 needs across steps: prompts, tokenizer, handles, the
    rollout pipeline, logs, the draft training cadence (``draft_prior``:
    the head's recorded acceptance length, ``TrainingCadence``)."""

    def __init__(self, cfg: RunConfig, tokenizer, device: torch.device, draft_prior: float | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        problems, self.eval_problems = heldout_split(
            load_problems(cfg.data), cfg.data.eval_num_problems if cfg.trainer.eval_every else 0)
        self.prompts = PromptSource(problems, cfg.data.prompts_per_step, cfg.data.seed)
        self.rollout = rollout.get_rollout_handle()
        # the newest weights sent are kept by the transport: every rollout carries
        # their versions so a replica Serve restarted catches up first
        self.transport = make_transport(cfg.rollout.weight_sync, self.rollout,
                                        trainer_has_gpu=device.type == "cuda",
                                        replicas_have_gpu=cfg.rollout.num_gpus_per_replica > 0,
                                        shared_gpus=cfg.scheduler.layout == "colocate", device=device)
        lag = cfg.scheduler.max_policy_lag if cfg.scheduler.mode == "async" else 0
        self.pipeline = RolloutPipeline(self.submit_rollout, lag)
        self.log = MetricsLog(cfg.trainer.run_dir)
        self.dashboard = DashboardMetrics(Path(cfg.trainer.run_dir).name,
                                          cfg.rollout.speculative_config.method, cfg.grpo.max_new_tokens)
        # a resumed run's baseline (the initial policy's greedy answers) is on disk
        self.eval_prompts = [chat_prompt_ids(tokenizer, p) for p in self.eval_problems]
        self.eval_baseline = read_baseline(cfg.trainer.run_dir, self.eval_problems)
        self.evals: list[dict[str, Any]] = []  # evaluations since the last step record
        self.sleep_reported = False
        self.batches = 0  # batches drawn: the RL step the last submitted batch trains at
        self.draft_alive = True
        self.draft_version = 0
        self.draft_acceptance: tuple | None = None  # the DraftTrainer's estimate (version, rates, by share)
        self.draft_cadence = TrainingCadence(cfg.draft.idle_train_every, cfg.draft.min_acceptance_gain,
                                             cfg.draft.min_drafted_share, prior=draft_prior,
                                             max_idle_every=cfg.draft.idle_train_max_every)

    def submit_rollout(self):
        """Start the next prompts' rollouts on the replicas; returns
        (pending, (problems, the prompt cursor before them))."""
        cfg = self.cfg
        cursor = self.prompts.state_dict()
        problems = self.prompts.next_batch()
        self.batches += 1
        pending = rollout.submit(
            self.rollout, [chat_prompt_ids(self.tokenizer, p) for p in problems], cfg.rollout.num_replicas,
            seed=rollout.shard_seed(cfg.trainer.seed, self.batches), refits=self.transport.rollout_refits(),
            catch_up=self.transport.catch_up, draft_acceptance=self.draft_acceptance,
            n=cfg.grpo.group_size, temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p,
            max_tokens=cfg.grpo.max_new_tokens)
        return pending, (problems, cursor)

    def refit(self, target: str, weights: dict[str, torch.Tensor], version: int) -> None:
        """Send ``target``'s (``policy`` | ``draft``) weights (host tensors)
        to every replica through the weight transport; sync mode waits for
        them to land, async leaves them queued behind the rollouts in flight."""
        self.pipeline.refit(self.transport.send(target, weights, version))
        if self.cfg.scheduler.mode == "sync":
            self.pipeline.wait_refits()

    def evaluate(self, version: int) -> None:
        """Score policy ``version`` on the held-out problems if it is due
        (``eval_due``), once every refit sent has landed; the result waits in
        ``self.evals`` for the next step record. Version 0's greedy responses
        become the baseline of ``greedy_changed``."""
        cfg = self.cfg
        if not eval_due(version, cfg.trainer.eval_every, cfg.trainer.steps):
            return
        self.pipeline.wait_refits()
        t0 = time.perf_counter()
        prompts = self.eval_prompts
        common = {"refits": self.transport.rollout_refits(), "catch_up": self.transport.catch_up,
                  "max_tokens": cfg.grpo.max_new_tokens}
        greedy, _ = rollout.generate(self.rollout, prompts, cfg.rollout.num_replicas, n=1, temperature=0.0,
                                     **common)
        # the same seed at every evaluation: common random numbers across versions
        sampled, stats = rollout.generate(self.rollout, prompts, cfg.rollout.num_replicas,
                                          seed=rollout.shard_seed(cfg.trainer.seed, EVAL_SEED_KEY),
                                          n=cfg.trainer.eval_samples, temperature=cfg.grpo.temperature,
                                          top_p=cfg.grpo.top_p, **common)
        if version == 0:  # the initial policy's answers are the baseline, whatever a file says
            write_baseline(cfg.trainer.run_dir, self.eval_problems, greedy)
            self.eval_baseline = greedy.response_ids
        rec = {**score_eval(self.eval_problems, greedy, sampled, stats, self.eval_baseline),
               "time_s": time.perf_counter() - t0}
        self.evals.append(rec)
        log.info("eval v%d (%d held-out problems): reward greedy %.3f, T=%g %.3f | greedy changed %s | "
                 "accept_len %.2f | %.1fs", rec["policy_version"], len(prompts), rec["reward_greedy"],
                 cfg.grpo.temperature, rec["reward_sampled"],
                 f"{rec['greedy_changed']:.2f}" if "greedy_changed" in rec else "n/a",
                 rec["acceptance_length"], rec["time_s"])

    def trainer_state(self, step: int, version: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` resumes from. Batches generated
        ahead (async) are not kept: the cursor is the one before them."""
        ahead = self.pipeline.ahead()
        return {"step": step, "policy_version": version, "draft_version": self.draft_version,
                "draft_cadence": self.draft_cadence.state_dict(),
                "prompts": ahead[0][1] if ahead else self.prompts.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after ``state``'s step: its prompt cursor, batch count and
        draft training cadence;
        metrics.jsonl records of later steps (a failed attempt) move to
        metrics.discarded.jsonl."""
        self.prompts.load_state_dict(state["prompts"])
        self.batches = state["step"]
        self.draft_version = state.get("draft_version", 0)
        if "draft_cadence" in state:  # absent from checkpoints written before the cadence
            self.draft_cadence.load_state_dict(state["draft_cadence"])
        self.log.discard_after(state["step"])

    def release_replicas(self) -> None:
        """Colocated: replicas free their memory while the policy trains."""
        slept = rollout.broadcast(self.rollout, "sleep")
        if not self.sleep_reported:
            self.sleep_reported = True
            log.info("colocate: %s", "replicas sleep (vLLM sleep mode) while the policy trains"
                     if all(slept) else "vLLM has no sleep mode on this platform; rollout, "
                     "training and draft time-slice the same cores")


def score(batch: RolloutBatch, problems) -> None:
    """Rewards and GRPO advantages, in place."""
    batch.rewards = batch_rewards(batch, problems)
    batch.advantages = group_advantages(batch.rewards, batch.group)


def check_devices(cfg: RunConfig, ctx: StepContext | None, draft, rank: int, world: int,
                  gpu_index: int | None) -> None:
    """Collective, before DeepSpeed allocates: the GPU each Train rank uses
    (entry ``gpu_index`` of its CUDA_VISIBLE_DEVICES), each replica's and the
    DraftTrainer's, checked against the layout (``check_device_sharing``);
    rank 0 logs the device table. Raises ClusterFitError on every rank where
    a device holds what the layout does not allow."""
    ranks = [None] * world
    gpu = assigned_gpu(gpu_index) if gpu_index is not None else None
    dist.all_gather_object(ranks, (ray.get_runtime_context().get_node_id(), gpu))
    error = None
    if rank == 0:
        occupants = {"rollout": rollout.broadcast(ctx.rollout, "node_and_gpu"), "train": ranks}
        if draft is not None:
            try:
                occupants["draft"] = [ray.get(draft.node_and_gpu.remote())]
            except ray.exceptions.RayActorError:
                pass  # the first step finds it dead and goes on without it (draft_died)
        try:
            table = check_device_sharing(cfg.scheduler.layout, occupants)
            if table:
                log.info("GPUs (%s):\n%s", cfg.scheduler.layout, table)
        except ClusterFitError as e:
            error = str(e)
    error = _broadcast_object(error, rank)
    if error:
        raise ClusterFitError(error)


def _broadcast_object(obj, rank: int):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _overlap(intervals, t0: float, t1: float) -> float:
    """Seconds of ``intervals`` [(start, end)] inside [t0, t1]."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


def rl_step(step: int, engine, ctx: StepContext | None, draft, cfg: RunConfig, rank: int,
            world: int, pad_id: int, aux_layer_ids, ref_model, version: int) -> dict[str, Any] | None:
    """rollout (or take the one generated ahead) -> score -> train (draft
    beside it) -> refit. ``version`` is the policy version being trained.
    Returns rank 0's metrics record (None on other ranks)."""
    timer = PhaseTimer()
    t_start = time.time()
    with timer("rollout"):
        if rank == 0:
            batch, stats, (problems, _), lag = ctx.pipeline.next(version)
            score(batch, problems)
            if cfg.scheduler.layout == "colocate":
                ctx.release_replicas()
            train_draft = draft is not None and cfg.draft.steps_per_rl_step > 0 and \
                ctx.draft_cadence.due(stats.drafted_share)
        batch, train_draft = _broadcast_object((batch, train_draft) if rank == 0 else None, rank)
    # the verifier's output layer before the update: the features come from it
    verifier = verifier_output_weights(engine, rank) if train_draft else None
    shard = batch.shard(rank, world)
    draft_call = None
    if rank == 0 and train_draft:
        # Starts now and trains on each micro-batch's features as they come.
        draft_call = draft.train.remote(ray.put(verifier), cfg.draft.steps_per_rl_step,
                                        expect=world * num_micro_batches(engine, len(shard)))
    # chunk order micro-batch-major: the DraftTrainer's order whatever the ranks' timing
    on_features = (lambda ref, micro: draft.submit_features.remote([ref], [micro * world + rank])) \
        if train_draft else None
    with timer("policy"):
        train_m, refs = policy_update(engine, shard, cfg, pad_id,
                                      aux_layer_ids if train_draft else None, ref_model, on_features)
    with timer("sync"):
        with timer("gather"):
            sd = full_state_dict(engine, _dtype(cfg.model.dtype), rank)
        if rank == 0:
            ctx.refit("policy", sd, version + 1)
            del sd
    draft_m: dict[str, Any] = {}
    if draft_call is not None:
        with timer("draft"):
            try:
                draft_m = ray.get(draft_call)
            except ray.exceptions.RayActorError as e:
                draft_died(ctx, step, e)
        if draft_m:
            ctx.draft_version = draft_m["draft_version"]
            ctx.draft_cadence.trained(draft_m["draft_acceptance_estimate"], draft_m["draft_acceptance_se"],
                                      draft_m["draft_acceptance_clusters"])
            # replayed with the head the step began with; it goes out with the newer head
            # (the replicas' measured / estimated calibration absorbs the difference)
            ctx.draft_acceptance = (ctx.draft_version, draft_m["draft_acceptance_estimate"],
                                    draft_m["draft_acceptance_by_share"])
            with timer("sync"):
                ctx.refit("draft", ray.get(draft.vllm_weights.remote()), ctx.draft_version)
    dist.barrier()  # feature ObjectRefs are owned by their ranks: keep them alive until used
    del refs
    if rank != 0:
        return None
    t_end = time.time()
    window = t_end - t_start
    busy = rollout.broadcast(ctx.rollout, "busy_intervals", t_start)
    rollout_busy = sum(_overlap(iv, t_start, t_end) for iv in busy) / max(1, len(busy))
    resp_lens = [len(r) for r in batch.response_ids]
    record = {
        "step": step,
        "reward_mean": sum(batch.rewards) / len(batch.rewards),
        "acceptance_length": stats.acceptance_length,
        "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
        "rollout_tokens_per_s": stats.tokens_per_s,
        "layout": cfg.scheduler.layout,
        "mode": cfg.scheduler.mode,
        "policy_lag": lag,
        "rollout_retries": ctx.pipeline.last_retries,
        "time_step_s": window,
        # what the trainer waited for the batch (all of its generation in sync mode)
        "time_rollout_s": timer.seconds.get("rollout", 0.0),
        "rollout_generation_s": stats.wall_s,
        "time_policy_s": timer.seconds.get("policy", 0.0),
        # the DraftTrainer's own seconds; the part the step waited for after the policy update:
        "time_draft_s": draft_m.get("time_s", 0.0),
        "time_draft_exposed_s": timer.seconds.get("draft", 0.0),
        "time_sync_s": timer.seconds.get("sync", 0.0),
        "time_sync_gather_s": timer.seconds.get("gather", 0.0),
        # weight_sync_transport, weight_sync_bytes, time_sync_transfer_s, time_sync_load_s
        **ctx.transport.take_stats(),
        "phase_intervals": timer.intervals,  # {phase: [[start, end]]}, epoch seconds
        # seconds of the step each role was not working (replicas: mean over replicas)
        "idle_rollout_s": max(0.0, window - rollout_busy),
        "idle_train_s": max(0.0, window - timer.seconds.get("policy", 0.0)
                            - timer.seconds.get("gather", 0.0)),
        "policy_version": batch.policy_version,
        "draft_version": ctx.draft_version,
        "draft_loss": draft_m.get("draft_loss", float("nan")),
        "draft_top1_per_step": draft_m.get("draft_top1_per_step", []),
        "draft_acceptance_estimate": draft_m.get("draft_acceptance_estimate", []),
        "draft_acceptance_se": draft_m.get("draft_acceptance_se", 0.0),
        "draft_acceptance_clusters": draft_m.get("draft_acceptance_clusters", 0),
        "draft_acceptance_by_share": draft_m.get("draft_acceptance_by_share", []),
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "rollout_tokens": stats.output_tokens,
        "drafted_share": stats.drafted_share,  # what the draft training cadence reads
        "response_len_mean": sum(resp_lens) / len(resp_lens),
        "response_lens": resp_lens,  # per sample: the performance model's concurrency decay
        "prompt_len_mean": sum(len(p) for p in batch.prompt_ids) / len(batch.prompt_ids),
        "replicas": {rid: s.summary() for rid, s in sorted(stats.replicas.items())},
        # the problems trained on (index in the dataset): a resumed run's are checkable
        "problem_ids": [p.index for p in problems],
        # one rollout for people reading the log: the step's first sample
        "sample": {"question": problems[batch.group[0]].question,
                   "answer": problems[batch.group[0]].answer,
                   "response": batch.texts[0], "reward": batch.rewards[0]},
        **train_m,
    }
    if aux_layer_ids:  # the run trains a draft online: whether it still does
        record["draft_alive"] = int(ctx.draft_alive)
    if draft is not None:
        record["draft_trained"] = int(train_draft)
        record["idle_draft_s"] = max(0.0, window - _overlap(
            [(draft_m["start_time"], draft_m["end_time"])] if draft_m else [], t_start, t_end))
    return record


def find_draft_trainer(ctx: StepContext | None, online: bool):
    """The DraftTrainer's actor handle on every rank, or None on every rank
    where the run trains no draft online or the DraftTrainer died before
    these Train workers started (a worker group restarted after a failure:
    the run goes on with the head the replicas hold). Collective: the ranks
    agree, since each one submits hidden states to it."""
    if not online:
        return None
    try:
        handle = ray.get_actor(DRAFT_TRAINER_NAME)
    except ValueError:  # a dead actor (max_restarts 0) leaves the name registry
        handle = None
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, handle is not None)
    if all(found):
        return handle
    if ctx is not None:
        ctx.draft_alive = False
        log.warning("the DraftTrainer is gone (it died before these Train workers started); the run "
                    "continues with the draft head on the replicas, no longer trained")
    return None


def draft_died(ctx: StepContext, step: int, err: Exception) -> None:
    """The DraftTrainer is gone: the run goes on with the head the replicas hold."""
    ctx.draft_alive = False
    log.warning("step %d: the DraftTrainer died (%s); the run continues with draft head version %d "
                "on the replicas, no longer trained (checkpoints from now on hold no draft state)",
                step, type(err).__name__, ctx.draft_version)


def _warn_on_policy_mismatch(record: dict[str, Any], cfg: RunConfig) -> None:
    err = record.get("token_mult_prob_error", 0.0)
    if err > cfg.logging.warn_token_mult_prob_error:
        log.warning(
            "step %d: token_mult_prob_error %.3f > %.3f: the rollout engine's probabilities of the "
            "sampled tokens differ from the trainer's. With model.dtype=%s, weight updates smaller "
            "than its rounding step never reach the replicas; model.dtype=float32 serves the "
            "trained weights exactly (slower on CPU). The importance ratio uses the rollout "
            "logprobs, so the gradient stays unbiased, but the rollouts are off-policy.",
            record["step"], err, cfg.logging.warn_token_mult_prob_error, cfg.model.dtype)


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def rl_worker_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer.

    Args:
        config: {"cfg": RunConfig, "model_dir": str, "aux_layer_ids": list | None,
            "cores": {node id: CPU cores} of the train role, or absent,
            "draft_prior": the head's recorded acceptance length
            (``TrainingCadence``'s prior), None or absent}.
    """
    import ray.train
    import ray.train.torch

    cfg: RunConfig = config["cfg"]
    cores = (config.get("cores") or {}).get(ray.get_runtime_context().get_node_id())
    if cores:
        os.sched_setaffinity(0, cores)  # the placement plan's cores, before torch starts threads
    # Ray Train gives the root logger its console handler (and routes print()
    # through it too, twice on some stdout setups): log, and add no handler.
    logging.getLogger("rayspec").setLevel(cfg.logging.level)
    if cfg.train.torch_threads_per_worker:
        torch.set_num_threads(cfg.train.torch_threads_per_worker)
    torch.manual_seed(cfg.trainer.seed)
    tctx = ray.train.get_context()
    rank, world = tctx.get_world_rank(), tctx.get_world_size()

    from rayspec.models import load_policy, load_tokenizer

    tokenizer = load_tokenizer(config["model_dir"])
    # The GPU Ray Train gave this worker. DeepSpeed would take cuda:<LOCAL_RANK>, but Ray
    # Train numbers local ranks per node IP and shares CUDA_VISIBLE_DEVICES per Ray node,
    # which disagree where one host runs several Ray nodes.
    gpu_index = ray.train.torch.get_device().index if cfg.train.gpus_per_worker > 0 else None
    device = torch.device("cuda", gpu_index) if gpu_index is not None else torch.device("cpu")
    ctx = StepContext(cfg, tokenizer, device, config.get("draft_prior")) if rank == 0 else None
    draft = find_draft_trainer(ctx, bool(config["aux_layer_ids"]))
    if rank == 0 and cfg.scheduler.layout == "colocate":
        ctx.release_replicas()  # before DeepSpeed allocates on their devices (the ranks wait below)
    check_devices(cfg, ctx, draft, rank, world, gpu_index)
    model = load_policy(config["model_dir"], torch.float32)
    if cfg.train.gradient_checkpointing:  # the EAGLE-3 capture hooks are gone before the recompute
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = build_engine(model, deepspeed_config(cfg, world), device_rank=gpu_index)
    ref_model = None
    if cfg.grpo.kl_coef > 0:  # frozen, beside the policy on its device, in its compute dtype
        ref_model = load_policy(config["model_dir"], next(engine.module.parameters()).dtype)
        ref_model = ref_model.eval().requires_grad_(False).to(engine.device)
    version = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        version = resume(checkpoint, engine, ctx, draft, cfg, rank)
    else:
        if rank == 0:  # records of an attempt that failed before any checkpoint
            ctx.log.discard_after(0)
        reset_replicas(engine, ctx, draft, cfg, rank)
        if rank == 0:
            ctx.evaluate(0)
    for step in range(version + 1, cfg.trainer.steps + 1):
        if draft is not None and not _broadcast_object(ctx.draft_alive if rank == 0 else None, rank):
            draft = None
        record = rl_step(step, engine, ctx, draft, cfg, rank, world, tokenizer.pad_token_id,
                         config["aux_layer_ids"], ref_model, version)
        version += 1
        if rank == 0:
            ctx.evaluate(version)
            if ctx.evals:
                record["evals"], ctx.evals = ctx.evals, []
            ctx.log.write(record)
            ctx.dashboard.record(record)
            log.info(format_step_line(record))
            _warn_on_policy_mismatch(record, cfg)
        metrics = {k: v for k, v in (record or {"step": step}).items() if isinstance(v, (int, float))}
        every = cfg.trainer.save_steps
        if step == cfg.trainer.steps or (every and step % every == 0):
            save_checkpoint(metrics, engine, ctx, draft, step, version, rank)
        else:
            ray.train.report(metrics)
    if rank == 0:
        ctx.pipeline.close()
        ctx.transport.close()
    save_policy(engine, tokenizer, Path(cfg.trainer.run_dir) / "policy", _dtype(cfg.model.dtype), rank)
    if rank == 0:
        log.info("curves: %s", plot_run(cfg.trainer.run_dir))


def save_checkpoint(metrics: dict[str, Any], engine, ctx: StepContext | None, draft, step: int,
                    version: int, rank: int) -> None:
    """Checkpoint after ``step`` (collective): every rank's DeepSpeed shard and
    RNG state, rank 0's trainer state and the DraftTrainer's state."""
    def stage_draft(d: Path) -> None:
        try:
            stage_draft_state(draft, d)
        except ray.exceptions.RayActorError as e:
            draft_died(ctx, step, e)

    with_draft = rank == 0 and draft is not None and ctx.draft_alive
    report_checkpoint(metrics, engine, rank, ctx.trainer_state(step, version) if rank == 0 else None,
                      stage_draft if with_draft else None)
    if rank == 0:
        log.info("step %d: checkpoint saved", step)


def resume(checkpoint, engine, ctx: StepContext | None, draft, cfg: RunConfig, rank: int) -> int:
    """Restore a checkpoint (a resumed run, or Train workers restarted after a
    failure) and send its weights to the replicas; returns the policy version
    (= the last step the checkpoint finished). Collective."""
    def restore_draft(d: Path, state: dict[str, Any]) -> int | None:
        try:
            return restore_draft_state(draft, d)
        except ray.exceptions.RayActorError as e:
            draft_died(ctx, state["step"], e)

    state, draft_version = restore_checkpoint(checkpoint, engine, rank,
                                              restore_draft if rank == 0 and draft is not None else None)
    version = state["policy_version"]
    sd = full_state_dict(engine, _dtype(cfg.model.dtype), rank)
    if rank != 0:
        return version
    ctx.restore(state)
    ctx.refit("policy", sd, version)
    del sd
    if draft is not None and ctx.draft_alive:
        if draft_version is None:
            log.warning("checkpoint %s holds no draft state: the DraftTrainer continues from its "
                        "current head", checkpoint.path)
        else:
            try:
                ctx.draft_version = draft_version
                ctx.refit("draft", ray.get(draft.vllm_weights.remote()), ctx.draft_version)
            except ray.exceptions.RayActorError as e:
                draft_died(ctx, state["step"], e)
    log.info("resumed from %s after step %d (policy version %d, draft version %d, prompt cursor %s)",
             checkpoint.path, state["step"], version, ctx.draft_version, state["prompts"])
    ctx.pipeline.wait_refits()
    return version


def reset_replicas(engine, ctx: StepContext | None, draft, cfg: RunConfig, rank: int) -> None:
    """Starting at version 0 (no checkpoint): if the worker group restarted
    before the first checkpoint, the run starts over from step 1 and must
    repeat the first attempt. Where the replicas hold a later policy or
    draft, or the DraftTrainer a trained head, the DraftTrainer goes back to
    its initial head (``DraftTrainer.reset``) and the replicas get this
    policy and that head. Collective."""
    stale = False
    if rank == 0:
        held = rollout.broadcast(ctx.rollout, "versions")
        trained = 0
        if draft is not None:
            try:
                trained = ray.get(draft.reset.remote())
            except ray.exceptions.RayActorError as e:
                draft_died(ctx, 0, e)
        stale = bool(trained) or any(v["policy"] != 0 or (draft is not None and v["draft"] != 0) for v in held)
    if not _broadcast_object(stale, rank):
        return
    sd = full_state_dict(engine, _dtype(cfg.model.dtype), rank)
    if rank == 0:
        log.warning("no checkpoint to restore: the run starts over from step 1 and resets the replicas%s",
                    " and the draft head" if draft is not None and ctx.draft_alive else "")
        ctx.refit("policy", sd, 0)
        if draft is not None and ctx.draft_alive:
            try:
                ctx.refit("draft", ray.get(draft.vllm_weights.remote()), 0)
            except ray.exceptions.RayActorError as e:
                draft_died(ctx, 0, e)
        ctx.pipeline.wait_refits()


def save_policy(engine, tokenizer, out: Path, dtype: torch.dtype, rank: int) -> None:
    """Write the trained policy as an HF directory (rank 0; collective under
    ZeRO-3), into a temp dir renamed into place so a crash never leaves a
    partial model."""
    sd = full_state_dict(engine, dtype, rank)
    if rank != 0:
        return
    if not sys.stderr.isatty():  # transformers' "Writing model shards" bar: only where someone watches
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        engine.module.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
