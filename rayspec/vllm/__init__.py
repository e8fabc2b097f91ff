"""rayspec inside vLLM: the one place that imports vLLM internals, patches
or wraps them (``touchpoints.py`` declares each one and why).

- ``cpu_fixes``: the CPU platform's speculative-sampling fix and costs
  (a ``vllm.general_plugins`` entry point);
- ``spec_schedule``: adaptive k's run-time batch-size schedule (a plugin);
- ``worker_ext``: the worker extension that reloads policy and draft
  weights in place (refit);
- ``engine_access``: what a running engine and vLLM's distributed helpers
  give beyond the public API.

Importing this package imports no vLLM. It sits below the weight
transports (``rayspec.sync``: rayspec's weight-transfer engines load through
``worker_ext``) and the replicas (``rayspec.rollout``), and imports neither.
"""

from rayspec.vllm.touchpoints import (
    TOUCH_POINTS,
    TouchPoint,
    VllmInternalsError,
    check_vllm,
    require_vllm,
    vllm_version,
)

__all__ = ["TOUCH_POINTS", "TouchPoint", "VllmInternalsError", "check_vllm", "require_vllm", "vllm_version"]
