"""Serving what a run trained: the final policy with its online-trained
EAGLE-3 head as an OpenAI-compatible endpoint on Ray Serve.

Built on ``ray.serve.llm`` (vLLM's OpenAI server behind Serve's ingress):
chat/completions, streaming, ``/v1/models`` and vLLM's engine metrics,
including the speculative-decoding counters, all come from there. The
rayspec vLLM plugins (the CPU speculative-sampling fix) load in its engine
processes as in the rollout replicas, so served samples follow the policy
exactly as rollouts do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayspec.config import RunConfig, load_config
from rayspec.files import write_dir_atomic
from rayspec.rollout.engine import speculative_config_for_vllm

APP_NAME = "rayspec-serve"


class RunDirError(ValueError):
    """A run directory lacks what serving needs; the message names the path."""


def load_run(run_dir: str | Path) -> tuple[RunConfig, Path, dict[str, Any] | None]:
    """The run's config, its trained policy and the speculative_config to serve it with.

    Args:
        run_dir: a ``jobs.grpo`` run directory (``config.yaml``, ``policy/``
            or a LoRA run's ``adapter/``, and ``draft_head/`` for eagle3).

    Returns:
        (RunConfig, policy directory, vLLM ``speculative_config`` or None when
        the run did not speculate). For eagle3 the draft is the run's
        ``draft_head/`` (the head as trained online up to the last step). A
        LoRA run without ``policy/`` (``train.lora.save_merged`` off) is
        served as its base model with the adapter merged in, written once to
        ``<run_dir>/serve_merged/`` (``merged_policy``): Ray Serve LLM loads
        adapters dynamically from cloud storage only (its
        ``LoraConfig.dynamic_lora_loading_path``, Ray 2.60).

    Raises:
        RunDirError: missing run directory, config, policy or draft head.
        ConfigError: the run's config.yaml no longer validates (e.g. a draft
            directory it names was removed).
    """
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise RunDirError(f"{cfg_path}: missing (not a jobs.grpo run directory?)")
    cfg = load_config(cfg_path)
    policy = run_dir / "policy"
    if not (policy / "config.json").is_file() and (run_dir / "adapter" / "adapter_config.json").is_file():
        policy = merged_policy(cfg, run_dir)
    if not (policy / "config.json").is_file():
        raise RunDirError(f"{policy}: no trained policy (the run wrote none: did it finish?)")
    spec = speculative_config_for_vllm(vars(cfg.rollout.speculative_config))
    if spec is not None and spec["method"] == "eagle3":
        head = run_dir / "draft_head"
        if not (head / "model.safetensors").is_file():
            raise RunDirError(f"{head}: no EAGLE-3 head in the run directory")
        spec["model"] = str(head)
    return cfg, policy, spec


def merged_policy(cfg: RunConfig, run_dir: Path) -> Path:
    """``<run_dir>/serve_merged``: the run's base policy (``model.path``)
    with its LoRA adapter (``<run_dir>/adapter``) merged in by peft
    (``merge_and_unload``), in the serving dtype, with the base's
    tokenizer; written once, into a temp dir renamed into place."""
    import torch
    from peft import PeftModel

    from rayspec.models import load_policy, load_tokenizer, resolve_model_path

    out = run_dir / "serve_merged"
    if (out / "config.json").is_file():
        return out
    base = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype, torch.float32)
    model = PeftModel.from_pretrained(load_policy(base, dtype), str(run_dir / "adapter")).merge_and_unload()
    with write_dir_atomic(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(base).save_pretrained(tmp)
    return out


def llm_config(run_dir: str | Path, model_id: str | None = None, num_replicas: int = 1,
               num_speculative_tokens: int | None = None):
    """A ``ray.serve.llm.LLMConfig`` serving a run's policy and draft.

    Engine settings come from the run's ``rollout`` section: ``model.dtype``,
    ``engine_kwargs`` (max_model_len, enforce_eager, ...), the speculative
    method and k, and each replica's resources (``num_cpus_per_replica``,
    ``num_gpus_per_replica``; GPUs make it a GPU deployment, with
    ``tensor_parallel_size`` GPUs per replica). vLLM's engine metrics are
    exported to Ray (``ray_vllm_*``, spec-decode counters included).

    Args:
        run_dir: see ``load_run``.
        model_id: the OpenAI ``model`` name (default: the run directory's name).
        num_replicas: Serve replicas, each one vLLM engine.
        num_speculative_tokens: k to serve with (default: the run's k).

    Raises:
        RunDirError / ConfigError: see ``load_run``.
        ValueError: num_replicas < 1 or k < 1.
    """
    from ray.serve.llm import LLMConfig

    from rayspec.rollout.engine import cpu_engine_env

    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}: must be >= 1")
    cfg, policy, spec = load_run(run_dir)
    if spec is not None and num_speculative_tokens is not None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: must be >= 1")
        spec["num_speculative_tokens"] = num_speculative_tokens
    ro = cfg.rollout
    engine_kwargs = {**ro.engine_kwargs, "dtype": cfg.model.dtype}
    engine_kwargs.pop("seed", None)  # a server samples with each request's own seed
    for key in ("enable_lora", "max_lora_rank", "max_loras"):  # a LoRA run is served merged (load_run)
        engine_kwargs.pop(key, None)
    if spec is not None:
        engine_kwargs["speculative_config"] = spec
    gpus = ro.num_gpus_per_replica
    if gpus > 0:
        tp = int(engine_kwargs.get("tensor_parallel_size", 1))
        accel = {"placement_group_config": {"bundles": [{"CPU": 1, "GPU": 1}] * tp}}
        env = {}
    else:
        accel = {"accelerator_config": {"kind": "cpu"},
                 "placement_group_config": {"bundles": [{"CPU": ro.num_cpus_per_replica}]}}
        # the rollout's KV-cache size; "all" cores is the training run's own
        # plan, so a served replica takes vLLM's default binding instead
        env = cpu_engine_env(ro.cpu_kvcache_space_gib, "auto")
    return LLMConfig(
        model_loading_config={"model_id": model_id or Path(run_dir).resolve().name,
                              "model_source": str(policy)},
        engine_kwargs=engine_kwargs,
        deployment_config={"num_replicas": num_replicas},
        runtime_env={"env_vars": env},
        log_engine_metrics=True,
        **accel,
    )


def build_app(configs: list, ingress_num_cpus: float = 0.0):
    """The OpenAI app (``ray.serve.llm.build_openai_app``) for ``configs``,
    its ingress ``OpenAiErrorIngress`` (every refusal in the OpenAI error shape).

    Args:
        configs: LLMConfigs (``llm_config``).
        ingress_num_cpus: Ray CPUs of the HTTP ingress replica. 0 by default:
            it only relays requests, and Serve's default of 1 CPU would not
            fit beside the engine on a 2-core node.
    """
    from ray.serve.llm import build_openai_app

    from rayspec.tools.ingress import OpenAiErrorIngress

    return build_openai_app({"llm_configs": configs, "ingress_cls_config": {"ingress_cls": OpenAiErrorIngress},
                             "ingress_deployment_config": {
                                 "ray_actor_options": {"num_cpus": ingress_num_cpus}}})
