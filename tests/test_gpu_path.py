"""rayspec's GPU path on one GPU, in a few minutes: the checks ``python -m jobs.gpu_smoke`` runs and prints
as its table (docs/gpu.md, "Check a node first"). On a GPU node pytest runs them as well:

    pytest -m gpu tests/test_gpu_path.py [--gpu-work-dir DIR] [--gpu-cache-dir DIR]

Each test is marked ``gpu(check)``, ``check`` being the ``jobs.gpu_smoke --only`` name that selects it.
Without a CUDA device every one is skipped before its fixtures run (tests/conftest.py), so the CPU suite
collects them at no cost. A test reports what it measured through ``report``, one line of the table per
subtest: a failed line fails the test and the lines after it still run, so one run names every failure.

The fp32 checks run Triton's fp32 dots in IEEE precision (``TRITON_F32_DEFAULT=ieee``): by default they use
TF32, whose 10-bit mantissa alone moves log-probabilities by more than ``ERROR_BOUND``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ERROR_BOUND = 1e-3  # token_mult_prob_error after a refit, fp32
MIN_SYNC_GBPS = 1.0  # a refit's floor, host memory to a replica on one node
CUDA_RUNNERS = ("vllm.v1.worker.gpu.model_runner.GPUModelRunner",  # V2
                "vllm.v1.worker.gpu_model_runner.GPUModelRunner")  # V1, adaptive engines (VLLM_USE_V2_MODEL_RUNNER=0)
V1_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
MEMORY_SLACK = 2 * 2**30  # this process's CUDA context and the trace's own, beyond the plan
# the step's timer phases (rayspec.train.loop.rl_step) and the plan's (scoring runs beside awake replicas)
PLAN_PHASES = {"rollout": "rollout", "reward": "rollout", "advantages": "rollout", "policy": "policy update",
               "sync": "refit", "draft": "draft training"}
GIB = 2**30


class Lines:
    """The lines a test adds to ``jobs.gpu_smoke``'s table. Each is a subtest named by the line, failing
    when its check does; its detail and figures are recorded as the test's property of the same name
    (``record_property``), where the job reads them."""

    def __init__(self, subtests: pytest.Subtests, record_property):
        self._subtests, self._record = subtests, record_property

    def add(self, name: str, ok: bool, detail: str, **figures) -> None:
        """One line: ``name`` passes when ``ok``; ``detail`` says what was measured, ``figures`` are the
        same measurements as numbers (seconds, bytes, errors) for the job's JSON."""
        self._record(name, {"detail": detail, **figures})
        with self._subtests.test(name):
            assert ok, detail


@pytest.fixture
def report(subtests, record_property) -> Lines:
    """Where a test reports its lines (``Lines``)."""
    return Lines(subtests, record_property)


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    """Triton's fp32 dots in IEEE precision for the engines started here (read when a kernel compiles),
    unless the environment says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_F32_DEFAULT", os.environ.get("TRITON_F32_DEFAULT", "ieee"))
        yield


@pytest.fixture(scope="module")
def work_dir(request) -> Path:
    """``--gpu-work-dir``: the test models and the RL runs' directories."""
    work = Path(request.config.getoption("gpu_work_dir"))
    work.mkdir(parents=True, exist_ok=True)
    return work


@pytest.fixture(scope="module")
def models(request, work_dir):
    """The test models (``_models``), and Ray with a 4 GiB object store, which the RL runs and the weight
    sync's ``ray.put`` (a 1 GB state dict) share; Ray stops after the module's tests."""
    import ray
    from ray import serve

    from rayspec.config import load_config
    from rayspec.driver import init_ray

    built = _models(work_dir, request.config.getoption("gpu_cache_dir"))
    init_ray(load_config(None, [f"ray.object_store_memory={4 * GIB}"]))
    yield built
    serve.shutdown()
    ray.shutdown()


def _gb(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _models(work: Path, cache_dir: str) -> dict[str, Path]:
    """The bundled tokenizer, a tiny Llama (RL steps, adaptive k) and a
    ~1 GB fp32 one (refit, weight sync), with fresh EAGLE-3 heads."""
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy, make_tiny_llama, materialize_bundled_model

    tok = materialize_bundled_model(cache_dir)
    out = {}
    for name, kw in (("tiny", {}), ("1gb", {"hidden_size": 1024, "num_layers": 20})):
        model = work / f"model_{name}"
        if not (model / "config.json").is_file():
            make_tiny_llama(model, tok, **kw)
        head = work / f"head_{name}"
        if not (head / "config.json").is_file():
            save_head(init_head(load_policy(model)), head)
        out[name], out[f"{name}_head"] = model, head
    return out


def _engine_kwargs(gpu_memory_utilization: float) -> dict:
    # CUDA graphs on: the GPU default (config.apply_defaults)
    return {"max_model_len": 512, "max_num_seqs": 16, "seed": 0, "enforce_eager": False,
            "gpu_memory_utilization": gpu_memory_utilization}


def _prob_error(engine, policy, prompts: list[list[int]]) -> tuple[float, int]:
    """token_mult_prob_error of ``engine``'s samples (T = 1) under ``policy``
    (an HF model on the GPU), and the drafts of that rollout."""
    import torch

    from rayspec.train.grpo import token_logprobs, token_mult_prob_error

    batch, stats = engine.generate(prompts, n=2, temperature=1.0, max_tokens=48)
    t = batch.to_padded(0, "cuda")
    with torch.no_grad():
        logits = policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    lp = token_logprobs(logits, t["input_ids"], 1.0)
    return token_mult_prob_error(lp, t["rollout_logprobs"], t["response_mask"]), stats.num_drafts


def check_memory(report: Lines, cfg, model: Path, peaks: dict[str, int]) -> None:
    """The ``memory`` line: each phase's measured peak (``peaks``, bytes) within the plan's total for the
    same run (``rayspec.memory_plan``) plus ``MEMORY_SLACK``."""
    import torch

    from rayspec.memory_plan import plan
    from rayspec.model_shape import ModelShape

    (device,) = plan(cfg, ModelShape.from_hf_config(model), "h100", gpus_per_node=1,
                     device_bytes=torch.cuda.get_device_properties(0).total_memory).devices[:1]
    rows = [(PLAN_PHASES[p], b, device.used(PLAN_PHASES[p])) for p, b in peaks.items() if p in PLAN_PHASES]
    ok = bool(rows) and all(b <= planned + MEMORY_SLACK for _, b, planned in rows)
    report.add("memory", ok, "peak / plan: " + ", ".join(f"{p} {_gb(b)} / {_gb(planned)}" for p, b, planned in rows)
               + f" (slack {_gb(MEMORY_SLACK)})", rows=rows)


@pytest.mark.gpu("versions")
def test_versions(report):
    """torch / CUDA / GPU / vLLM / DeepSpeed / Ray, and every vLLM touch point of rayspec holds in the
    installed vLLM (``rayspec.vllm.require_vllm``)."""
    import deepspeed
    import ray
    import torch

    from rayspec.vllm import VllmInternalsError, require_vllm, vllm_version

    detail = (f"vLLM {vllm_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"{torch.cuda.get_device_name(0)} {_gb(torch.cuda.get_device_properties(0).total_memory)}, "
              f"DeepSpeed {deepspeed.__version__}, Ray {ray.__version__}")
    try:
        require_vllm()
        ok = True
    except VllmInternalsError as e:
        ok, detail = False, f"{detail}; {e}"
    report.add("versions", ok, detail, vllm=vllm_version(), torch=torch.__version__, cuda=torch.version.cuda)


@pytest.mark.gpu("draft_targets")
def test_draft_targets(report):
    """The draft targets' logits on the GPU (``loss.shipped_logits``:
    cuBLAS's bf16 GEMM with fp32 output) at Qwen3-8B's output layer: the
    Train ranks' normalisers against an fp64 reference (log-normaliser
    within 1e-3, argmax equal but for near-ties), and their time within 4x
    the bf16 GEMM of the same shape (an fp32 GEMM on the CUDA cores takes
    about 15x)."""
    import torch

    from rayspec.draft.loss import verifier_normalizers

    g = torch.Generator(device="cuda").manual_seed(0)
    n, H, V = 2048, 4096, 151936
    hidden = torch.randn(1, n + 1, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.05).bfloat16()
    mask = torch.ones(1, n, device="cuda")
    got = verifier_normalizers(hidden, mask, weight)
    z = hidden[0, :n].double() @ weight.double().T  # exact products, fp64 sums
    lse_err = (got["target_lse"][0, :n, 0].double() - torch.logsumexp(z, -1)).abs().max().item()
    top_share = (got["target_top"][0, :n] == z.argmax(-1)).float().mean().item()
    del z

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / 3

    ours = timed(lambda: verifier_normalizers(hidden, mask, weight))
    bf16 = timed(lambda: hidden[0, :n] @ weight.T)
    report.add("draft targets", lse_err < 1e-3 and top_share >= 0.999 and ours <= 4 * bf16,
               f"normalisers of {n} positions over {V} tokens: |lse - fp64| <= {lse_err:.1e}, argmax equal "
               f"at {top_share:.2%}; {ours * 1e3:.1f} ms, {ours / bf16:.1f}x the bf16 GEMM's {bf16 * 1e3:.1f} ms",
               lse_error=lse_err, top_share=top_share, seconds=ours, bf16_gemm_seconds=bf16)


@pytest.mark.gpu("refit")
class TestRefit:
    """Weights into running engines: the ~1 GB fp32 policy (``policy``), changed before each refit so that
    the engine has not seen it, through each transport."""

    @pytest.fixture(scope="class")
    def policy(self, models):
        """The ~1 GB fp32 policy on the GPU, off it after this class: the split RL run's replica asks for
        90% of the device."""
        import torch

        from rayspec.models import load_policy

        torch.manual_seed(0)
        policy = load_policy(models["1gb"], torch.float32).cuda().eval()
        yield policy
        # pytest holds this value until after the teardown: move the weights themselves off the device
        policy.to("meta")
        torch.cuda.empty_cache()

    @pytest.fixture(scope="class")
    def prompts(self, models) -> list[list[int]]:
        """Two prompts' token ids (the ~1 GB model's tokenizer)."""
        from rayspec.models import load_tokenizer

        tok = load_tokenizer(models["1gb"])
        return [tok(p)["input_ids"] for p in ("What is 12 plus 30?", "Name three prime numbers.")]

    def test_refit(self, report, models, policy, prompts):
        """Into a running EAGLE-3 engine (rayspec's gloo weight-transfer engine): ``model runner``, the
        runner vLLM picked, is one of its two CUDA runners (V2 by default); ``policy refit``, the policy
        loaded in place through the object store and through the collective transport (gloo), mean
        |p_vllm / p_policy - 1| of the sampled tokens (``token_mult_prob_error``) < ``ERROR_BOUND`` after
        each; ``weight sync``, seconds and GB/s of those refits (``ray.put`` of the host state dict, then
        the replica's load; the collective's), each at least ``MIN_SYNC_GBPS`` (below it, a 16 GB 8B refit
        would take over 16 s a step); ``draft refit``, a changed head loaded into the drafter: its weights
        are the head's, the verifier's error stays < ``ERROR_BOUND`` and the engine drafts."""
        import ray
        import torch

        from rayspec.devices import to_host
        from rayspec.draft.eagle3 import load_head, vllm_state_dict
        from rayspec.rollout.engine import SpecVLLMEngine
        from rayspec.rollout.client import LocalReplicas, RolloutClient
        from rayspec.vllm.worker_ext import RefitExtension
        from rayspec.buckets import state_dict_nbytes
        from rayspec.sync import CollectiveSender

        # the collective transport between colocated GPUs: rayspec's gloo weight-transfer engine
        engine = SpecVLLMEngine(str(models["1gb"]), {"method": "eagle3", "num_speculative_tokens": 3,
                                                     "model": str(models["1gb_head"])},
                                dtype="float32",
                                engine_kwargs={**_engine_kwargs(0.5),
                                               "weight_transfer_config": {"backend": "gloo"}})
        try:
            report.add("model runner", engine.model_runner in CUDA_RUNNERS,
                       f"EAGLE-3 engine: {engine.model_runner}", runner=engine.model_runner)
            with torch.no_grad():  # a policy the engine has not seen
                for p in policy.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
            sd = to_host(policy.state_dict())
            nbytes = state_dict_nbytes(sd)
            t0 = time.perf_counter()
            ref = ray.put(sd)
            t1 = time.perf_counter()
            engine.receive_refit("policy", ref, 1)
            t2 = time.perf_counter()
            del ref, sd
            err, _ = _prob_error(engine, policy, prompts)
            # again through the collective transport: gloo from this process's host copy into the
            # replica's GPU (NCCL needs two GPUs: on one, NCCL refuses this process and the replica)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
            sd = to_host(policy.state_dict())
            transport = CollectiveSender(RolloutClient(LocalReplicas([engine]), 1), "gloo", 256 << 20,
                                         timeout_s=600)
            transport.send("policy", sd, 2).results()  # forms the group, then a timed refit
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
            sd = to_host(policy.state_dict())
            t3 = time.perf_counter()
            transport.send("policy", sd, 3).results()
            t4 = time.perf_counter()
            transport.close()
            del sd
            err_c, _ = _prob_error(engine, policy, prompts)
            report.add("policy refit", max(err, err_c) < ERROR_BOUND,
                       f"token_mult_prob_error {err:.2e} (object store), {err_c:.2e} (collective, gloo) "
                       f"(< {ERROR_BOUND:g}, fp32)", token_mult_prob_error=err,
                       token_mult_prob_error_collective=err_c)
            gbps = min(nbytes / 1e9 / (t2 - t0), nbytes / 1e9 / (t4 - t3))
            report.add("weight sync", gbps >= MIN_SYNC_GBPS,
                       f"{nbytes / 1e9:.2f} GB: object store {t2 - t0:.2f} s ({nbytes / 1e9 / (t2 - t0):.2f} GB/s; "
                       f"ray.put {t1 - t0:.2f} s, replica load {t2 - t1:.2f} s), "
                       f"collective gloo {t4 - t3:.2f} s ({nbytes / 1e9 / (t4 - t3):.2f} GB/s)",
                       bytes=nbytes, seconds=t2 - t0, put_s=t1 - t0, load_s=t2 - t1, collective_s=t4 - t3)

            head = load_head(models["1gb_head"])
            with torch.no_grad():  # a head the drafter has not seen
                for p in head.parameters():
                    p.mul_(1.05)
            weights = vllm_state_dict(head)

            def norm_sum() -> float:  # the head's final norm (vLLM's CPU backend repacks linears away)
                sums = engine.llm.collective_rpc(RefitExtension.rayspec_weight_sums.__name__, args=("draft",))
                return sums[0]["model.norm.weight"]

            before = norm_sum()
            engine.receive_refit("draft", weights, 1)
            landed, want = norm_sum(), float(weights["norm.weight"].float().sum())
            err, drafts = _prob_error(engine, policy, prompts)
            tol = 1e-5 * max(1.0, abs(want))  # fp32 sums of the same bf16 values
            ok = abs(landed - want) <= tol < abs(before - want) and err < ERROR_BOUND and drafts > 0
            report.add("draft refit", ok, f"drafter norm sum {before:.4f} -> {landed:.4f} (head {want:.4f}); "
                       f"verifier's token_mult_prob_error {err:.2e}; {drafts} drafts", token_mult_prob_error=err)
        finally:
            engine.shutdown()

    def test_cuda_ipc_refit(self, report, models, policy, prompts):
        """The cuda_ipc transport, as colocated runs send: this process plays a
        Train rank on the GPU a replica uses, exports its policy
        (``DeviceExport``: CUDA IPC handles to the weights themselves, keyed by
        the GPU's UUID), and the replica, built with vLLM's own ``ipc``
        weight-transfer engine (``rayspec.config.replica_transfer_backend``),
        loads them in vLLM's round (its worker rebuilds the tensors on the
        device and copies them in); timed from the export to the export
        dropped, rank 0's host copy for catching up included: error <
        ``ERROR_BOUND`` and at least ``MIN_SYNC_GBPS``."""
        import torch

        from rayspec.rollout.client import LocalReplicas, RolloutClient
        from rayspec.rollout.engine import SpecVLLMEngine
        from rayspec.sync import CudaIpcSender, DeviceExport
        from rayspec.sync.interfaces import resident
        from rayspec.train.ranks import Ranks

        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        engine = SpecVLLMEngine(str(models["1gb"]), None, dtype="float32",
                                engine_kwargs={**_engine_kwargs(0.5),
                                               "weight_transfer_config": {"backend": "ipc"}})
        export = DeviceExport(Ranks(), torch.device("cuda", torch.cuda.current_device()))
        sender = CudaIpcSender(RolloutClient(LocalReplicas([engine]), 1))
        try:
            t0 = time.perf_counter()
            weights = export.collect(resident(policy.state_dict()), torch.float32)
            sender.send("policy", weights, 4).results()
            export.done()
            seconds = time.perf_counter() - t0
            nbytes = weights.nbytes
            del weights
            err, _ = _prob_error(engine, policy, prompts)
        finally:
            export.done()
            sender.close()
            engine.shutdown()
        gbps = nbytes / 1e9 / seconds
        report.add("cuda_ipc refit", err < ERROR_BOUND and gbps >= MIN_SYNC_GBPS,
                   f"{nbytes / 1e9:.2f} GB: {seconds:.2f} s ({gbps:.2f} GB/s, the host copy for catching up "
                   f"included); token_mult_prob_error {err:.2e}", seconds=seconds, token_mult_prob_error=err)

    def test_nccl_refit(self, report, models, policy, prompts):
        """The collective transport over NCCL, as split runs in sync mode use
        it: vLLM's own ``nccl`` weight-transfer engines, this process playing
        rank 0 with its weights on GPU 1 (``DeviceGather``: packed and
        broadcast from there, no host copy) into a replica on GPU 0; timed on
        the second refit (the first forms the group): error < ``ERROR_BOUND``
        and at least ``MIN_SYNC_GBPS``. Skipped on one GPU."""
        import torch

        from rayspec.rollout.client import LocalReplicas, RolloutClient
        from rayspec.rollout.engine import SpecVLLMEngine
        from rayspec.buckets import state_dict_nbytes
        from rayspec.sync import CollectiveSender, DeviceGather
        from rayspec.sync.interfaces import resident
        from rayspec.train.ranks import Ranks

        if torch.cuda.device_count() < 2:
            pytest.skip("one GPU: NCCL needs a second for this process's weights")
        engine = SpecVLLMEngine(str(models["1gb"]), None, dtype="float32",
                                engine_kwargs={**_engine_kwargs(0.5),
                                               "weight_transfer_config": {"backend": "nccl"}})
        transport = CollectiveSender(RolloutClient(LocalReplicas([engine]), 1), "nccl", 256 << 20,
                                     timeout_s=600, device="cuda:1")
        try:
            for version in (10, 11):
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(torch.randn_like(p), alpha=0.01)
                on_gpu1 = {k: v.to("cuda:1") for k, v in policy.state_dict().items()}
                sd = DeviceGather(Ranks()).collect(resident(on_gpu1), torch.float32)
                t0 = time.perf_counter()
                transport.send("policy", sd, version).results()
                seconds = time.perf_counter() - t0
            err, _ = _prob_error(engine, policy, prompts)
        finally:
            transport.close()
            engine.shutdown()
        gbps = state_dict_nbytes(sd) / 1e9 / seconds
        report.add("nccl refit", err < ERROR_BOUND and gbps >= MIN_SYNC_GBPS,
                   f"GPU 1 -> replica on GPU 0: {seconds:.2f} s ({gbps:.2f} GB/s); "
                   f"token_mult_prob_error {err:.2e}",
                   seconds=seconds, token_mult_prob_error=err)


@pytest.mark.gpu("adaptive_k")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_adaptive_k(report, models, async_scheduling):
    """An adaptive engine (CUDA graphs on) drafts nothing at k = 0, k tokens per step at k = 3, and nothing
    again at k = 0; ``async``: the same with vLLM's async scheduling on, which adaptive engines turn off
    until this line passes (``rayspec.rollout.engine.adaptive_engine_settings``)."""
    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.engine import SpecVLLMEngine

    engine = SpecVLLMEngine(str(models["tiny"]), {"method": "eagle3", "num_speculative_tokens": 3,
                                                  "model": str(models["tiny_head"])},
                            dtype="bfloat16",
                            engine_kwargs={**_engine_kwargs(0.3), "async_scheduling": async_scheduling},
                            adaptive_k={})
    try:
        prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
        got = []
        for k in (0, 3, 0):
            engine.set_k_schedule(uniform(k, engine.max_num_seqs))
            _, stats = engine.generate(prompts, n=2, max_tokens=24)
            got.append((k, stats.num_drafts, stats.num_draft_tokens))
        ok = all((drafts > 0) == (k > 0) and tokens == k * drafts for k, drafts, tokens in got)
        report.add("adaptive k async" if async_scheduling else "adaptive k", ok,
                   f"runner {engine.model_runner}; (k, drafts, draft tokens): {got}",
                   runner=engine.model_runner, steps=got)
    finally:
        engine.shutdown()


@pytest.mark.gpu("suffix")
def test_suffix(report, models):
    """vLLM's suffix decoding with the ``arctic-inference`` that ``install_node.sh cuda`` built against CUDA
    torch, adaptive (its k is each draft's budget): greedy responses equal a plain engine's on the same
    (V1) runner, drafts at k = 8 longer than 2 tokens, at most 2 at k = 2, none at k = 0."""
    from importlib.metadata import version

    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.engine import SpecVLLMEngine

    prompts = [[1, 504, 2118, 314, 216] * 6, [1, 9151, 28, 253, 1848, 30] * 5]  # repeats the tree can match
    # float32: greedy equality across verification shapes, not bf16 ties
    # on the runner the adaptive suffix engine gets (V1), so the comparison is of the drafting alone
    plain = SpecVLLMEngine(str(models["tiny"]), None, dtype="float32", engine_kwargs=_engine_kwargs(0.3), env=V1_ENV)
    try:
        want, _ = plain.generate(prompts, temperature=0.0, max_tokens=24)
    finally:
        plain.shutdown()
    engine = SpecVLLMEngine(str(models["tiny"]), {"method": "suffix", "num_speculative_tokens": 8},
                            dtype="float32", engine_kwargs=_engine_kwargs(0.3), adaptive_k={})
    try:
        got, same = [], True
        for k in (8, 2, 0):
            engine.set_k_schedule(uniform(k, engine.max_num_seqs))
            batch, stats = engine.generate(prompts, temperature=0.0, max_tokens=24)
            same &= batch.response_ids == want.response_ids
            got.append((k, stats.num_drafts, stats.num_draft_tokens))
        (_, d8, t8), (_, d2, t2), (_, d0, _) = got
        ok = same and t8 > 2 * d8 > 0 and 0 < d2 and t2 <= 2 * d2 and d0 == 0
        report.add("suffix", ok, f"arctic-inference {version('arctic-inference')}, runner {engine.model_runner}; "
                   f"greedy equal to plain: {same}; (k, drafts, draft tokens): {got}", steps=got)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("layout", [pytest.param("colocate", marks=pytest.mark.gpu("rl_colocate")),
                                    pytest.param("split", marks=pytest.mark.gpu("rl_split"))])
def test_rl_step(report, models, work_dir, layout):
    """Two GRPO steps of a tiny model through the real job (Serve replica, Ray Train + DeepSpeed bf16,
    online EAGLE-3 draft training, refit), colocated on the GPU (replica 0.6, Train worker 0.3,
    DraftTrainer 0.1 of it; refits through cuda_ipc) or split (the replica on the GPU, training on the
    node's CPUs: one GPU cannot be split), with the peak GPU memory in use during each phase
    (device-wide, sampled every 20 ms, this process's own CUDA context included). Colocated, the replica
    sleeps at level 2 and the Train rank offloads its states: step 2's rollout must sample the refit
    weights (``token_mult_prob_error`` below the warning threshold), and the ``memory`` line sets the
    peaks against the run's memory plan (``check_memory``)."""
    from rayspec.config import load_config
    from rayspec.devices import MemoryTrace
    from rayspec.driver import run

    run_dir = work_dir / f"rl_{layout}"
    shares = (["rollout.num_gpus_per_replica=0.6", "train.num_gpus_per_worker=0.3", "draft.num_gpus=0.1",
               "rollout.weight_sync.transport=cuda_ipc"]
              if layout == "colocate" else
              # one GPU cannot be split: the replica takes it, training the CPUs
              ["rollout.num_gpus_per_replica=1", "train.num_gpus_per_worker=0", "draft.num_gpus=0",
               "train.deepspeed.optimizer.params.torch_adam=true"])
    cfg = load_config(None, [f"model.path={models['tiny']}", "trainer.steps=2", f"trainer.run_dir={run_dir}",
                             "trainer.save_steps=1", "data.prompts_per_step=2", "grpo.max_new_tokens=32",
                             "train.num_workers=1", "train.num_cpus_per_worker=1", "rollout.num_cpus_per_replica=1",
                             "draft.num_cpus=1", "draft.steps_per_rl_step=2", f"scheduler.layout={layout}",
                             "rollout.engine_kwargs.max_model_len=512", "rollout.engine_kwargs.max_num_seqs=16",
                             *shares])
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    with MemoryTrace() as trace:
        run(cfg)
    wall = time.perf_counter() - t0
    first, rec = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peaks = {phase: trace.peak(iv) for phase, iv in rec["phase_intervals"].items()}
    err = rec.get("token_mult_prob_error", float("nan"))
    ok = (rec["step"] == 2 and rec["rollout_tokens"] > 0 and rec.get("draft_alive", 1) == 1
          and err < cfg.logging.warn_token_mult_prob_error
          and rec["weight_sync_transport"] == cfg.rollout.weight_sync.transport.replace("auto", "collective"))
    report.add(f"rl step {layout}", ok,
               f"{rec['time_step_s']:.1f} s step 2 ({wall:.0f} s with start-up); peak GPU memory "
               + ", ".join(f"{p} {_gb(b)}" for p, b in peaks.items())
               + f"; step 2's token_mult_prob_error {err:.2e} (< {cfg.logging.warn_token_mult_prob_error:g})",
               step_s=rec["time_step_s"], peak_bytes=peaks, token_mult_prob_error=err)
    if layout == "colocate":
        check_memory(report, cfg, models["tiny"], peaks)


@pytest.mark.gpu("zero3")
def test_zero3_load(report, models):
    """A Train rank's load under ZeRO-3 (``zero3_init``) in a one-rank NCCL
    group on the last GPU, with ``LOCAL_RANK`` 0 as Ray Train may set it:
    the ~1 GB policy's partitions land on the GPU given, not
    ``LOCAL_RANK``'s, and the engine's gathered weights are the checkpoint's
    (bf16: ``make_tiny_llama``'s weights are exact in it). Last in the
    module: it leaves DeepSpeed's communication state in this process."""
    import socket

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rayspec.config import load_config
    from rayspec.models import load_policy
    from rayspec.train.loop import training_load_dtype
    from rayspec.train.policy import build_engine, deepspeed_config, full_parameters, zero3_init

    gpu = torch.cuda.device_count() - 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", gpu))
    try:
        cfg = load_config(None, ["data.prompts_per_step=2", "grpo.group_size=2", "train.num_workers=1",
                                 "train.num_gpus_per_worker=1", "rollout.num_gpus_per_replica=1",
                                 "train.deepspeed.zero_optimization.stage=3"])
        ds_config = deepspeed_config(cfg, 1)
        with zero3_init(ds_config, gpu):
            policy = load_policy(models["1gb"], training_load_dtype(cfg))
        placed = {str(p.ds_tensor.device) for p in policy.parameters()}
        engine = build_engine(policy, ds_config, device_rank=gpu)
        want = load_file(models["1gb"] / "model.safetensors")
        names, equal = set(), True
        for name, t, _ in full_parameters(engine):
            if name in want:
                names.add(name)
                equal &= torch.equal(t.cpu(), want[name].to(t.dtype))
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    params = {n for n, _ in engine.module.named_parameters()}
    report.add("zero3 load", placed == {f"cuda:{gpu}"} and equal and params <= names,
               f"partitions on {sorted(placed)} (cuda:{gpu} given, LOCAL_RANK 0); gathered weights "
               f"{'equal' if equal else 'differ from'} the checkpoint's ({len(names)} tensors)")
