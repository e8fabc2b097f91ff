"""A LoRA policy (``train.lora``): peft under DeepSpeed ZeRO trains the
adapter alone, the KL reference is the policy with its adapter off, each
refit is the adapter, registered on a speculative (EAGLE-3) replica as a new
vLLM LoRA version whose greedy continuation is the trainer's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rayspec.config import ConfigError, load_config
from rayspec.draft.capture import capture_eagle3_features
from rayspec.models import load_policy, load_tokenizer
from rayspec.sync import AdapterGather, WeightSyncError
from rayspec.sync.lora import ADAPTER_FILES
from rayspec.train.grpo import group_advantages, token_logprobs, token_mult_prob_error
from rayspec.train.checkpoint import load_engine, save_engine
from rayspec.train.lora import AdapterOff, adapter_config, adapter_parameters, causal_lm, random_adapter, wrap_lora
from rayspec.train.policy import build_engine, deepspeed_config, policy_update
from rayspec.train.ranks import Ranks
from tests.conftest import engine_kwargs

LORA = ["train.lora.enabled=true"]


def test_lora_defaults_set_vllms_lora_keys_from_the_adapter_and_the_policy_lag():
    sync = load_config(None, LORA + ["train.lora.r=8"])
    assert {k: sync.rollout.engine_kwargs[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == \
        {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    assert sync.rollout.sleep_level == 1
    lagged = load_config(None, LORA + ["scheduler.layout=split", "scheduler.mode=async", "scheduler.max_policy_lag=3"])
    assert lagged.rollout.engine_kwargs["max_loras"] == 5
    plain = load_config(None, [])
    assert "enable_lora" not in plain.rollout.engine_kwargs and plain.rollout.sleep_level == 2


@pytest.mark.parametrize("overrides, match", [
    (["train.lora.r=12"], r"train\.lora\.r=12: vLLM serves LoRA ranks"),
    (["train.lora.use_dora=true"], r"train\.lora\.use_dora=True: vLLM serves no DoRA"),
    (["train.lora.bias=all"], r"train\.lora\.bias='all': vLLM serves no LoRA biases"),
    (["train.lora.modules_to_save=[lm_head]"], r"train\.lora\.modules_to_save=\['lm_head'\]"),
    (["train.deepspeed.zero_optimization.stage=3"], r"zero_optimization\.stage=3: LoRA trains under ZeRO 0-2"),
    (["scheduler.layout=split", "scheduler.mode=async", "scheduler.max_policy_lag=2",
      "rollout.engine_kwargs.max_loras=3"], r"max_loras=3: a replica holds up to 4 adapter versions"),
    (["rollout.engine_kwargs.max_lora_rank=8"], r"max_lora_rank=8: .* >= train\.lora\.r \(16\)"),
    (["rollout.sleep_level=2"], r"rollout\.sleep_level=2: a LoRA policy's refits carry the adapter only"),
])
def test_what_vllm_cannot_serve_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, LORA + overrides)


def _lora_cfg(**lora):
    keys = ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1", "model.dtype=float32",
            "train.deepspeed.optimizer.params.lr=0.05", "grpo.kl_coef=0.1"]
    return load_config(None, keys + LORA + [f"train.lora.{k}={v}" for k, v in lora.items()])


def _batch(tok, rows):
    from rayspec.batch import RolloutBatch

    prompts = [tok.encode(p) for p, _ in rows]
    batch = RolloutBatch(prompt_ids=prompts, response_ids=[r for _, r in rows],
                         rollout_logprobs=[[-1.0] * len(r) for _, r in rows], group=[0, 0, 1, 1][:len(rows)])
    batch.rewards = [1.0, 0.0, 0.0, 1.0][:len(rows)]
    batch.advantages = group_advantages(batch.rewards, batch.group)
    return batch


def test_a_lora_update_trains_the_adapter_alone_against_the_policy_with_its_adapter_off(
        tiny_llama_dir, single_rank_group, tmp_path):
    """The optimizer holds the adapter only; an update moves A and B and no
    base weight; the reference is the base model (the adapter off), with no
    second copy; the EAGLE-3 features are captured from the adapted
    verifier; the refit payload is the adapter in peft's names; a
    checkpoint holds the adapter without the base and restores it."""
    cfg = _lora_cfg(r=8)
    tok = load_tokenizer(tiny_llama_dir)
    torch.manual_seed(0)
    base = load_policy(tiny_llama_dir)
    model = wrap_lora(load_policy(tiny_llama_dir), cfg.train.lora)
    engine = build_engine(model, deepspeed_config(cfg, world_size=1))
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert in_optimizer < 0.1 * sum(p.numel() for p in base.parameters())

    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    batch = _batch(tok, [("Say a number:", [17, 42, 9]), ("Say a number:", [3, 5, 8]),
                         ("Count:", [11, 12, 13, 14]), ("Count:", [7, 7])])
    metrics, _ = policy_update(engine, batch, cfg, tok.pad_token_id, None, AdapterOff(engine.module))
    assert metrics["loss"] != 0.0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the policy starts as its reference
    assert all(torch.equal(frozen[n], p) for n, p in engine.module.named_parameters() if not p.requires_grad)

    # the reference is the base model: the adapter off gives its logits exactly
    t = batch.to_padded(tok.pad_token_id)
    inputs = {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}
    with torch.no_grad():
        off = AdapterOff(engine.module)(**inputs).logits
        want = base(**inputs).logits
        with capture_eagle3_features(causal_lm(engine.module), [1, 2, 3]) as feats:
            on = engine.module(**inputs).logits
    assert torch.allclose(off, want, atol=1e-5)
    assert not torch.allclose(on, want, atol=1e-3), "the update left the adapter at zero; raise lr"
    # the EAGLE-3 features are the adapted verifier's: its final hidden state gives its logits
    head = causal_lm(engine.module).lm_head
    assert torch.allclose(head(feats["final_hidden"]), on, atol=1e-4)
    assert not torch.allclose(head(feats["final_hidden"]), want, atol=1e-3)

    payload = AdapterGather(Ranks(0, 1), adapter_config(engine.module)).collect(
        adapter_parameters(engine.module), torch.bfloat16)
    names = set(payload["tensors"])
    assert names and all(n.startswith("base_model.model.model.layers.") for n in names)
    assert {v.dtype for v in payload["tensors"].values()} == {torch.bfloat16}
    assert payload["config"]["r"] == 8 and set(payload["config"]["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    json.dumps(payload["config"])  # written as adapter_config.json
    assert AdapterGather(Ranks(1, 2), {}).collect(adapter_parameters(engine.module), torch.float32) is None

    # a checkpoint holds the adapter and its optimizer states, not the frozen base
    save_engine(engine, tmp_path / "ckpt")
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    base_bytes = sum(p.numel() * 4 for p in base.parameters())
    # (a full checkpoint is the fp32 weights, master copies and two Adam moments: 4x base_bytes; this one
    # is the adapter, its optimizer states, and the tiny Llama's tied output layer, which DeepSpeed 0.19.8's
    # exclude_frozen_parameters misses: 25 of its 30 MB)
    assert saved < base_bytes, (saved, base_bytes)
    trained = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                p.zero_()
    load_engine(engine, tmp_path / "ckpt")
    assert all(torch.equal(trained[n], p) for n, p in engine.module.named_parameters() if p.requires_grad)
    assert all(torch.equal(frozen[n], p) for n, p in engine.module.named_parameters() if not p.requires_grad)


@pytest.fixture(scope="module")
def lora_engine(tiny_llama_dir, head_dir):
    """A speculative (EAGLE-3, k=3) fp32 replica engine with vLLM's LoRA on (rank 8, 2 slots)."""
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "eagle3", "num_speculative_tokens": 3,
                                              "model": str(head_dir)},
                         dtype="float32", env=cpu_engine_env(1, "all"),
                         engine_kwargs=engine_kwargs(enable_lora=True, max_lora_rank=8, max_loras=2))
    yield eng
    eng.shutdown()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _trained_adapter(policy, seed: int, r: int = 8):
    """A peft model of ``policy`` whose adapter is far from zero."""
    return random_adapter(policy, r, lora_alpha=16, std=0.3, seed=seed)


@pytest.mark.slow
def test_each_adapter_refit_is_a_new_vllm_lora_version_the_replica_samples_exactly(lora_engine, tiny_llama_dir,
                                                                                  tmp_path):
    """On an EAGLE-3 replica, each adapter refit is registered as a vLLM
    LoRA version of its own: the greedy continuation is peft's, the sampled
    logprobs are peft's, the version it replaces is dropped with its files;
    a draft refit leaves the adapter loaded; a full-weight policy refit is
    refused."""
    from rayspec.draft.eagle3 import init_head, vllm_state_dict

    eng = lora_engine
    tok = load_tokenizer(tiny_llama_dir)
    probe = tok.encode("Question: what is 12 plus 30? Answer:")
    base = _greedy(load_policy(tiny_llama_dir).eval(), probe, 16)
    assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == base

    staging = Path(eng.adapters.staging_dir)
    for version, seed in ((1, 1), (2, 2)):
        model = _trained_adapter(load_policy(tiny_llama_dir), seed)
        payload = AdapterGather(Ranks(0, 1), adapter_config(model)).collect(adapter_parameters(model), torch.float32)
        assert eng.receive_refit("policy", payload, version) == version
        want = _greedy(model, probe, 16)
        assert want != base
        got = eng.generate([probe], temperature=0.0, max_tokens=16)[0]
        assert got.response_ids[0] == want and got.weight_versions == [[(version, 0, 16)]]
        assert [p.name for p in staging.iterdir()] == [f"policy-v{version}"]
        assert sorted(f.name for f in (staging / f"policy-v{version}").iterdir()) == sorted(ADAPTER_FILES)
    assert eng.versions()["policy"] == 2

    batch, _ = eng.generate([probe, tok.encode("Count with me: one, two,")], n=3, temperature=1.0, max_tokens=12)
    t = batch.to_padded(tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"])
    assert token_mult_prob_error(lp, t["rollout_logprobs"], t["response_mask"]) < 1e-4

    eng.receive_refit("draft", vllm_state_dict(init_head(load_policy(tiny_llama_dir), seed=5)), version=1)
    assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == want
    with pytest.raises(WeightSyncError, match="full-weight policy refit while LoRA adapters are live"):
        eng.object_store.receive("policy", load_policy(tiny_llama_dir).state_dict(), 3)
    assert eng.versions()["policy"] == 2


def test_bench_refit_sends_adapters_of_each_rank_against_the_full_policy(smollm2_dir):
    """jobs.bench_refit --lora-ranks: each adapter is the rank's share of
    the policy's linear layers (ModelShape.lora_params), and the table gives
    its bytes and seconds against the full refit's."""
    from jobs.bench_refit import adapter_payload, format_lora_table
    from rayspec.buckets import state_dict_nbytes
    from rayspec.model_shape import ModelShape

    shape = ModelShape.from_hf_config(smollm2_dir)
    payloads = {r: adapter_payload(smollm2_dir, r) for r in (8, 16)}
    for r, payload in payloads.items():
        assert state_dict_nbytes(payload["tensors"]) == 4 * shape.lora_params(r)
        assert payload["config"]["r"] == r
    full = {"transport": "collective", "bytes": 4 * shape.total_params, "seconds": 2.0, "seconds_rounds": [2.0]}
    cells = [full] + [{"transport": "lora_adapter", "lora_rank": r, "bytes": state_dict_nbytes(p["tensors"]),
                       "seconds": 0.1, "seconds_rounds": [0.1]} for r, p in payloads.items()]
    table = format_lora_table(cells).splitlines()
    assert table[1].startswith("adapter r=8") and table[-1].startswith("full (collective)")
    assert table[2].split()[-2:] == [f"{4 * shape.lora_params(16) / full['bytes']:.4f}", "0.050"]


@pytest.mark.slow
def test_an_in_flight_adapter_refit_leaves_running_requests_on_the_adapter_they_started_with(lora_engine,
                                                                                            tiny_llama_dir):
    """``scheduler.in_flight_updates`` with LoRA: an adapter refit lands
    while long samples generate, without pausing them; they finish on the
    adapter they started with (their tokens labelled with its version, their
    logprobs its own), a request started after it runs on the new one beside
    them, and the old version is dropped with its files once they end."""
    import threading
    import time

    eng = lora_engine
    tok = load_tokenizer(tiny_llama_dir)
    old = eng.versions()["policy"]
    first, second = (_trained_adapter(load_policy(tiny_llama_dir), seed) for seed in (3, 4))
    payload = lambda m: AdapterGather(Ranks(0, 1), adapter_config(m)).collect(  # noqa: E731
        adapter_parameters(m), torch.float32)
    eng.receive_refit("policy", payload(first), old + 1)
    probe = tok.encode("Question: what is 12 plus 30? Answer:")
    out, ended = {}, {}

    def rollout():
        out["long"] = eng.generate([tok.encode("Say a number:")], n=2, temperature=1.0, max_tokens=300)
        ended["t"] = time.time()

    eng.in_flight_updates = True
    try:
        gen = threading.Thread(target=rollout)
        gen.start()
        time.sleep(1.0)
        assert eng.receive_refit("policy", payload(second), old + 2) == old + 2
        landed = time.time()
        beside = eng.generate([probe], temperature=0.0, max_tokens=16)[0]
        gen.join()
    finally:
        eng.in_flight_updates = False
    assert landed < ended["t"]  # the refit did not wait for the rollout
    assert beside.response_ids[0] == _greedy(second, probe, 16) and beside.weight_versions == [[(old + 2, 0, 16)]]
    batch, _ = out["long"]
    assert batch.weight_versions == [[(old + 1, 0, len(r))] for r in batch.response_ids]
    assert batch.policy_version == old + 1
    t = batch.to_padded(tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(first(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"])
    assert token_mult_prob_error(lp, t["rollout_logprobs"], t["response_mask"]) < 1e-4
    eng.generate([probe], temperature=0.0, max_tokens=2)  # a call's end drops what no request uses
    assert [p.name for p in Path(eng.adapters.staging_dir).iterdir()] == [f"policy-v{old + 2}"]
