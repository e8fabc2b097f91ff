"""The rollout stage as a Ray Serve application of ``SpecVLLMReplica``s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from pathlib import Path

from ray import serve

from rayspec.config import replica_transfer_backend
from rayspec.models import resolve_model_path
from rayspec.rollout.engine import SpecVLLMEngine, replica_env

APP_NAME = "rayspec-rollout"
DEPLOYMENT_NAME = "SpecVLLMReplica"


class SpecVLLMReplica(SpecVLLMEngine):
    """``SpecVLLMEngine`` as a Serve replica: ``generate`` is a coroutine, so
    the replica takes up to ``max_ongoing_requests`` request units at once
    and the engine batches them. Each waits for its requests in a thread of
    the replica's own pool: Serve runs a replica's blocking methods in a
    pool of (num_cpus + 4) threads, which would cap the units in flight at
    5 on a 1-CPU replica.

    Args:
        model: ``model.path``: an HF directory (every replica's node sees
            it), or the bundled model, which the replica's node resolves in
            its own ``model_cache_dir`` (``resolve_model_path``).
        model_cache_dir: ``model.cache_dir``; a leading ``~`` is this
            node's HOME.
        max_ongoing_requests: the deployment's (threads in the pool).
        kwargs: ``SpecVLLMEngine``'s.
    """

    def __init__(self, model: str, model_cache_dir: str, max_ongoing_requests: int = 1, **kwargs):
        super().__init__(model=str(resolve_model_path(model, model_cache_dir)), **kwargs)
        self._units = concurrent.futures.ThreadPoolExecutor(max_ongoing_requests,
                                                            thread_name_prefix="rayspec-request-unit")

    async def generate(self, **kwargs):
        """``SpecVLLMEngine.generate``, awaited."""
        return await asyncio.get_running_loop().run_in_executor(
            self._units, functools.partial(SpecVLLMEngine.generate, self, **kwargs))


def deploy_rollout(cfg, model: str, draft_dir: str | None,
                   plan=None) -> serve.handle.DeploymentHandle:
    """Start (or replace) the rollout app: ``cfg.rollout.num_replicas`` vLLM replicas.

    Args:
        cfg: RunConfig.
        model: the policy: an HF directory, or ``model.path``'s bundled
            model (each replica resolves it on its node, in
            ``cfg.model.cache_dir``).
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
    # the workers' weight-transfer engine: the collective's group, or cuda_ipc's (rayspec.sync)
    engine_kwargs.setdefault("weight_transfer_config", {"backend": replica_transfer_backend(cfg)})
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
    deployment = serve.deployment(SpecVLLMReplica, name=DEPLOYMENT_NAME).options(
        num_replicas=cfg.rollout.num_replicas,
        max_ongoing_requests=cfg.rollout.max_ongoing_requests,
        health_check_timeout_s=600,
        # not a line per request unit (a rollout is one per prompt group): the step line reports rollouts
        logging_config={"enable_access_log": False},
        **opts,
    )
    ak = cfg.rollout.adaptive_k
    adaptive = ({"margin": ak.margin, "probe_every": ak.probe_every, "temperature": cfg.grpo.temperature,
                 "cost_cache": str(Path(cfg.model.cache_dir) / "step_costs")  # ~: the replica's node's
                 if ak.cache_step_costs else None} if ak.enabled else None)
    # the rollout app is reached through handles only: no HTTP proxy (no-op
    # where Serve already runs)
    serve.start(proxy_location="Disabled")
    app = deployment.bind(model=model, model_cache_dir=cfg.model.cache_dir, speculative_config=spec, dtype=cfg.model.dtype,
                          engine_kwargs=engine_kwargs, env=env, cpu_cores_by_node=cores,
                          adaptive_k=adaptive, log_level=cfg.logging.level, engine_cls=cfg.rollout.engine_cls,
                          max_ongoing_requests=cfg.rollout.max_ongoing_requests,
                          in_flight_updates=cfg.scheduler.in_flight_updates, agent=cfg.rollout.agent())
    return serve.run(app, name=APP_NAME, route_prefix=None)


def rollout_client(rollout, stopped=None):
    """A ``RolloutClient`` of the running rollout deployment (from any
    process in the cluster) for ``cfg.rollout``: prompt groups as request
    units where the engine batches calls continuously, else one shard per
    replica; ``stopped``: see ``RolloutClient``."""
    from rayspec.rollout.client import RolloutClient
    from rayspec.vllm.engines import engine_class

    return RolloutClient(serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME), rollout.num_replicas,
                         by_group=engine_class(rollout.engine_cls).concurrent, stopped=stopped)
