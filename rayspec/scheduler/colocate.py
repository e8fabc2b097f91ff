"""Colocated, synchronous layout: every role shares the cluster's CPUs (or
GPUs) through fractional resources and the phases of a step take turns.

Each role declares its own resources in the config (rollout:
``num_cpus_per_replica``; train: ``cpus_per_worker``; draft: ``num_cpus``).
On a CPU-only machine the roles time-slice the same cores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import ray
from omegaconf import OmegaConf

from rayspec.config import RunConfig
from rayspec.models import load_policy, resolve_model_path

log = logging.getLogger(__name__)

NAMESPACE = "rayspec"


def init_ray(cfg: RunConfig) -> None:
    """Join ``ray.address`` or start an embedded cluster sized by the config.

    Under ``ray job submit`` the job's driver joins its cluster (address
    ``auto`` is implied by RAY_ADDRESS).
    """
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if cfg.ray.address is not None or os.environ.get("RAY_ADDRESS"):
        ray.init(address=cfg.ray.address, namespace=NAMESPACE, runtime_env=env)
    else:
        # "local": always a new embedded cluster, never a stray `ray start` one
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                 object_store_memory=cfg.ray.object_store_memory,
                 namespace=NAMESPACE, runtime_env=env)


def _absolute(cfg: RunConfig) -> RunConfig:
    """Resolve relative paths against the driver's cwd (workers run elsewhere)."""
    def absp(p):
        return p if p is None or "://" in p or p.startswith("bundled:") or not os.path.exists(p) \
            else str(Path(p).expanduser().resolve())
    cfg = dataclasses.replace(cfg)
    cfg.trainer = dataclasses.replace(cfg.trainer, run_dir=str(Path(cfg.trainer.run_dir).expanduser().resolve()))
    cfg.data = dataclasses.replace(cfg.data, path=absp(cfg.data.path))
    cfg.model = dataclasses.replace(cfg.model, path=absp(cfg.model.path),
                                    cache_dir=str(Path(cfg.model.cache_dir).expanduser()))
    return cfg


def prepare_draft(cfg: RunConfig, model_dir: str, run_dir: Path) -> tuple[str | None, list[int] | None]:
    """The draft checkpoint replicas start with, and the aux layers to capture.

    For eagle3 the head lives in ``<run_dir>/draft_head``: a copy of
    ``speculative_config.model`` when given, else the head already there, else
    a new head for the policy. The aux layers are the head's own.
    """
    spec = cfg.rollout.speculative_config
    if spec.method != "eagle3":
        return spec.model, None
    from rayspec.draft.eagle3 import init_head, load_head, save_head

    head_dir = run_dir / "draft_head"
    if spec.model is not None:
        save_head(load_head(spec.model), head_dir)
    elif not (head_dir / "model.safetensors").is_file():
        save_head(init_head(load_policy(model_dir), cfg.draft.aux_hidden_state_layer_ids,
                            seed=cfg.trainer.seed), head_dir)
    head_cfg = json.loads((head_dir / "config.json").read_text())
    return str(head_dir), head_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def run(cfg: RunConfig) -> Path:
    """Run ``cfg.trainer.steps`` GRPO steps; returns the run directory.

    Raises:
        ConfigError / FileNotFoundError: bad config or missing model/data,
            before any cluster resources are taken.
    """
    from ray import serve
    from ray.train import RunConfig as TrainRunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayspec.draft.trainer import DraftTrainer
    from rayspec.rollout.serve import deploy_rollout
    from rayspec.train.loop import DRAFT_TRAINER_NAME, draft_online, rl_worker_loop

    cfg = _absolute(cfg)
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    model_dir = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    draft_dir, aux_ids = prepare_draft(cfg, model_dir, run_dir)

    init_ray(cfg)
    t0 = time.perf_counter()
    log.info("deploying %d rollout replica(s) (speculative_config=%s)", cfg.rollout.num_replicas,
             cfg.rollout.speculative_config)
    serve.start(proxy_location="Disabled")
    deploy_rollout(cfg, model_dir, draft_dir)
    draft = None
    if draft_online(cfg):
        draft = ray.remote(DraftTrainer).options(
            name=DRAFT_TRAINER_NAME, num_cpus=cfg.draft.num_cpus).remote(
            draft_dir, cfg.draft.lr, cfg.draft.ttt_steps, cfg.draft.torch_threads,
            cfg.draft.buffer_steps, cfg.trainer.seed)
    log.info("rollout ready in %.0fs", time.perf_counter() - t0)
    try:
        trainer = TorchTrainer(
            rl_worker_loop,
            train_loop_config={"cfg": cfg, "model_dir": model_dir,
                               "aux_layer_ids": aux_ids if draft is not None else None},
            scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=False,
                                         resources_per_worker={"CPU": cfg.train.cpus_per_worker}),
            run_config=TrainRunConfig(name="train", storage_path=str(run_dir / "ray_train")),
        )
        trainer.fit()
        if draft is not None:
            ray.get(draft.save.remote(str(run_dir / "draft_head")))
    finally:
        serve.delete("rayspec-rollout")
        if draft is not None:
            ray.kill(draft)
    return run_dir
