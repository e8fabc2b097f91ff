"""Security defaults: servers bind to loopback, checkpoints load tensors
only (safetensors, or a published head's pytorch_model.bin through torch's
weights-only unpickler), and no model's own code runs (trust_remote_code off)."""

from __future__ import annotations

import psutil
import pytest
import torch

from tests.conftest import MARKER, PicklePayload, copy_model_dir, planted_policy


def test_no_model_code_runs_by_default(tmp_path, tiny_llama_dir):
    """vLLM and transformers default to trust_remote_code=False and rayspec
    never turns it on: loading a policy whose config.json maps to its own
    modelling code uses the built-in class and never runs that code."""
    from vllm.engine.arg_utils import EngineArgs

    from rayspec.config import RunConfig
    from rayspec.models import load_policy

    assert EngineArgs(model="x").trust_remote_code is False
    assert "trust_remote_code" not in RunConfig().rollout.engine_kwargs
    model = load_policy(planted_policy("custom-code", tmp_path, tiny_llama_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not (tmp_path / MARKER).exists()


def test_head_loads_tensors_only(tmp_path, head_dir):
    from rayspec.draft.eagle3 import load_head

    h = copy_model_dir(head_dir, tmp_path / "h")
    (h / "model.safetensors").unlink()
    torch.save({"evil": PicklePayload(tmp_path / MARKER)}, h / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: not a tensors-only checkpoint"):
        load_head(h)
    assert not (tmp_path / MARKER).exists()


def test_embedded_cluster_dashboard_listens_on_loopback_only(ray_session):
    """The suite's session is started by ``init_ray`` as a run starts one."""
    import ray

    url = ray._private.worker.global_worker.node.address_info["webui_url"]
    host, port = url.rsplit(":", 1)
    assert host == "127.0.0.1", url
    listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)}
    assert listening == {"127.0.0.1"}, listening


def test_served_endpoint_defaults_to_loopback():
    from jobs import serve

    assert serve.parse_args(["runs/x"]).host == "127.0.0.1"
