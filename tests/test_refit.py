"""Weight sync is real: a DeepSpeed GRPO step changes the policy, the refit
loads it into a running speculative vLLM engine in place, and the engine's
greedy continuation then equals the trainer's own (and differs from before)."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from rayspec.buckets import plan_buckets, state_dict_nbytes
from rayspec.config import DRAFT_LINEAR_DTYPE, load_config
from rayspec.draft.eagle3 import init_head, save_head
from rayspec.models import load_policy, load_tokenizer
from rayspec.rollout.client import LocalReplicas, RolloutClient
from rayspec.rollout.engine import ReplicaBehind
from rayspec.sync import CollectiveSender, ObjectStoreReceiver
from rayspec.train.grpo import group_advantages, token_logprobs, token_mult_prob_error
from rayspec.train.policy import build_engine, deepspeed_config, full_state_dict, policy_update
from tests.conftest import engine_kwargs


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _sleeping_engine(calls: list, **state):
    """A SpecVLLMEngine with sleep mode over a recording stand-in for vLLM
    (its sleep mode needs a GPU): each call lands in ``calls``."""
    from rayspec.rollout.engine import SpecVLLMEngine, _Gate

    class LLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

        def collective_rpc(self, method, args=()):
            calls.append((method,))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

        def update_weight_version(self, version):
            calls.append(("update_weight_version", version))

    eng = object.__new__(SpecVLLMEngine)
    eng.__dict__.update({"llm": LLM(), "sleep_mode": True, "_asleep": set(), "_gate": _Gate(True),
                         "in_flight_updates": False, "adaptive": None, "policy_version": 0, "lora": False,
                         "speculative_config": None,
                         "_discarded": False, **state})
    eng.object_store = ObjectStoreReceiver(eng)
    return eng


def test_a_sleeping_replica_wakes_only_its_weights_for_a_refit(tmp_path):
    """Colocated on a GPU, a replica sleeps while the policy trains; a refit
    reallocates its weights alone (the KV cache stays released beside the
    trainer's memory), the next rollout the rest."""
    calls = []
    eng = _sleeping_engine(calls)
    assert eng.sleep() and eng.sleep()  # sleeping twice releases once
    eng.receive_refit("policy", {"w": torch.zeros(2)}, version=1)
    eng._wake()  # what generate and calibrate do first
    eng._wake()
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("rayspec_load",),
                     ("reset_prefix_cache",), ("update_weight_version", "1"), ("wake_up", None)]
    eng.__dict__.pop("llm")


def test_after_a_level_2_sleep_a_replica_generates_only_once_a_policy_refit_landed():
    """Level 2 discards the weights the next policy refit overwrites: until
    it lands (a draft refit is not enough) the engine refuses to generate
    rather than sample from freed memory."""
    calls = []
    eng = _sleeping_engine(calls, policy_version=3, draft_version=3, replica_id="r0",
                           speculative_config={"method": "eagle3"}, _draft_reference=[{"w": 1.0}])
    with pytest.raises(ValueError, match="sleep level 3"):
        eng.sleep(3)
    assert eng.sleep(2)
    # the drafter shares the discarded verifier weights: no stale-draft check until the policy refit
    assert eng._check_draft() == 0 and ("rayspec_weight_sums",) not in calls
    with pytest.raises(RuntimeError, match="replica r0: .*level-2 sleep with no policy refit since"):
        eng._wake()
    eng.receive_refit("draft", {"w": torch.zeros(2)}, version=4)
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        eng._wake()
    eng.receive_refit("policy", {"w": torch.zeros(2)}, version=4)
    eng._wake()
    assert calls[0] == ("sleep", 2) and calls[-1] == ("wake_up", None)
    assert eng.sleep(1)  # level 1 keeps the weights: generating needs no refit
    eng._wake()
    eng.__dict__.pop("llm")


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_dir, tmp_path_factory):
    """A speculative (EAGLE-3, k=3) fp32 engine of the tiny policy whose
    drafter's linear layers compute in bf16 (``rayspec.vllm.cpu_fixes.draft_linear_dtype``)."""
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    head = tmp_path_factory.mktemp("head") / "head"
    save_head(init_head(load_policy(tiny_llama_dir)), head)
    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "eagle3", "num_speculative_tokens": 3,
                                              "model": str(head)},
                         dtype="float32", env=cpu_engine_env(1, "all"),
                         engine_kwargs=engine_kwargs(additional_config={DRAFT_LINEAR_DTYPE: "bfloat16"}))
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_rollout_logprobs_are_the_sampling_distribution(spec_engine, tiny_llama_dir):
    """At temperature 0.7 the rollout logprobs equal the trainer's
    log_softmax(logits / T) of the same tokens (the ratio's denominator)."""
    from rayspec.train.grpo import token_logprobs

    tok = load_tokenizer(tiny_llama_dir)
    policy = load_policy(tiny_llama_dir).eval()
    batch, stats = spec_engine.generate([tok.encode("Count with me: one, two,")], n=4,
                                        temperature=0.7, max_tokens=12)
    assert stats.num_drafts > 0
    t = batch.to_padded(tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"], temperature=0.7)
    m = t["response_mask"].bool()
    assert torch.allclose(lp[m], t["rollout_logprobs"][m], atol=2e-3)


@pytest.mark.slow
def test_rollout_calls_made_at_once_share_the_engine_and_keep_their_own_counts(spec_engine, tiny_llama_dir):
    """The replica's default engine is vLLM's AsyncLLM: three rollout calls
    made at once run as one window of continuous batching (one busy
    interval, not three in a row), and each call's SpecStats are its own
    requests' (vLLM's per-request acceptance counts), which together are
    what the engine's own Prometheus counters moved by."""
    import threading

    from vllm.v1.metrics.reader import get_metrics_snapshot

    def counters():
        names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        got = {n: 0 for n in names}
        for m in get_metrics_snapshot():
            if m.name in got:
                got[m.name] += int(m.value)
        return got

    eng = spec_engine
    assert type(eng.llm).__name__ == "AsyncEngine" and eng.llm.concurrent
    tok = load_tokenizer(tiny_llama_dir)
    prompts = [tok.encode(t) for t in ("Say a number:", "Count to three:", "Name a colour:")]
    eng.generate([prompts[0]], max_tokens=1)  # the draft checked, as each window's first call checks it
    before, t0, out = counters(), time.time(), {}
    calls = [threading.Thread(target=lambda i=i: out.update({i: eng.generate(
        [prompts[i]], n=4, temperature=1.0, max_tokens=32, group_offset=i)})) for i in range(3)]
    for c in calls:
        c.start()
    for c in calls:
        c.join()
    after = counters()
    stats = [out[i][1] for i in range(3)]
    for i, (batch, s) in out.items():
        assert batch.group == [i] * 4 and s.output_tokens == sum(map(len, batch.response_ids))
        assert list(s.replicas) == [eng.replica_id] and s.replicas[eng.replica_id].num_drafts == s.num_drafts
    assert sum(s.num_drafts for s in stats) == after["vllm:spec_decode_num_drafts"] - \
        before["vllm:spec_decode_num_drafts"] > 0
    assert sum(s.num_accepted_tokens for s in stats) == after["vllm:spec_decode_num_accepted_tokens"] - \
        before["vllm:spec_decode_num_accepted_tokens"]
    # one window of generation (the calls overlapped in the engine), not three in a row
    assert len([iv for iv in eng.busy_intervals(t0) if iv[1] - iv[0] > 0.3]) == 1


@pytest.mark.slow
def test_refit_after_deepspeed_step_matches_trainer_greedy(spec_engine, tiny_llama_dir, single_rank_group):
    eng = spec_engine
    cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                             "train.deepspeed.optimizer.params.lr=0.01", "model.dtype=float32"])
    tok = load_tokenizer(tiny_llama_dir)
    policy = load_policy(tiny_llama_dir)
    probe = tok.encode("Question: what is 12 plus 30? Answer:")
    before = eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0]
    assert before == _greedy_hf(policy, probe, 16)

    # one GRPO step through DeepSpeed ZeRO-2 on the engine's own samples
    batch, _ = eng.generate([probe, tok.encode("Say a number:")], n=2, temperature=1.0, max_tokens=12)
    # the version of each sample's tokens is vLLM's label of the weights that sampled them
    assert batch.weight_versions == [[(0, 0, len(r))] for r in batch.response_ids] and batch.policy_version == 0
    batch.rewards = [1.0, 0.0, 0.0, 1.0]
    batch.advantages = group_advantages(batch.rewards, batch.group)
    engine = build_engine(policy, deepspeed_config(cfg, world_size=1))
    metrics, _ = policy_update(engine, batch, cfg, tok.pad_token_id, None)
    assert metrics["loss"] != 0.0
    sd = full_state_dict(engine, torch.float32, rank=0)
    trainer_greedy = _greedy_hf(engine.module.eval(), probe, 16)
    assert trainer_greedy != before, "the update did not change the greedy continuation; raise lr"

    # through the collective transport (gloo), in many buckets
    transport = CollectiveSender(RolloutClient(LocalReplicas([eng]), 1), "gloo", packed_buffer_size_bytes=1 << 20, timeout_s=120)
    assert len(plan_buckets(sd, 1 << 20)) > 3
    assert transport.send("policy", sd, 1).results() == [1]
    after = eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0]
    assert after == trainer_greedy
    assert eng.versions()["policy"] == 1
    sampled, _ = eng.generate([probe, tok.encode("Say a number:")], n=4, temperature=1.0, max_tokens=16)
    assert sampled.weight_versions == [[(1, 0, len(r))] for r in sampled.response_ids]
    assert sampled.policy_version == 1
    t = sampled.to_padded(tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(engine.module(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"])
    err = token_mult_prob_error(lp, t["rollout_logprobs"], t["response_mask"])
    print(f"token_mult_prob_error after a collective refit (fp32): {err:.2e}")
    assert err < 1e-5
    stats = transport.take_stats()
    assert stats["weight_sync_transport"] == "collective"
    assert stats["weight_sync_bytes"] == state_dict_nbytes(sd) > 0
    # a replica outside the group (Serve restarted it) is told so instead of sampling stale weights
    eng.collective.group_id = None
    assert transport.send("policy", sd, 2).results() == [2]  # the group re-forms with it
    eng.policy_version = 1
    with pytest.raises(ReplicaBehind, match="policy at version 1"):
        eng.generate([probe], max_tokens=2, refits=transport.rollout_refits())
    # the catch-up resends through the object store: a Ray session of this test's own, shut down after
    # (the suite's shared session runs its tests last, and none may outlive this one)
    ray.init(num_cpus=1, object_store_memory=100 * 2**20, include_dashboard=False)
    try:
        refits = transport.catch_up(transport.rollout_refits())
        assert eng.generate([probe], temperature=0.0, max_tokens=16, refits=refits)[0].response_ids[0] == after
    finally:
        ray.shutdown()
    assert eng.versions()["policy"] == 2
    transport.close()


@pytest.mark.slow
def test_refit_sent_during_a_rollout_waits_for_it(spec_engine, tiny_llama_dir):
    """Async mode sends refits while a rollout generates (Serve's broadcast
    bypasses max_ongoing_requests): the engine runs them one after the other,
    and records both as busy time. On CPU there is no vLLM sleep mode."""
    import threading

    eng = spec_engine
    tok = load_tokenizer(tiny_llama_dir)
    sd = load_policy(tiny_llama_dir).state_dict()
    t0 = time.time()
    out = {}
    gen = threading.Thread(target=lambda: out.update(r=eng.generate(
        [tok.encode("Say a number:")], n=8, temperature=1.0, max_tokens=48)))
    gen.start()
    time.sleep(0.2)
    assert eng.receive_refit("policy", sd, version=5) == 5
    gen.join()
    batch, _ = out["r"]
    assert batch.policy_version < 5  # sampled before the refit landed
    (g0, g1), (r0, r1) = eng.busy_intervals(t0)[-2:]
    assert g1 <= r0 and r1 > r0  # the refit started after the rollout ended
    assert eng.sleep() is False  # CPU platform: no sleep mode, the roles time-slice
    assert eng.generate([tok.encode("Say a number:")], temperature=0.0, max_tokens=4)[0].policy_version == 5


@pytest.mark.slow
def test_an_in_flight_refit_lands_between_a_samples_tokens(spec_engine, tiny_llama_dir):
    """``scheduler.in_flight_updates``: a refit sent while long samples
    generate pauses them (vLLM's ``pause_generation(mode="keep")``), loads
    the weights and resumes them on the new version, without waiting for
    them to end: each sample's tokens span the two versions (vLLM's
    ``weight_versions``), and the batch counts as the older one."""
    import threading

    eng = spec_engine
    tok = load_tokenizer(tiny_llama_dir)
    sd = load_policy(tiny_llama_dir).state_dict()
    old = eng.versions()["policy"]
    out, ended = {}, {}

    def rollout():
        out["r"] = eng.generate([tok.encode("Say a number:")], n=2, temperature=1.0, max_tokens=400)
        ended["t"] = time.time()

    eng.in_flight_updates = True
    try:
        gen = threading.Thread(target=rollout)
        gen.start()
        time.sleep(1.0)
        assert eng.receive_refit("policy", sd, version=old + 1) == old + 1
        landed = time.time()
        gen.join()
    finally:
        eng.in_flight_updates = False
    batch, _ = out["r"]
    assert landed < ended["t"]  # the refit did not wait for the rollout
    for spans, response in zip(batch.weight_versions, batch.response_ids):
        (v0, a0, b0), (v1, a1, b1) = spans
        assert (v0, v1) == (old, old + 1) and a0 == 0 < b0 == a1 < b1 == len(response), spans
    assert batch.policy_version == old
    print(f"spans of the in-flight samples: {batch.weight_versions}")


@pytest.mark.slow
def test_an_async_collective_refit_does_not_hold_up_the_next_update(spec_engine, tiny_llama_dir):
    """Async mode: rank 0 sends the refit while a replica still generates,
    and trains on. The broadcast runs in the sender's thread, on a stream of
    its own (on a GPU, NCCL's wait on the default stream would stall the
    next update until the replica took the refit): send() returns at once,
    and the next update's work finishes while the refit still waits for
    the rollout."""
    import threading

    eng = spec_engine
    tok = load_tokenizer(tiny_llama_dir)
    sd = load_policy(tiny_llama_dir).state_dict()
    transport = CollectiveSender(RolloutClient(LocalReplicas([eng]), 1), "gloo", packed_buffer_size_bytes=1 << 20,
                                 timeout_s=120)
    try:
        assert transport.send("policy", sd, 6).results() == [6]  # forms the group
        out = {}
        gen = threading.Thread(target=lambda: out.update(r=eng.generate(
            [tok.encode("Say a number:")], n=8, temperature=1.0, max_tokens=48)))
        gen.start()
        time.sleep(0.2)
        t0 = time.time()
        refit = transport.send("policy", sd, 7)
        sent = time.time()
        x = torch.randn(128, 128)
        for _ in range(10):  # the next policy update's work, on this thread
            x = torch.tanh(x @ x)
        updated = time.time()
        assert refit.results() == [7]
        landed = time.time()
        gen.join()
    finally:
        transport.close()
    assert sent - t0 < 0.5 and updated < landed, (sent - t0, landed - updated)
    assert out["r"][0].policy_version == 6  # the rollout in flight kept its weights
    (_, g1), (r0, _) = eng.busy_intervals(t0)[-2:]
    assert g1 <= r0  # the refit landed after the rollout


@pytest.mark.slow
def test_draft_refit_leaves_the_verifier_alone(spec_engine, tiny_llama_dir):
    """A draft refit must not touch the weights the head shares with the
    verifier (embed_tokens): without the fix in worker_ext, vLLM's in-place
    reload of the drafter put the engine's initial embedding back, and the
    rollouts stopped following the refit policy. The drafter's linear layers
    compute in bf16 before and after it (the verifier's fp32 distribution is
    still what is sampled)."""
    from rayspec.draft.eagle3 import init_head, vllm_state_dict
    from rayspec.train.grpo import token_logprobs

    eng = spec_engine
    tok = load_tokenizer(tiny_llama_dir)
    policy = load_policy(tiny_llama_dir).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    eng.receive_refit("policy", {k: v.clone() for k, v in policy.state_dict().items()}, version=9)
    linear_dtypes = eng.llm.collective_rpc("rayspec_draft_linear_dtypes")[0]
    fc_sum = eng.llm.collective_rpc("rayspec_weight_sums", args=("draft",))[0]["model.fc.weight"]
    head = vllm_state_dict(init_head(policy, seed=3))
    eng.receive_refit("draft", head, version=9)
    assert eng.llm.collective_rpc("rayspec_draft_linear_dtypes")[0] == linear_dtypes
    # the packed bf16 copy is the refit's head
    packed = eng.llm.collective_rpc("rayspec_weight_sums", args=("draft",))[0]["model.fc.weight"]
    assert packed == pytest.approx(float(head["fc.weight"].bfloat16().float().sum()), rel=1e-4, abs=1e-3)
    assert packed != pytest.approx(fc_sum, rel=1e-2)
    # (this full-vocabulary head shares the verifier's output layer, which stays fp32)
    assert {"model.fc", "model.layers.0.self_attn.qkv_proj"} <= set(linear_dtypes) and \
        set(linear_dtypes.values()) == {"torch.bfloat16"}, linear_dtypes
    batch, _ = eng.generate([tok.encode("Count with me: one, two,")], n=4, temperature=1.0, max_tokens=16)
    t = batch.to_padded(tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits,
                            t["input_ids"])
    m = t["response_mask"].bool()
    assert (lp[m] - t["rollout_logprobs"][m]).abs().max() < 1e-3


def test_offloaded_states_train_exactly_as_resident_ones(tiny_llama_dir, single_rank_group):
    """``train.offload_states``: after each gather for the refit a rank moves
    DeepSpeed's states to host memory (``offload_states``), and brings them
    back before the next read (``reload_states``). On a CPU the move is
    host to host, the same DeepSpeed code path as from a GPU: three updates
    with a release between them train bit-identically to three without."""
    from rayspec.batch import RolloutBatch
    from rayspec.train.policy import PolicyWorker
    from rayspec.train.ranks import Ranks

    tok = load_tokenizer(tiny_llama_dir)
    workers = []
    for offload in (False, True):
        cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                                 "train.deepspeed.optimizer.params.lr=0.01", "model.dtype=float32",
                                 f"train.offload_states={str(offload).lower()}"])
        torch.manual_seed(0)
        engine = build_engine(load_policy(tiny_llama_dir), deepspeed_config(cfg, world_size=1))
        workers.append(PolicyWorker(engine, cfg, Ranks(), tok.pad_token_id, torch.float32))
    prompts = [tok.encode("What is 7 plus 5?"), tok.encode("Say a number:")]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        responses = [torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)]
        batch = RolloutBatch([prompts[i // 2] for i in range(4)], responses, [[-1.0] * 6 for _ in range(4)],
                             [i // 2 for i in range(4)], rewards=[1.0, 0.0, 0.0, 1.0])
        batch.advantages = group_advantages(batch.rewards, batch.group)
        for w in workers:
            w.update(batch)
            sd = w.full_state_dict()
            w.release()
            assert w.offloaded == w.cfg.train.offload_states
        resident, offloaded = workers
        assert offloaded.engine.optimizer.offloaded_states  # DeepSpeed's own record of what it moved
        assert all(torch.equal(sd[k], v) for k, v in resident.full_state_dict().items())
    offloaded.full_state_dict()
    assert not offloaded.offloaded and not offloaded.engine.optimizer.offloaded_states  # read: reloaded first
    with pytest.raises(Exception, match="train.offload_states"):
        load_config(None, ["train.offload_states=true", "train.deepspeed.zero_optimization.stage=0"])
    with pytest.raises(Exception, match="torch_adam=false"):
        load_config(None, ["train.offload_states=true", "train.deepspeed.zero_optimization.stage=3",
                           "train.deepspeed.optimizer.params.torch_adam=true"])


def test_a_bf16_engine_is_the_same_from_a_bf16_load(tiny_llama_dir, single_rank_group):
    """Train workers load the policy in bf16 where DeepSpeed trains in bf16
    (``training_load_dtype``): DeepSpeed casts the module to bf16 before it
    copies the fp32 master weights, so the engine, master weights included,
    is the one an fp32 load builds, from half the host memory."""
    from rayspec.train.loop import training_load_dtype

    cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                             "train.deepspeed.bf16.enabled=true", "model.dtype=float32"])
    assert training_load_dtype(cfg) == torch.bfloat16
    assert training_load_dtype(load_config(None, [])) == torch.float32  # CPU: fp32 training
    import copy

    fp32 = load_policy(tiny_llama_dir, torch.float32)
    with torch.no_grad():  # values bf16 cannot hold, as a trained fp32 checkpoint's
        for p in fp32.parameters():
            p.add_(torch.rand_like(p) * 1e-3)
    assert not all(torch.equal(p, p.bfloat16().float()) for p in fp32.parameters())
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    engines = [build_engine(m, deepspeed_config(cfg, world_size=1)) for m in (fp32, bf16)]
    masters = [torch.cat([p.flatten() for p in e.optimizer.single_partition_of_fp32_groups]) for e in engines]
    assert masters[0].dtype == torch.float32 and torch.equal(masters[0], masters[1])
    assert all(torch.equal(p, q) for p, q in zip(engines[0].module.parameters(), engines[1].module.parameters()))


def test_a_zero3_refit_gathers_one_parameter_at_a_time(tiny_llama_dir, single_rank_group, monkeypatch):
    """Under ZeRO-3 the policy loads partitioned (``zero3_init``: no rank
    ever holds it whole, and a model loaded after it is whole again, as the
    reference policy must be); ``full_parameters`` gathers each parameter in
    turn (every other one stays partitioned meanwhile), so a device never
    holds more than one, and both weight sources copy what they are given
    before the next gather frees it: their weights equal the checkpoint's."""
    from rayspec.sync import DeviceExport, HostGather
    from rayspec.train.policy import full_parameters, zero3_init
    from rayspec.train.ranks import Ranks

    cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                             "model.dtype=float32", "train.deepspeed.zero_optimization.stage=3",
                             "train.deepspeed.optimizer.params.lr=0.01"])
    ds_config = deepspeed_config(cfg, world_size=1)
    with zero3_init(ds_config):
        policy = load_policy(tiny_llama_dir)
    assert all(p.data.numel() == 0 and p.ds_tensor.numel() >= p.ds_numel for p in policy.parameters())
    whole = load_policy(tiny_llama_dir)
    assert not any(hasattr(p, "ds_id") for p in whole.parameters())
    want = {k: v.clone() for k, v in whole.state_dict().items()}
    with zero3_init(deepspeed_config(load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2",
                                                        "train.num_workers=1"]), world_size=1)):
        assert not any(hasattr(p, "ds_id") for p in load_policy(tiny_llama_dir).parameters())  # ZeRO-2: whole
    engine = build_engine(policy, ds_config)
    assert engine.zero_optimization_stage() == 3
    params = list(engine.module.parameters())
    names = []
    for name, t, persistent in full_parameters(engine):
        assert not persistent and sum(p.data.numel() > 0 for p in params) == 1  # only this one gathered
        assert torch.equal(t, want[name])
        names.append(name)
    assert sum(p.data.numel() > 0 for p in params) == 0
    assert set(names) == {n for n, _ in engine.module.named_parameters()}
    host = HostGather(Ranks()).collect(full_parameters(engine), torch.float32)
    export = DeviceExport(Ranks(), torch.device("cpu"))
    weights = export.collect(full_parameters(engine), torch.float32)
    try:
        assert list(host) == names == weights.names
        assert all(torch.equal(host[n], want[n]) and torch.equal(weights.host()[n], want[n]) for n in names)
    finally:
        export.done()

    # a captured update gathers the output layer for the draft targets' normalisers, taken
    # before the step, of the weights that made the features (loss.verifier_normalizers)
    from rayspec.batch import RolloutBatch
    from rayspec.draft.loss import verifier_normalizers

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or len(puts))
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch([torch.randint(0, 200, (5,), generator=g).tolist() for _ in range(4)],
                         [torch.randint(0, 200, (6,), generator=g).tolist() for _ in range(4)],
                         [[-1.0] * 6] * 4, [0, 0, 1, 1], advantages=[1.0, -1.0, 1.0, -1.0])
    policy_update(engine, batch, cfg, 0, [1, 3, 4])
    [chunk] = puts
    import deepspeed

    with deepspeed.zero.GatheredParameters([engine.module.lm_head.weight]):
        stepped = engine.module.lm_head.weight.detach().clone()
    assert not torch.equal(stepped, want["lm_head.weight"])
    before = verifier_normalizers(chunk["final_hidden"], chunk["loss_mask"], want["lm_head.weight"])
    after = verifier_normalizers(chunk["final_hidden"], chunk["loss_mask"], stepped)
    assert torch.equal(chunk["target_top"], before["target_top"]) and chunk["target_lse"].shape == (4, 11, 1)
    assert torch.allclose(chunk["target_lse"], before["target_lse"], rtol=1e-6)
    assert not torch.allclose(chunk["target_lse"], after["target_lse"], rtol=1e-6)


@pytest.mark.slow
def test_a_cuda_ipc_refit_loads_the_ranks_own_weights_in_another_process(tiny_llama_dir, single_rank_group):
    """``transport: cuda_ipc``'s CPU twin through the production calls: a
    ZeRO-2 rank's ``PolicyWorker.refit_weights`` exports its weights as
    shared-memory handles (torch's reductions) in the payload of vLLM's ipc
    engine (``IPCWeightTransferUpdateInfo``); the replica's vLLM worker (the
    engine core's process: an in-process core would take over this test's
    torch.distributed group) opens them through its ``cpu_ipc`` engine, in
    vLLM's weight-transfer round, and loads them in place, so its greedy
    continuation is the trainer's; ``refit_sent`` drops the export, whose
    files live on only as the sender's catch-up copy, until the next refit;
    a replica with no export on its host is told so, and loads nothing."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from rayspec.config import replica_transfer_backend
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from rayspec.sync import IpcWeights, make_sender, make_source
    from rayspec.train.policy import PolicyWorker
    from rayspec.train.ranks import Ranks

    cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                             "model.dtype=float32", "rollout.weight_sync.transport=cuda_ipc"])
    assert replica_transfer_backend(cfg) == "cpu_ipc"
    eng = SpecVLLMEngine(str(tiny_llama_dir), None, dtype="float32", env=cpu_engine_env(1, "all"),
                         engine_kwargs=engine_kwargs(weight_transfer_config={"backend": "cpu_ipc"}))
    tok = load_tokenizer(tiny_llama_dir)
    probe = tok.encode("Question: what is 12 plus 30? Answer:")
    policy = load_policy(tiny_llama_dir)
    torch.manual_seed(4)
    with torch.no_grad():  # weights the replica has not seen
        for p in policy.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    worker = PolicyWorker(build_engine(policy, deepspeed_config(cfg, world_size=1)), cfg, Ranks(), tok.pad_token_id,
                          torch.float32, source=make_source(cfg, Ranks()))
    sender = make_sender(cfg.rollout.weight_sync, RolloutClient(LocalReplicas([eng]), 1), trainer_has_gpu=False,
                         replicas_have_gpu=False, shared_gpus=True)
    files = lambda: {p.name for p in __import__("pathlib").Path("/dev/shm").glob(f"torch_{os.getpid()}_*")}
    before = files()
    trainer_greedy = _greedy_hf(worker.engine.module.eval(), probe, 16)
    try:
        weights = worker.refit_weights()
        assert isinstance(weights, IpcWeights) and len(files() - before) == len(weights.names)
        assert IPCWeightTransferUpdateInfo(**weights.payload).names == weights.names  # vLLM's own payload
        assert sender.send("policy", weights, 30).results() == [30]
        worker.refit_sent()
        del weights
        assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == trainer_greedy
        assert eng.versions()["policy"] == 30 and sender.take_stats()["weight_sync_transport"] == "cuda_ipc"
        first = files() - before
        weights = worker.refit_weights()
        elsewhere = [{"host:elsewhere": next(iter(hs.values()))} for hs in weights.payload["ipc_handles"]]
        payload = {**weights.payload, "ipc_handles": elsewhere}
        with pytest.raises(Exception, match="no Train rank exported the policy on host:"):
            eng.receive_ipc("policy", payload, 31)
        assert eng.versions()["policy"] == 30
        assert sender.send("policy", weights, 32).results() == [32]
        worker.refit_sent()
        del weights
        assert not first & files()  # the first export's files went with the sender's catch-up copy
        assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == trainer_greedy
    finally:
        sender.close()
        worker.source.done()
        eng.shutdown()
    assert files() == before


@pytest.mark.slow
def test_a_shared_memory_refit_lands_through_mapped_files_and_leaves_none(spec_engine, tiny_llama_dir):
    """``transport: shared_memory``: rank 0 packs the refit into files in
    /dev/shm, the replica maps them and loads the views in place; the files
    are gone once it landed, and a replica that cannot see them (another
    node) is told so."""
    from rayspec.devices import to_host
    from rayspec.vllm.worker_ext import RefitExtension
    from rayspec.sync import SharedMemorySender, WeightSyncError

    eng = spec_engine
    tok = load_tokenizer(tiny_llama_dir)
    probe = tok.encode("Question: what is 12 plus 30? Answer:")
    original = to_host(load_policy(tiny_llama_dir).state_dict())
    policy = load_policy(tiny_llama_dir)
    torch.manual_seed(3)
    with torch.no_grad():  # weights the replica has not seen
        for p in policy.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    sd = to_host(policy.state_dict())
    transport = SharedMemorySender(RolloutClient(LocalReplicas([eng]), 1), packed_buffer_size_bytes=1 << 20)
    try:
        assert len(plan_buckets(sd, 1 << 20)) > 3
        refit = transport.send("policy", sd, 20)
        assert len(list(transport.directory.iterdir())) == len(plan_buckets(sd, 1 << 20))
        assert refit.results() == [20]
        assert not list(transport.directory.iterdir())  # unlinked once every replica loaded
        sums = eng.llm.collective_rpc(RefitExtension.rayspec_weight_sums.__name__)[0]
        assert sums["model.norm.weight"] == pytest.approx(float(sd["model.norm.weight"].sum()), rel=1e-6)
        assert eng.generate([probe], temperature=0.0, max_tokens=16)[0].response_ids[0] == _greedy_hf(policy, probe, 16)
        stats = transport.take_stats()
        assert stats["weight_sync_transport"] == "shared_memory" and stats["weight_sync_bytes"] == state_dict_nbytes(sd)
        bucket = plan_buckets(sd, 1 << 20)[0]
        with pytest.raises(WeightSyncError, match="is not on this node: the shared_memory transport needs"):
            eng.receive_shared("policy", [(str(transport.directory / "elsewhere.bin"), bucket)], 21)
        assert transport.send("policy", original, 22).results() == [22]  # the module's later tests' weights
    finally:
        transport.close()
    assert not transport.directory.exists()


def test_deepspeed_builds_its_ops_with_the_venvs_ninja(monkeypatch):
    """DeepSpeed's CPU ops are built by the first ``ninja`` on PATH, and a
    ninja of another version counts them as changed (1.13 hashes a command
    otherwise than 1.11): the venv's bin goes first, where the install
    built them, once, whatever PATH the run was started with."""
    import os
    import shutil
    import sys

    from rayspec.train.policy import use_venv_ninja

    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_venv_ninja()
    use_venv_ninja()
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"
    if os.path.exists(os.path.join(bin_dir, "ninja")):  # DeepSpeed's dependency
        assert shutil.which("ninja") == os.path.join(bin_dir, "ninja")
