"""The rollout stage as a Ray Serve application of ``SpecVLLMReplica``s."""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Callable, Optional

import ray
from ray import serve

from rayspec.batch import RolloutBatch
from rayspec.rollout.engine import ReplicaBehind, SpecVLLMEngine, replica_env
from rayspec.rollout.spec_stats import SpecStats

log = logging.getLogger(__name__)

APP_NAME = "rayspec-rollout"
DEPLOYMENT_NAME = "SpecVLLMReplica"


def deploy_rollout(cfg, model_dir: str, draft_dir: str | None,
                   plan=None) -> serve.handle.DeploymentHandle:
    """Start (or replace) the rollout app: ``cfg.rollout.num_replicas`` vLLM replicas.

    Args:
        cfg: RunConfig.
        model_dir: HF directory of the policy.
        draft_dir: EAGLE-3 head / draft model directory (overrides
            ``speculative_config.model``), or None.
        plan: ``PlacementPlan`` giving the replicas their nodes, resources
            and CPU cores; None: ``cfg.rollout`` resources anywhere.

    Returns:
        A handle to the ``SpecVLLMReplica`` deployment.
    """
    spec = dict(vars(cfg.rollout.speculative_config))
    if draft_dir is not None:
        spec["model"] = draft_dir
    env = replica_env(cfg.rollout)
    engine_kwargs = dict(cfg.rollout.engine_kwargs)
    cores = None
    if plan is not None:
        opts = plan.serve_options()
        if cfg.rollout.cpu_omp_threads_bind == "all":
            cores = plan.cores.get("rollout") or None
        # colocated replicas release their memory while the policy trains
        # (where the platform has vLLM's sleep mode; the replica checks)
        engine_kwargs.setdefault("enable_sleep_mode", plan.layout == "colocate")
    else:
        opts = {"ray_actor_options": {"num_cpus": cfg.rollout.num_cpus_per_replica,
                                      "num_gpus": cfg.rollout.num_gpus_per_replica}}
    opts["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    deployment = serve.deployment(SpecVLLMEngine, name=DEPLOYMENT_NAME).options(
        num_replicas=cfg.rollout.num_replicas,
        # vllm.LLM is not thread-safe: one call at a time per replica.
        max_ongoing_requests=1,
        health_check_timeout_s=600,
        **opts,
    )
    ak = cfg.rollout.adaptive_k
    adaptive = ({"margin": ak.margin, "calibration_tokens": ak.calibration_tokens,
                 "calibration_rounds": ak.calibration_rounds, "probe_every": ak.probe_every,
                 "temperature": cfg.grpo.temperature, "max_batch": largest_shard(cfg)} if ak.enabled else None)
    # the rollout app is reached through handles only: no HTTP proxy (no-op
    # where Serve already runs)
    serve.start(proxy_location="Disabled")
    app = deployment.bind(model=model_dir, speculative_config=spec, dtype=cfg.model.dtype,
                          engine_kwargs=engine_kwargs, env=env, cpu_cores_by_node=cores,
                          adaptive_k=adaptive, log_level=cfg.logging.level)
    return serve.run(app, name=APP_NAME, route_prefix=None)


def largest_shard(cfg) -> int:
    """The most sequences one ``generate`` call gives a replica in a run of
    ``cfg`` (RunConfig): a step's rollout shard (``submit``: the prompts
    split over ``rollout.num_replicas``, ``grpo.group_size`` samples each)
    or, with ``trainer.eval_every``, an evaluation's (``trainer.eval_samples``
    samples of ``data.eval_num_problems``). A replica runs one call at a
    time (``max_ongoing_requests=1``), so no batch exceeds it."""
    def shard(prompts: int, n: int) -> int:
        return math.ceil(prompts / cfg.rollout.num_replicas) * n

    evaluation = (shard(cfg.data.eval_num_problems, cfg.trainer.eval_samples)
                  if cfg.trainer.eval_every else 0)
    return max(shard(cfg.data.prompts_per_step, cfg.grpo.group_size), evaluation)


def get_rollout_handle() -> serve.handle.DeploymentHandle:
    """The running rollout deployment's handle (from any process in the cluster)."""
    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)


class PendingRollout:
    """Rollout shards in flight on the replicas (``submit``); ``result()`` joins them.

    A shard whose replica dies mid-generation is sent again through the
    handle (Serve routes it to a live replica, or queues it until the
    controller has replaced the dead one); the lost attempt returns nothing,
    so no sample is duplicated, and with a per-shard seed the retry draws
    the same samples.

    A shard that reaches a replica outside the weight-sync group, holding
    older weights (``ReplicaBehind``), is sent again with ``catch_up``'s
    refits (the weights as ObjectRefs); that is not a retry.
    """

    def __init__(self, handle, shards: list[dict[str, Any]], max_retries: int = 2,
                 catch_up: Optional[Callable[[dict], dict]] = None):
        self._handle, self._shards, self.max_retries = handle, shards, max_retries
        self._catch_up = catch_up
        self._responses = [handle.generate.remote(**kw) for kw in shards]
        self.retries = 0

    def _shard_result(self, i: int):
        attempt = 0
        while True:
            try:
                return self._responses[i].result()
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


def shard_seed(seed: int, *keys: int) -> int:
    """A 62-bit seed for (seed, keys...), e.g. (trainer.seed, RL step, first prompt)."""
    # a str seed is hashed with SHA-512: stable across processes, unlike hash()
    return random.Random(":".join(map(str, (seed, *keys)))).getrandbits(62)


def submit(handle, prompt_ids: list[list[int]], num_shards: int, seed: int | None = None,
           catch_up: Optional[Callable[[dict], dict]] = None, **kwargs: Any) -> PendingRollout:
    """Shard prompts over the replicas through the Serve handle (contiguous
    shards, one per replica); returns without waiting.

    Args:
        seed: each shard samples with ``shard_seed(seed, first prompt)``
            (None: the replicas' own random streams).
        catch_up: see PendingRollout.
        kwargs: further ``SpecVLLMEngine.generate`` arguments (sampling,
            ``refits``).
    """
    num_shards = max(1, min(num_shards, len(prompt_ids)))
    bounds = [round(i * len(prompt_ids) / num_shards) for i in range(num_shards + 1)]
    return PendingRollout(handle, [
        {"prompt_ids": prompt_ids[a:b], "group_offset": a,
         "seed": None if seed is None else shard_seed(seed, a), **kwargs}
        for a, b in zip(bounds, bounds[1:]) if b > a], catch_up=catch_up)


def generate(handle, prompt_ids: list[list[int]], num_shards: int,
             **sampling: Any) -> tuple[RolloutBatch, SpecStats]:
    """``submit`` and wait: (RolloutBatch in input order, summed SpecStats)."""
    return submit(handle, prompt_ids, num_shards, **sampling).result()


def broadcast(handle, method: str, *args, **kwargs) -> list:
    """Call ``method`` on every replica (Serve ``handle.broadcast``) and wait."""
    return handle.broadcast(method, *args, **kwargs).results()
