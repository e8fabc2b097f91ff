"""One device discipline: the policy update, the reference policy and the
DraftTrainer compute on their role's device, and what they hand to the object
store is host memory.

The models sit on PyTorch's ``meta`` device (shapes and dtypes, no data), so
a host tensor that reaches them raises, as a CPU tensor reaching a CUDA model
does: the CPU tests then catch what would otherwise fail on the first GPU
step. Meta tensors have no values, so ``.item()`` reads 0.0 here and host
copies are zeros of the right shape (recording the device they came from).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import ray
import torch

from rayspec import devices as devices_mod
from rayspec.batch import RolloutBatch
from rayspec.config import load_config
from rayspec.draft import eagle3 as eagle3_mod
from rayspec.draft import trainer as trainer_mod
from rayspec.draft.trainer import DraftTrainer
from rayspec.train import policy as policy_mod
from rayspec.train.policy import full_state_dict, policy_update, verifier_output_weights

META = torch.device("meta")


class MetaEngine:
    """What the trainer uses of DeepSpeed's engine, over a module on ``meta``
    (DeepSpeed moves the module to its device, never the inputs)."""

    device = META

    def __init__(self, module):
        self.module = module

    def train_micro_batch_size_per_gpu(self) -> int:
        return 2

    def zero_optimization_stage(self) -> int:
        return 2

    def train(self):
        self.module.train()

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


def _meta_policy(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    # eager attention: transformers' SDPA path reads the padding mask's
    # values (to skip the mask), which a meta tensor does not have
    config = AutoConfig.from_pretrained(model_dir)
    with META:
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.fixture
def copied_from(monkeypatch):
    """Meta-aware stand-ins for reading values: ``.item()`` is 0.0,
    ``nonzero`` takes every element as nonzero (the draft targets'
    normalisers index the masked positions), and ``to_host`` returns zeros
    of each tensor's shape. Yields the device type of every tensor copied
    to the host."""
    import torch.fx.experimental._config as fx_config

    devices: list[str] = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: 0.0 if t.is_meta else item(t))

    def to_host(tensors, dtype=None):
        devices.extend(v.device.type for v in tensors.values())
        return {k: torch.zeros(v.shape, dtype=dtype or v.dtype) for k, v in tensors.items()}

    for mod in (devices_mod, policy_mod, trainer_mod, eagle3_mod):
        monkeypatch.setattr(mod, "to_host", to_host)
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # torch's config, not an attribute
        yield devices


def _on_host(obj) -> bool:
    return all(v.device.type == "cpu" for v in obj.values())


def test_policy_update_computes_on_the_engine_device_and_puts_host_tensors(
        tiny_llama_dir, copied_from, monkeypatch):
    policy = _meta_policy(tiny_llama_dir)
    reference = _meta_policy(tiny_llama_dir).requires_grad_(False)
    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or len(puts))
    cfg = load_config(None, ["grpo.kl_coef=0.1"])
    batch = RolloutBatch(prompt_ids=[[1, 2, 3], [4, 5]] * 2, response_ids=[[6, 7], [8, 9, 10]] * 2,
                         rollout_logprobs=[[-1.0, -2.0], [-1.0, -1.0, -1.0]] * 2, group=[0, 0, 1, 1],
                         advantages=[1.0, -1.0, 0.5, -0.5])
    engine = MetaEngine(policy)
    metrics, refs = policy_update(engine, batch, cfg, pad_id=0, aux_layer_ids=[1, 3, 4], ref_model=reference)

    assert len(refs) == len(puts) == 2  # one feature chunk per micro-batch
    assert all(_on_host(chunk) for chunk in puts)
    assert all(c["target_lse"].shape == (*c["input_ids"].shape, 1) and c["target_top"].shape == c["input_ids"].shape
               for c in puts)  # the verifier's normalisers at T = 1, taken on the device
    assert set(copied_from) == {"meta"}  # computed on the device, copied once
    assert {"loss", "kl", "token_mult_prob_error"} <= set(metrics)
    grads = [p.grad for p in policy.parameters()]
    assert all(g is not None and g.is_meta for g in grads)  # the backward ran on the device

    assert _on_host(full_state_dict(engine, torch.bfloat16, rank=0))
    rows = torch.tensor([4, 1, 7])
    sent = verifier_output_weights(engine, rank=0, rows=rows)
    assert _on_host(sent) and set(sent) == {"embed"}  # tied: the output layer is the embedding, sent once
    policy.lm_head.weight = torch.nn.Parameter(torch.empty_like(policy.lm_head.weight))  # untied
    sent = verifier_output_weights(engine, rank=0, rows=rows)
    assert _on_host(sent) and sent["lm_head_rows"].shape == (3, policy.config.hidden_size)


def test_a_capture_share_puts_a_random_part_of_each_micro_batch_and_updates_on_all_of_it(
        tiny_llama_dir, copied_from, monkeypatch):
    """``draft.capture_share`` 0.5: each micro-batch's chunk holds one of its
    two sequences, picked on the device before the host copy, drawn anew by
    the generator; the update's forward still takes both."""
    from rayspec.train.policy import captured_rows

    policy = _meta_policy(tiny_llama_dir)
    puts, forward_rows = [], []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or len(puts))
    engine = MetaEngine(policy)
    cfg = load_config(None, ["draft.capture_share=0.5"])
    batch = RolloutBatch(prompt_ids=[[1, 2, 3], [4, 5]] * 4, response_ids=[[6, 7], [8, 9, 10]] * 4,
                         rollout_logprobs=[[-1.0, -2.0], [-1.0, -1.0, -1.0]] * 4, group=[0, 0, 1, 1, 2, 2, 3, 3],
                         advantages=[1.0, -1.0, 0.5, -0.5] * 2)
    module_forward = policy.forward
    monkeypatch.setattr(policy, "forward", lambda **kw: forward_rows.append(len(kw["input_ids"]))
                        or module_forward(**kw))
    _, refs = policy_update(engine, batch, cfg, pad_id=0, aux_layer_ids=[1, 3, 4],
                            capture_rng=torch.Generator().manual_seed(0))
    assert forward_rows == [2, 2, 2, 2] and len(refs) == len(puts) == 4
    assert all(len(v) == 1 for chunk in puts for v in chunk.values())
    assert set(copied_from) == {"meta"} and all(_on_host(chunk) for chunk in puts)
    assert captured_rows(8, 1.0, None) is None
    draws = [captured_rows(8, 0.3, g).tolist() for g in [torch.Generator().manual_seed(1)] * 8]
    assert all(len(d) == 2 and d == sorted(set(d)) for d in draws) and len({tuple(d) for d in draws}) > 1
    assert captured_rows(3, 0.01, torch.Generator()).numel() == 1


def test_rank_0s_device_weights_go_out_as_they_are_and_catch_up_as_host_copies(copied_from, monkeypatch):
    """``DeviceGather`` hands the collective rank 0's weights on its device
    (the broadcast reads them there); a replica that catches up gets them
    through the object store as host copies, never device tensors."""
    from rayspec.sync import CollectiveSender, DeviceGather
    from rayspec.sync.interfaces import resident
    from rayspec.train.ranks import Ranks

    live = {"model.embed_tokens.weight": torch.empty(8, 4, device=META),
            "model.norm.weight": torch.empty(4, device=META)}
    weights = DeviceGather(Ranks()).collect(resident(live), torch.float32)
    assert all(t.is_meta for t in weights.values()) and not copied_from
    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or "ref")
    sender = CollectiveSender(None, "gloo", 1 << 20, timeout_s=1)
    sender.latest["policy"], sender._weights["policy"] = (2, None), weights
    assert sender.catch_up({"policy": (1, None)}) == {"policy": (2, "ref")}
    assert len(puts) == 1 and _on_host(puts[0]) and copied_from == ["meta", "meta"]
    sender.close()


def test_draft_trainer_trains_on_its_device_and_returns_host_tensors(head_dir, copied_from, monkeypatch):
    loss_inputs: list[str] = []

    def eagle3_loss(head, f, *args, targets=None, tv_weight=0.0):
        # the real loss indexes by the mask's values (data-dependent shapes),
        # which meta tensors lack; what matters here is where its inputs are
        loss_inputs.extend(a.device.type for a in [*f.values(), *args[:-1], *(targets or ())])
        return sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0, [0.0]

    monkeypatch.setattr(trainer_mod, "eagle3_loss", eagle3_loss)
    draft = DraftTrainer(str(head_dir), lr=1e-3, ttt_steps=1, num_threads=torch.get_num_threads(),
                         device="meta")
    assert all(p.is_meta for p in draft.head.parameters())
    H, V = draft.head.cfg["hidden_size"], draft.head.cfg["vocab_size"]
    chunk = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
             "aux_hidden": torch.zeros(2, 5, 3 * H, dtype=torch.bfloat16),
             "final_hidden": torch.zeros(2, 5, H, dtype=torch.bfloat16),
             "loss_mask": torch.zeros(2, 4), "target_lse": torch.zeros(2, 5, 1),
             "target_top": torch.zeros(2, 5, dtype=torch.long), "target_temperatures": torch.ones(1)}
    draft.submit_features([chunk])
    out = draft.train({"embed": torch.zeros(V, H, dtype=torch.bfloat16),
                       "lm_head_rows": torch.zeros(V, H, dtype=torch.bfloat16)}, steps=2, expect=1)

    assert out["draft_version"] == 1
    assert loss_inputs and set(loss_inputs) == {"meta"}
    draft.submit_features([chunk])  # tied embeddings: the rows come from the embedding, on the device
    loss_inputs.clear()
    assert draft.train({"embed": torch.zeros(V, H, dtype=torch.bfloat16)}, steps=1, expect=1)["draft_version"] == 2
    assert loss_inputs and set(loss_inputs) == {"meta"} and draft.head.lm_head.weight.is_meta
    assert _on_host(draft.vllm_weights())
    tensors, _ = draft.get_state()
    assert _on_host(tensors) and any(k.startswith("opt.") for k in tensors)


# Frees 512 MiB of 4 MiB tensors from the middle of glibc's main heap: after
# one 16 MiB chunk is freed, glibc's dynamic mmap threshold puts 4 MiB
# allocations on the heap, and the tensor allocated last keeps its top in use
# (so free() alone returns nothing).
_FRAGMENTED_HEAP = """
import json, torch
from rayspec.devices import trim_host_heap
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
big = torch.ones(16 << 20, dtype=torch.uint8); del big
start = rss_mib()
tensors = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(128)]
top = torch.ones(1 << 20, dtype=torch.uint8)
del tensors
freed = rss_mib()
released = trim_host_heap()
print(json.dumps({"start": start, "freed": freed, "released": released, "trimmed": rss_mib()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_host_heap_gives_freed_tensors_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert mib["freed"] - mib["start"] > 400, mib  # free() kept the pages: what the trim is for
    assert mib["released"] is True
    assert mib["freed"] - mib["trimmed"] > 400, mib


def test_memory_peak_reads_the_samples_of_a_phase():
    trace = devices_mod.MemoryTrace()
    trace.samples = [(1.0, 5), (2.0, 9), (3.0, 7), (4.0, 2)]
    assert trace.peak([[1.5, 3.5]]) == 9 and trace.peak([[3.9, 4.1]]) == 7  # 7 in use as it began
    assert trace.peak([[2.5, 2.6]]) == 9  # shorter than the sampling period
    assert trace.peak([[0.0, 0.5]]) == 0
