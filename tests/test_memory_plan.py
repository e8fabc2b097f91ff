"""The memory plan (rayspec/perfmodel/memory.py, jobs.project_memory):

- its model-state terms are DeepSpeed's own estimators' (ZeRO-2 and ZeRO-3,
  with and without offload), on parameter counts DeepSpeed takes from real
  modules (``model_to_params``) and the plan takes from the config alone;
- its parameter counts match the published ones of the presets (meta
  device: no weights allocated);
- the GPU preset at 8B fits colocated on 80 GB cards because the Train
  ranks give their states back between updates (``train.offload_states``);
  left on the device under ZeRO-1 they overflow it, and the plan names the
  knobs that fit; a 32B ZeRO-1 colocated run is refused naming what to
  change; the CLI's exit codes.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jobs import project_memory
from rayspec.config import load_config
from rayspec.perfmodel import memory
from rayspec.perfmodel.shapes import PRESETS, ModelShape

TINY = {
    "qwen3 (untied, q/k norms)": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=1000,
                                      tie_word_embeddings=False),
    "llama (tied)": dict(model_type="llama", hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=3, head_dim=8, intermediate_size=80, vocab_size=700,
                         tie_word_embeddings=True),
}


def _hf_model(fields: dict, device: str = "cpu"):
    fields = dict(fields)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", list(TINY))
def test_model_states_are_deepspeeds_estimates(name):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = model_to_params(_hf_model(TINY[name]))
    shape = ModelShape.from_hf_config(TINY[name])
    assert (shape.total_params, shape.largest_module_params) == (total, largest)
    for gpus, nodes in ((1, 1), (8, 1), (4, 2)):
        n = gpus * nodes
        for offload in (False, True):
            _, want = estimate_zero2_model_states_mem_needs(total, gpus, nodes, cpu_offload=offload)
            got, _ = memory.model_states(total, largest, 2, n, offload_optimizer=offload)
            assert int(got) == want, (gpus, nodes, offload)
        for offload, offload_param in ((False, False), (True, False), (True, True)):
            _, want, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus, nodes, cpu_offload=offload,
                                                               cpu_offload_params=offload_param)
            got, _ = memory.model_states(total, largest, 3, n, offload, offload_param)
            assert int(got) == want, (gpus, nodes, offload, offload_param)
    with pytest.raises(ValueError, match="stage=4"):
        memory.model_states(total, largest, 4, 8)


@pytest.mark.parametrize("name,published", [("qwen3-8b", 8.19e9), ("llama-3.1-8b", 8.03e9), ("qwen3-32b", 32.8e9)])
def test_parameter_counts_match_the_real_architectures(name, published):
    model = _hf_model(PRESETS[name], device="meta")
    counted = sum(p.numel() for p in model.parameters())  # meta tensors: no data_ptr to dedupe by
    shape = ModelShape.from_hf_config(name)
    assert shape.total_params == counted
    assert abs(counted / published - 1) < 0.01


def _plan(hardware: str, *overrides: str, model: str = "qwen3-8b") -> memory.MemoryPlan:
    cfg = load_config(str(project_memory.GPU_PRESET), list(overrides))
    return memory.plan(cfg, ModelShape.from_hf_config(model), hardware, 8)


def test_the_gpu_preset_at_8b_colocated_fits_80_gb_cards_by_giving_the_device_back_between_phases():
    plan = _plan("h100")
    assert not plan.problems(), plan.problems()
    gpu0, gpu = plan.devices
    assert (gpu0.name, gpu0.count, gpu.count) == ("GPU with the DraftTrainer", 1, 7)
    rollout = {(t.role, t.what) for t in gpu0.phases["rollout"]}
    # offload_states: while the replica rolls out, the Train rank holds its CUDA context alone,
    # and the DraftTrainer its head (the verifier copies are _train's locals)
    assert ("Train rank", "CUDA context") in rollout and not any(w.startswith("model states") for _, w in rollout)
    assert ("DraftTrainer", "verifier embedding + LM head (fp32)") not in rollout
    assert any(t.what == "states in host memory" for t in plan.host)
    # the policy update holds the states and the DraftTrainer's training beside them
    update = {t.what for t in gpu0.phases["policy update"]}
    assert {"model states (ZeRO-2)", "logits", "verifier embedding + LM head (fp32)"} <= update
    assert not _plan("h200").problems()


def test_states_left_on_the_device_overflow_it_and_the_plan_names_the_knobs():
    plan = _plan("h100", "train.offload_states=false", "train.deepspeed.zero_optimization.stage=1")
    problems = plan.problems()
    assert any(p.startswith("GPU with the DraftTrainer, rollout:") and "model states (ZeRO-1)" in p
               for p in problems), problems
    assert not any("policy update" in p for p in problems)  # replicas asleep: the update itself fits
    fits = memory.fixes(str(project_memory.GPU_PRESET), ["train.offload_states=false",
                                                         "train.deepspeed.zero_optimization.stage=1"],
                        ModelShape.from_hf_config("qwen3-8b"), "h100", 8, 1)
    assert fits[0] == "states offloaded between updates: train.offload_states=true"
    assert any(f.startswith("ZeRO-3:") for f in fits) and not any("micro-batch" in f for f in fits)


def test_zero3_partitions_the_weights_and_offload_moves_the_optimizer_to_host():
    states = lambda plan: next(t.bytes for t in plan.devices[1].phases["policy update"]  # noqa: E731
                               if t.what.startswith("model states"))
    shape = ModelShape.from_hf_config("qwen3-8b")
    p, largest = shape.total_params, shape.largest_module_params
    assert states(_plan("h100")) == pytest.approx(2 * p + 18 * p / 8)
    assert states(_plan("h100", "train.deepspeed.zero_optimization.stage=3")) == pytest.approx(4 * largest + 18 * p / 8)
    off = _plan("h100", "train.deepspeed.zero_optimization.offload_optimizer.device=cpu", "train.offload_states=false")
    assert states(off) == pytest.approx(2 * p)
    host = {t.what: t.bytes for t in off.host}
    assert host["states in host memory"] == pytest.approx(8 * 18 * p / 8)  # 8 ranks on the node


def test_cli_refuses_32b_colocated_zero1_naming_what_to_change(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = project_memory.main(["train.deepspeed.zero_optimization.stage=1", "--model", "qwen3-32b",
                              "--hardware", "h100", "--gpus", "8", "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "model states (ZeRO-1)" in err and "gpu_memory_utilization must exceed" in err
    assert "tensor_parallel_size" in err and "would fit with:" in err
    plan = json.loads(out.read_text())
    assert plan["problems"] and {d["name"] for d in plan["devices"]} == {"GPU with the DraftTrainer", "GPU"}


def test_cli_fits_and_bad_arguments(capsys):
    assert project_memory.main(["--model", "qwen3-8b", "--hardware", "h200", "--gpus", "8"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits")
    assert project_memory.main(["--model", "no-such-model", "--hardware", "h100", "--gpus", "8"]) == 2
    assert "--model no-such-model" in capsys.readouterr().err
    assert project_memory.main(["rollout.num_gpus_per_replica=0", "--model", "qwen3-8b", "--hardware", "h100",
                                "--gpus", "8"]) == 2
    assert "rollout.num_gpus_per_replica" in capsys.readouterr().err


def test_split_layout_counts_devices():
    problems = _plan("h100", "scheduler.layout=split", "rollout.num_gpus_per_replica=1",
                     "train.gpus_per_worker=1", "draft.num_gpus=0").problems()
    assert any("need 16 devices, the cluster has 8" in p for p in problems), problems
