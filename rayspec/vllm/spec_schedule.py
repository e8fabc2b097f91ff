"""Adaptive k inside vLLM: switch the batch-size schedule of k on a running
engine (a vLLM general plugin; the controller that chooses k is
``rayspec.rollout.adaptive``, which imports no vLLM).

vLLM 0.32 chooses k per step from a batch-size schedule,
``speculative_config["num_speculative_tokens_per_batch_size"] = [(lo, hi, k), ...]``
(dynamic speculative decoding; the scheduler looks k up by the number of
sequences in the step and the proposer drafts that many), but the schedule is
fixed when the engine is built and there is no API to change it. Rebuilding
an engine costs tens of seconds and its KV cache, so this module adds one
utility method to vLLM's ``EngineCore`` (installed through the
``vllm.general_plugins`` entry point, in vLLM's own engine process) that
rebuilds the scheduler's lookup with vLLM's own
``build_dynamic_sd_schedule_lookup``. The engine must be built with a schedule
(any), so its scheduler runs the dynamic path.

At k = 0 vLLM 0.32 still runs the drafter's forward over every step's tokens
(``SpecDecodeBaseProposer.propose``: "to keep the drafter KV cache in sync"),
so a sequence can draft again when its batch shrinks into a k > 0 range.
When the schedule is 0 at every batch size, no sequence can draft before the
schedule changes, so the utility also marks the drafter idle (where the
replica asks it to: ``SpecVLLMEngine.set_k_schedule``) and a wrapped
``propose`` returns no drafts without that forward (on 2 CPU cores it was
3-4 ms a step, 7% of a step at one sequence). Leaving the idle state resets
the prefix cache: blocks cached meanwhile hold no draft KV. rayspec changes
the schedule only between ``generate`` calls, with no request in flight. A
step in which no request drafts samples with the plain sampler, not vLLM's
rejection sampler (``_plain_sample_without_drafts``).

Match drafters: vLLM 0.32's suffix proposer refuses any k but its configured
one, so the plugin passes it the scheduled k (``_suffix_at_scheduled_k``).

Model runners: the idle drafter and the plain sampler wrap vLLM 0.32's V1
``GPUModelRunner`` and its drafters (the CPU runner subclasses it). CUDA
vLLM builds EAGLE-3 and draft-model engines on its V2 runner by default,
which has neither, so adaptive engines select V1 (``SpecVLLMEngine`` sets
``VLLM_USE_V2_MODEL_RUNNER=0``). With CUDA graphs on, V1 captures piecewise
graphs whenever a k schedule is set (vLLM overrides FULL to PIECEWISE for
dynamic speculative decoding: a k switch changes the verification length,
and attention runs outside the piecewise graphs), so every k in 0..K keeps a
graph. The first schedule change checks, in the worker, that the hooks are
in place, and raises ``VllmInternalsError`` naming the vLLM version when
they are not (the plugin did not load, or the runner is V2).
"""

from __future__ import annotations

import functools
import logging

from rayspec.vllm import touchpoints as tp

log = logging.getLogger(__name__)

UTILITY = "rayspec_set_num_speculative_tokens_per_batch_size"
_register_error: str | None = None  # why register() could not install the hooks, in this process


def _set_schedule(self, schedule: list, drafter_idle: bool) -> list:
    """EngineCore utility: replace the scheduler's batch-size -> k lookup.

    ``drafter_idle``: the drafter skips its forward while k is 0 (the
    caller decides: ``SpecVLLMEngine.set_k_schedule``); False keeps the
    drafter's KV-sync forward running at k = 0 (calibration times it).
    Returns the normalised schedule. Raises RuntimeError when the engine was
    built without ``num_speculative_tokens_per_batch_size`` (its scheduler
    pads every decode to k+1 tokens and cannot switch).
    """
    if not getattr(self, "rayspec_hooks_checked", False):
        self.collective_rpc(_check_worker_hooks)
        self.rayspec_hooks_checked = True
    sched = self.scheduler
    if getattr(sched, "dynamic_sd_lookup", None) is None:
        raise RuntimeError("engine built without speculative_config.num_speculative_tokens_per_batch_size; "
                           "build it with a schedule to switch k at run time")
    sched.dynamic_sd_lookup = tp.BUILD_SCHEDULE.load()(
        [tuple(r) for r in schedule], sched.scheduler_config.max_num_seqs, sched.num_spec_tokens)
    if drafter_idle != getattr(self, "rayspec_drafter_idle", False):
        self.collective_rpc(_set_drafter_idle, args=(drafter_idle,))
        if not drafter_idle:
            self.reset_prefix_cache()
        self.rayspec_drafter_idle = drafter_idle
    return [list(r) for r in schedule]


def _set_drafter_idle(worker, idle: bool) -> None:
    """Worker-side half of ``_set_schedule`` (sent by collective_rpc)."""
    worker.model_runner.drafter.rayspec_idle = idle


def _check_worker_hooks(worker) -> None:
    """In a worker: the model runner is V1 (``drafter``), its ``_sample``
    and, for model and suffix drafters, ``propose`` are wrapped by
    ``register``.

    Raises:
        VllmInternalsError: naming what is missing and the vLLM version.
    """
    runner = worker.model_runner
    name = f"{type(runner).__module__}.{type(runner).__qualname__}"
    why = f" (the rayspec_spec_schedule plugin: {_register_error})" if _register_error else ""
    if not hasattr(runner, "drafter"):
        raise tp.internals_error(tp.ADAPTIVE, f"the model runner {name} has no `drafter` (the V2 runner keeps a "
                                    "`speculator`; adaptive engines need the V1 runner: "
                                    "VLLM_USE_V2_MODEL_RUNNER=0)")
    if not getattr(getattr(type(runner), "_sample", None), "rayspec_wrapped", False):
        raise tp.internals_error(tp.ADAPTIVE, f"{name}._sample is not wrapped{why}")
    drafter = runner.drafter
    if isinstance(drafter, (tp.PROPOSE.owner(), tp.SUFFIX_PROPOSE.owner())) and \
            not getattr(type(drafter).propose, "rayspec_wrapped", False):
        raise tp.internals_error(tp.ADAPTIVE, f"{type(drafter).__qualname__}.propose is not wrapped{why}")


def _propose_unless_idle(propose):
    """Wrap ``SpecDecodeBaseProposer.propose``: an idle drafter asked for 0
    tokens returns [batch, 0] int64 draft ids without its forward pass."""
    @functools.wraps(propose)
    def wrapped(self, num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens == 0 and getattr(self, "rayspec_idle", False):
            import torch

            return torch.empty(kwargs["common_attn_metadata"].batch_size(), 0,
                               dtype=torch.int64, device=self.device)
        return propose(self, num_speculative_tokens, *args, **kwargs)

    wrapped.rayspec_wrapped = True
    return wrapped


def _suffix_at_scheduled_k(propose):
    """Wrap ``SuffixDecodingProposer.propose``: draft at most the k the
    scheduler chose for this step.

    vLLM 0.32's suffix proposer asserts that the scheduled k equals
    ``num_speculative_tokens`` and caps every draft at the latter, so a
    batch-size schedule (dynamic speculative decoding) stops the engine at
    its first step with another k. Suffix Decoding itself takes any budget
    per call (arXiv 2411.04975: the draft is the tree's most likely path,
    at most ``max_spec_tokens`` and ``max_spec_factor`` x the match length
    long), so the wrapper passes the scheduled k as that budget. At k = 0
    the call still runs: it is what adds each step's sampled tokens to the
    request's suffix tree (and the response to the shared cache), so a
    sequence drafts from its whole text when its batch size drafts again;
    the tree update is C++ and costs microseconds, so the drafter never idles.
    """
    @functools.wraps(propose)
    def wrapped(self, num_speculative_tokens, *args, **kwargs):
        configured = self.num_speculative_tokens
        self.num_speculative_tokens = min(num_speculative_tokens, configured)
        try:
            return propose(self, self.num_speculative_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = configured

    wrapped.rayspec_wrapped = True
    return wrapped


def _plain_sample_without_drafts(sample):
    """Wrap ``GPUModelRunner._sample``: a step in which no request carries a
    draft samples with the plain sampler.

    vLLM 0.32 builds spec-decode metadata for every step of a speculative
    engine, drafts or not, so a step at k = 0 still runs the rejection
    sampler: the bonus tokens through the same sampler, then a [batch, vocab]
    logits copy, two index_puts and a second log-softmax for the logprobs,
    none of which a plain engine does (about 2 ms of a 107 ms step at 16
    sequences on 2 CPU cores). With no drafts the rejection sampler returns
    exactly the sampler's tokens and logprobs ([batch, 1] int32 ids, the same
    generators drawn), so the plain call is the same computation. Left alone
    under async scheduling, whose spec path also updates draft bookkeeping.
    """
    @functools.wraps(sample)
    def wrapped(self, logits, spec_decode_metadata):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and not self.use_async_scheduling):
            spec_decode_metadata = None
        return sample(self, logits, spec_decode_metadata)

    wrapped.rayspec_wrapped = True
    return wrapped


def register() -> None:
    """vLLM general-plugin hook: add the schedule utility to EngineCore, the
    idle check to the model drafters' ``propose``, the scheduled k to the
    suffix drafter's and the plain sampler to steps without drafts
    (idempotent).

    vLLM loads every installed plugin into every engine, adaptive or not, so
    a vLLM without these internals is not an error here: the reason is kept
    and logged, and an adaptive engine raises it at its first schedule
    change (``_set_schedule``, ``set_schedule``)."""
    global _register_error
    try:
        engine_core = tp.ENGINE_CORE.load()
        tp.BUILD_SCHEDULE.load()
        wraps = [(tp.PROPOSE, _propose_unless_idle), (tp.SUFFIX_PROPOSE, _suffix_at_scheduled_k),
                 (tp.RUNNER_SAMPLE, _plain_sample_without_drafts)]
        upstream = [point.load() for point, _ in wraps]
    except tp.VllmInternalsError as e:
        _register_error = str(e)
        log.warning("rayspec adaptive k is unavailable: %s", _register_error)
        return
    if not hasattr(engine_core, UTILITY):
        setattr(engine_core, UTILITY, _set_schedule)
    for (point, wrap), fn in zip(wraps, upstream):
        if not getattr(fn, "rayspec_wrapped", False):
            point.install(wrap(fn))


def set_schedule(engine, schedule: list[tuple[int, int, int]], drafter_idle: bool) -> None:
    """Apply ``schedule`` ([(lo, hi, k)], inclusive batch-size ranges) to a
    running engine (``rayspec.vllm.engines``: its ``call_utility``
    reaches the engine core in its own process or in this one).
    ``drafter_idle``: see ``_set_schedule``.

    Raises:
        RuntimeError: the engine has no dynamic schedule.
        VllmInternalsError: the engine core lacks the utility (the plugin did
            not load), or a worker lacks the hooks (``_check_worker_hooks``).
    """
    try:
        engine.call_utility(UTILITY, [list(r) for r in schedule], drafter_idle)
    except Exception as e:  # vLLM returns the engine core's error as a plain Exception
        if f"has no attribute '{UTILITY}'" in str(e):
            raise tp.internals_error(tp.ADAPTIVE, f"the engine core has no {UTILITY} (the rayspec_spec_schedule "
                                     "vllm.general_plugins entry point did not load: is it excluded by "
                                     "VLLM_PLUGINS?)") from None
        raise
