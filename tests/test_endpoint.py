"""jobs.serve's run-directory checks and the ray.serve.llm config it builds
(no cluster: tests/test_job_submit.py serves a run for real)."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from jobs.serve import main as serve_main
from rayspec.config import load_config
from rayspec.tools.endpoint import RunDirError, llm_config, load_run


def _run_dir(tmp_path, model_dir, *overrides, head=True):
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", *overrides])
    OmegaConf.save(OmegaConf.structured(cfg), run / "config.yaml")
    shutil.copytree(model_dir, run / "policy")
    if head:
        (run / "draft_head").mkdir()
        (run / "draft_head" / "model.safetensors").write_bytes(b"")
    return run


def test_load_run_names_what_is_missing(tmp_path, tiny_llama_dir):
    with pytest.raises(RunDirError, match="nope: no such run directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"empty/config.yaml: missing"):
        load_run(tmp_path / "empty")
    run = _run_dir(tmp_path, tiny_llama_dir, head=False)
    with pytest.raises(RunDirError, match=r"run/draft_head: no EAGLE-3 head"):
        load_run(run)
    shutil.rmtree(run / "policy")
    with pytest.raises(RunDirError, match=r"run/policy: no trained policy"):
        load_run(run)


def test_cli_reports_a_bad_run_dir_without_starting_ray(tmp_path, capsys):
    assert serve_main([str(tmp_path / "missing")]) == 2
    assert f"error: {tmp_path / 'missing'}: no such run directory" in capsys.readouterr().err


def test_llm_config_serves_policy_with_the_runs_head(tmp_path, tiny_llama_dir):
    run = _run_dir(tmp_path, tiny_llama_dir, "rollout.engine_kwargs.max_model_len=512")
    llm = llm_config(run, num_speculative_tokens=2)
    assert llm.model_loading_config.model_id == "run"
    assert llm.model_loading_config.model_source == str(run / "policy")
    ek = llm.engine_kwargs
    assert ek["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 2,
                                        "model": str(run / "draft_head")}
    assert ek["dtype"] == "float32" and ek["max_model_len"] == 512 and "seed" not in ek
    assert llm.placement_group_config["bundles"] == [{"CPU": 0.5}]
    assert llm.runtime_env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert llm.log_engine_metrics
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        llm_config(run, num_speculative_tokens=0)


def test_llm_config_without_speculation_and_on_gpus(tmp_path, tiny_llama_dir):
    run = _run_dir(tmp_path, tiny_llama_dir, "rollout.speculative_config.method=null",
                   "rollout.num_gpus_per_replica=1", "rollout.engine_kwargs.tensor_parallel_size=2",
                   head=False)
    llm = llm_config(run, model_id="m", num_replicas=2)
    assert "speculative_config" not in llm.engine_kwargs
    assert llm.placement_group_config["bundles"] == [{"CPU": 1, "GPU": 1}] * 2
    assert llm.deployment_config["num_replicas"] == 2


def test_an_unknown_model_is_refused_in_the_openai_error_shape():
    """Ray Serve LLM's ingress refuses an unknown model with FastAPI's
    {"detail": ...}; rayspec's answers 404 in the OpenAI shape through
    Ray's own error middleware, and serves a known one as before."""
    import asyncio

    from ray.llm._internal.serve.utils.server_utils import get_response_for_error

    from rayspec.tools.ingress import NotFoundError, OpenAiErrorIngress

    ingress = object.__new__(OpenAiErrorIngress)
    ingress._model_cards = {"run": object()}
    assert asyncio.run(ingress._get_model_id("run")) == "run"
    with pytest.raises(NotFoundError) as e:
        asyncio.run(ingress._get_model_id("nope"))
    error = get_response_for_error(e.value, "request-1").model_dump()["error"]
    assert (error["code"], error["type"]) == (404, "NotFoundError") and '"nope"' in error["message"]


def test_a_lora_run_is_served_as_its_base_with_the_adapter_merged(tmp_path, tiny_llama_dir):
    """A LoRA run that wrote only its adapter: jobs.serve serves the base
    policy with the adapter merged in (once, in serve_merged/), without
    vLLM's LoRA slots; its logits are the peft model's."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rayspec.models import load_policy
    from rayspec.sync.lora import write_adapter
    from rayspec.train.lora import adapter_config, adapter_parameters

    run = _run_dir(tmp_path, tiny_llama_dir, "train.lora.enabled=true", "train.lora.r=8")
    shutil.rmtree(run / "policy")
    torch.manual_seed(0)
    peft_model = get_peft_model(load_policy(tiny_llama_dir), LoraConfig(r=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    write_adapter({n: t.detach() for n, t, _ in adapter_parameters(peft_model)}, adapter_config(peft_model),
                  run / "adapter")
    _, policy, _ = load_run(run)
    assert policy == run / "serve_merged" and (policy / "tokenizer_config.json").is_file()
    ids = torch.tensor([[1, 5, 9, 300]])
    with torch.no_grad():
        assert torch.allclose(load_policy(policy)(ids).logits, peft_model(ids).logits, atol=1e-4)
    llm = llm_config(run)
    assert llm.model_loading_config.model_source == str(run / "serve_merged")
    assert "enable_lora" not in llm.engine_kwargs and "max_loras" not in llm.engine_kwargs
