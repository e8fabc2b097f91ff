"""Calibrate a hardware preset on plain (no-speculation) decoding.

Two quantities are timed directly on the machine: how far compute and
weight streaming overlap in vLLM's CPU linear (``measure_overlap``) and the
rejection sampler's noise per vocabulary entry
(``measure_rejection_noise``); the ``cpu`` preset's matmul rate, memory
bandwidth and per-layer dispatch cost were timed once when it was made
(docs/performance-model.md, "Presets"). ``fit_plain`` then fits the
two remaining overheads to measured plain cells (prefill, then decode) at several
concurrencies (``jobs.bench_rollout`` cells with ``method: none``): the
fixed seconds per engine step and the seconds per query token, minimising
the squared relative error of the modelled cell time
(``rayspec.perfmodel.simulate``). Nothing speculative enters: the
speculative cells are left to test the model (``rayspec.perfmodel.validate``).
"""

from __future__ import annotations

import time

import numpy as np

from rayspec.model_shape import ModelShape
from rayspec.perfmodel.hardware import Hardware
from rayspec.perfmodel.simulate import Engine


def _time(fn, repeats: int) -> float:
    for _ in range(max(1, repeats // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def overlap_from_timings(cold: float, compute: float, memory: float) -> float:
    """Fraction of the shorter of ``compute`` and ``memory`` seconds hidden
    under the longer in a pass that took ``cold`` seconds: 1 when cold is
    their max (the roofline), 0 when it is their sum; clipped to [0, 1]."""
    hidden = 1.0 - (cold - max(compute, memory)) / min(compute, memory)
    return min(1.0, max(0.0, hidden))


def measure_overlap(shape: ModelShape, tokens: tuple[int, ...] = (8, 16, 32, 64, 128),
                    nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """How far compute and weight streaming overlap in a forward on this
    CPU, through vLLM's own CPU linear (``dispatch_cpu_unquantized_gemm``:
    oneDNN with prepacked weights on x86), at the model's MLP shape
    (h x intermediate, float32).

    For n query tokens a stack of distinct weights of ``nbytes`` (beyond the
    caches) is timed cold; the same number of passes over one matrix (in
    cache) gives the compute time, the one-token pass over the stack the
    streaming time (``overlap_from_timings``). Returns the median over
    ``tokens``, each the best of ``repeats``.
    """
    import torch
    from rayspec.vllm.engine_access import cpu_linear

    h, inter = shape.hidden_size, shape.intermediate_size or 4 * shape.hidden_size

    def linear():
        return cpu_linear(torch.nn.Linear(h, inter, bias=False).requires_grad_(False))

    stack = [linear() for _ in range(max(1, nbytes // (4 * h * inter)))]
    hot = stack[:1] * len(stack)

    def best(layers, n: int) -> float:
        x = torch.randn(n, h)
        return min(_time(lambda: [f(x, None, None) for f in layers], 1) for _ in range(repeats))

    with torch.inference_mode():
        memory = best(stack, 1)
        return float(np.median([overlap_from_timings(best(stack, n), best(hot, n), memory) for n in tokens]))


def measure_rejection_noise(vocab_size: int, rows: int = 8, repeats: int = 20) -> float:
    """Seconds per vocabulary entry of the Exp(1) noise vLLM's rejection
    sampler draws per drafting request, as rayspec's patched
    ``sample_recovered_tokens`` draws it (one float64 uniform row per request
    from its own generator, -log1p(-U), cast to float32, reciprocal)."""
    import torch

    from rayspec.vllm.cpu_fixes import exp_noise_rows

    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    return _time(lambda: exp_noise_rows(gens, vocab_size, torch.float32).reciprocal_(), repeats) / (rows * vocab_size)


def plain_points(cells: list[dict], prompt_lens: dict[int, float]) -> list[tuple[int, float, float, float]]:
    """(b, prompt tokens per sequence, output tokens per sequence, wall
    seconds) of the fixed-concurrency no-speculation cells.

    Args:
        cells: ``jobs.bench_rollout`` cells.
        prompt_lens: mean prompt tokens of the prompts run at each concurrency.

    Raises:
        ValueError: no ``method: none`` fixed cells, or a concurrency without
            a prompt length (named).
    """
    out = []
    for c in cells:
        if c["method"] != "none" or c["shape"] != "fixed":
            continue
        b = c["concurrency"]
        if b not in prompt_lens:
            raise ValueError(f"concurrency {b}: no prompt length given")
        out.append((b, prompt_lens[b], c["output_tokens"] / b, c["wall_s"]))
    if not out:
        raise ValueError("no fixed-concurrency cells with method none to calibrate on")
    return out


def cell_seconds(eng: Engine, b: int, prompt_len: float, tokens: float, k: int = 0, e: float = 1.0) -> float:
    """Modelled wall seconds of a bench cell: prefill of b prompts, then
    tokens / E steps at the mid-cell context. The bench sets one k for every
    batch size, so at k = 0 the drafter idles."""
    ctx = b * (prompt_len + tokens / 2)
    return (eng.prefill_seconds(b, prompt_len, drafter_idle=k == 0)
            + tokens / e * eng.step_seconds(b, ctx, k, accepted=e, drafter_idle=k == 0))


def fit_plain(points: list[tuple[int, float, float, float]], target: ModelShape, base: Hardware) -> Hardware:
    """Fit ``step_overhead_s`` and ``token_overhead_s`` of ``base`` to plain
    cells ``points`` [(b, prompt_len, tokens, wall s)] (``cell_seconds``):
    weighted least squares on the relative error, floored at 0. The rates
    (``peak_flops``, ``mem_bw``) and ``layer_overhead_s`` are measured, not
    fitted: with the weights dominating the bytes, bandwidth and a per-step
    constant are indistinguishable in plain steps. Efficiencies are set to 1
    (measured rates are sustained ones).

    Raises:
        ValueError: fewer than 2 points (2 unknowns).
    """
    if len(points) < 2:
        raise ValueError(f"{len(points)} plain cells: need at least 2 concurrencies to fit 2 numbers")
    hw = base.with_overrides(flops_efficiency=1.0, bw_efficiency=1.0, step_overhead_s=0.0, token_overhead_s=0.0)
    b = np.array([p[0] for p in points], dtype=float)
    n = np.array([p[2] for p in points])
    t = np.array([p[3] for p in points])
    g = np.array([cell_seconds(Engine(target, hw), int(bi), p, ni) for bi, p, ni, _ in points])
    sw = 1.0 / t  # sqrt of the relative-error weights
    a = np.stack([n, n * b], axis=1) * sw[:, None]  # seconds = g + n step_overhead + n b token_overhead
    s, per_token = np.maximum(np.linalg.lstsq(a, (t - g) * sw, rcond=None)[0], 0.0)
    return hw.with_overrides(step_overhead_s=float(s), token_overhead_s=float(per_token))
