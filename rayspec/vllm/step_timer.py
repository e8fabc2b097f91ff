"""Each engine step's batch and seconds, from vLLM's own per-iteration stats.

Adaptive k needs t(b, k), the seconds of one decode step at b sequences in
flight with k drafts each. vLLM measures every engine step already: with
``enable_logging_iteration_details`` its engine core times the step's model
execution (``EngineCore.capture_iteration_details``: the forward passes, the
sampler and the drafter) and sends it with the step's outputs as
``SchedulerStats.iteration_details`` (requests and tokens being prefilled,
requests and tokens being decoded, elapsed ms), where the engine's stat
loggers (``StatLoggerBase``, vLLM's interface for custom loggers) receive
it. ``StepTimer`` is such a logger: it keeps each step's figures until the
replica takes them after a ``generate``.

``AsyncLLM`` takes it as one of its ``stat_loggers``; ``vllm.LLM`` (0.32)
takes none, so ``OfflineEngine`` appends it to the engine's
``StatLoggerManager`` (two touch points, ``rayspec.vllm.touchpoints``).
vLLM's default logging stat logger would log every iteration's details at
INFO, once per engine step; ``quiet_iteration_lines`` keeps those lines out
of the replica's log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass


ENGINE_KWARGS = {"enable_logging_iteration_details": True}  # what the timer needs, with stats on (disable_log_stats=False)


@dataclass(frozen=True)
class EngineStep:
    """One engine step as vLLM's scheduler ran it.

    Attributes:
        prefill_requests / prefill_tokens: requests with prompt tokens in
            the step (vLLM's "context" requests) and those tokens.
        decode_requests / decode_tokens: requests decoding in the step and
            their scheduled tokens (1 + the drafts being verified, each).
        seconds: the step's model execution (forward passes, sampling,
            drafting), as vLLM's engine core timed it.
    """

    prefill_requests: int
    prefill_tokens: int
    decode_requests: int
    decode_tokens: int
    seconds: float


class StepTimer:
    """A vLLM stat logger (``StatLoggerBase``'s methods) that keeps each
    engine step's ``EngineStep`` until ``take``."""

    def __init__(self):
        self._steps: list[EngineStep] = []

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        d = getattr(scheduler_stats, "iteration_details", None)
        if d is not None and not d.is_dummy:
            self._steps.append(EngineStep(d.num_ctx_requests, d.num_ctx_tokens, d.num_generation_requests,
                                          d.num_generation_tokens, d.elapsed_ms / 1000.0))

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def take(self) -> list[EngineStep]:
        """The steps recorded since the last ``take`` (then forgotten)."""
        steps, self._steps = self._steps, []
        return steps


class _NoIterationLines(logging.Filter):
    """Drops vLLM's per-iteration INFO lines (``LoggingStatLogger._log_iteration_details``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Iteration(%d)" not in str(record.msg)


def quiet_iteration_lines() -> None:
    """Keep vLLM's per-iteration INFO lines (one per engine step, logged by
    its default stat logger once ``enable_logging_iteration_details`` is on)
    out of this process's log. The filter sits on the logger that logs them
    and survives vLLM's ``dictConfig``, which resets its level."""
    vllm_log = logging.getLogger("vllm.v1.metrics.loggers")
    if not any(isinstance(f, _NoIterationLines) for f in vllm_log.filters):
        vllm_log.addFilter(_NoIterationLines())
