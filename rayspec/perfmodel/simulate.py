"""Rollout and RL-step simulation: the cost of each engine step as the
batch drains, plain or speculative, summed over one rollout.

Engine step (one vLLM decode step on one replica of ``tp`` devices, b
sequences in flight, context c_i tokens each, k draft tokens):

    t(b, k) = step_overhead + b (1 + f k) token_overhead + T_fwd(target, b (1 + f k) tokens) + draft(b, k)
              + [k > 0, T > 0] f b vocab rejection_noise_per_logit
    T_fwd(m, n) = forward_overhead + layers * layer_overhead + max(C, M) + (1 - overlap) min(C, M)
                  + 2 * layers * all-reduce(n * h * dtype) if tp > 1
    C = FLOPs(m, n) / (peak * eff_f * tp),  M = bytes(m, n) / (bw * eff_b * tp)
    bytes(m, n) = weights read (MoE: experts touched) + KV cache read (sum_i c_i, once per step)

Verification scores the k drafts and one bonus token per sequence in one
target pass (Leviathan et al. 2023, Alg. 1), so the per-token work outside
the roofline is paid per verified token, not per emitted one (a CPU
forward's cost grows with its query tokens whether they are sequences or
drafts: docs/performance-model.md); an EAGLE-3 head, MTP module or draft
model runs k passes (the first over the tokens accepted in the previous
step, then one token per sequence; at k = 0 the first pass still runs, as
in vLLM 0.32, to keep the draft's KV cache whole, unless the schedule is 0 at
every batch size: rayspec's engine then idles the drafter,
``rayspec.rollout.adaptive``); n-gram drafting costs no forward. With
per-position acceptance rates r_i each sequence advances E(k) = 1 + sum_{i<k}
r_i tokens per step in expectation (``rayspec.rollout.adaptive``). At
temperature > 0 the rejection sampler draws one Exp(1) noise row over the
vocabulary per drafting request for its recovered tokens. f is the fraction
of sequences that draft in a step: 1 for a draft model or head; an n-gram
drafter drafts only where the context has a match, and its per-position
rates then count over all sequences (f times the rates per drafting step).

The rollout is simulated in expectation: sequences with their own response
lengths are spread round-robin over the replicas, admitted while the batch
has room (``max_num_seqs`` and the KV cache), and leave when they reach their
length, so concurrency decays into the tail. Between two events (a sequence
finishes) b and k are constant and steps are costed at the midpoint context.

Three terms make extra draft tokens dearer than linear at large batch and
long context, each from vLLM's documented behaviour:
- **CUDA-graph capture sizes.** A forward over more query tokens than the
  largest captured size runs outside graphs (``vllm/config/vllm.py``,
  ``_set_cudagraph_sizes``: earlier vLLM captured up to min(2 max_num_seqs
  (1 + k), 512) tokens, so a speculative batch of b (1 + k) tokens left the
  graphs at b > 512 / (1 + k); vLLM 0.32 appends the decode sizes,
  ``cudagraph_max_tokens=None``). Its host launches then pace it:
  max(device work, layers eager_layer_s).
- **The token budget.** A step schedules at most ``max_num_batched_tokens``
  query tokens; beyond it the running requests take turns (s = ceil(b (1 +
  f k) / budget) steps of b / s sequences).
- **Lookahead slots.** Each running request holds KV for its 1 + k scheduled
  tokens and k lookahead slots of the drafter (``VllmConfig.
  num_lookahead_tokens``; n-gram: none), which admission must leave free.
The draft's attention over the whole context at each of its k passes and
the verifier's (k + 1)-query attention are in every forward's FLOPs and KV
reads (``forward_work``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from rayspec.model_shape import ModelShape
from rayspec.perfmodel.hardware import Hardware
from rayspec.rollout.adaptive import drafts_nowhere, expected_tokens, merge_schedule

DRAFT_METHODS = ("none", "eagle3", "draft_model", "mtp", "ngram")


@dataclass(frozen=True)
class Engine:
    """One rollout engine configuration.

    Attributes:
        target: the policy (verifier).
        hw: the device it runs on.
        method: speculative method (``DRAFT_METHODS``).
        draft: the draft's shape (eagle3 / mtp / draft_model), None otherwise.
        tp: tensor-parallel devices per replica.
        replicas: data-parallel replicas.
        max_num_seqs: vLLM's cap on sequences in flight per replica.
        temperature: sampling temperature (0: greedy, no rejection noise).
        draft_fraction: f, the fraction of sequences that draft in a
            speculative step (n-gram: those with a match); the others verify
            one token and draw no noise.
        cudagraph_max_tokens: the largest CUDA-graph capture size (query
            tokens); a forward over more runs outside graphs. None: every
            decode forward replays a graph (vLLM 0.32; the CPU).
        max_num_batched_tokens: vLLM's token budget per step.
    """

    target: ModelShape
    hw: Hardware
    method: str = "none"
    draft: ModelShape | None = None
    tp: int = 1
    replicas: int = 1
    max_num_seqs: int = 256
    temperature: float = 1.0
    draft_fraction: float = 1.0
    cudagraph_max_tokens: int | None = None
    max_num_batched_tokens: int = 16384

    def __post_init__(self):
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"method {self.method!r}: unknown (one of {', '.join(DRAFT_METHODS)})")
        if self.method in ("eagle3", "draft_model", "mtp") and self.draft is None:
            raise ValueError(f"method {self.method}: needs a draft shape")
        if not 0 < self.draft_fraction <= 1:
            raise ValueError(f"draft_fraction={self.draft_fraction}: must be in (0, 1]")
        if min(self.tp, self.replicas, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError(f"tp={self.tp}, replicas={self.replicas}, max_num_seqs={self.max_num_seqs}, "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")

    def kv_capacity_tokens(self) -> float:
        """Tokens of KV cache one replica holds (vLLM: gpu_memory_utilization
        of memory minus the target's and draft's weights)."""
        hw = self.hw
        weights = self.target.weight_bytes(1e9, hw.dtype_bytes)
        per_token = self.target.kv_bytes_per_token(hw.dtype_bytes)
        if self.draft is not None:
            weights += self.draft.weight_bytes(1e9, hw.dtype_bytes)
            per_token += self.draft.kv_bytes_per_token(hw.dtype_bytes)
        free = hw.mem_bytes * hw.gpu_memory_utilization * self.tp - weights
        if free <= 0:
            raise ValueError(f"{self.target.name} on {self.tp} x {hw.name}: weights "
                             f"({weights / 1e9:.0f} GB) do not fit; raise tp")
        return free / per_token

    def forward_work(self, m: ModelShape, tokens: float, ctx_sum: float, q: float,
                     logit_tokens: float | None = None) -> tuple[float, float]:
        """(FLOPs, bytes read) of one forward of ``m`` over ``tokens`` query
        tokens; ``ctx_sum``: context tokens summed over the sequences, ``q``:
        query tokens per sequence (attention reads each sequence's KV once);
        ``logit_tokens``: tokens the LM head runs over (default all)."""
        b = self.hw.dtype_bytes
        return (m.flops(tokens, q * ctx_sum, logit_tokens),
                m.weight_bytes(tokens, b) + ctx_sum * m.kv_bytes_per_token(b))

    def forward_seconds(self, m: ModelShape, tokens: float, ctx_sum: float, q: float,
                        logit_tokens: float | None = None) -> float:
        """Seconds of one forward (arguments as ``forward_work``)."""
        hw = self.hw
        flops, nbytes = self.forward_work(m, tokens, ctx_sum, q, logit_tokens)
        compute = flops / (hw.peak_flops * hw.flops_efficiency * self.tp)
        memory = nbytes / (hw.mem_bw * hw.bw_efficiency * self.tp)
        work = max(compute, memory) + (1.0 - hw.overlap) * min(compute, memory)
        if self.tp > 1:  # two ring all-reduces per layer (attention out, MLP out)
            msg = tokens * m.hidden_size * hw.dtype_bytes
            work += 2 * m.layers * (2 * (self.tp - 1) / self.tp * msg / hw.link_bw + hw.collective_latency_s)
        if self.cudagraph_max_tokens is not None and tokens > self.cudagraph_max_tokens:
            return m.layers * hw.layer_overhead_s + max(work, m.layers * hw.eager_layer_s)
        return hw.forward_overhead_s + m.layers * hw.layer_overhead_s + work

    def step_seconds(self, b: int, ctx_sum: float, k: int, accepted: float = 1.0,
                     drafter_idle: bool = False) -> float:
        """t(b, k): seconds of one engine step (see the module docstring).

        Args:
            b: sequences in flight.
            ctx_sum: their context lengths summed (tokens).
            k: draft tokens per sequence (0: plain decoding).
            accepted: tokens per sequence a step emits, E (the first draft
                pass runs over the previous step's).
            drafter_idle: the k schedule is 0 at every batch size, so the
                drafter does not run (only meaningful with k = 0).
        """
        drafting = b * self.draft_fraction if k > 0 else 0.0
        turns = math.ceil((b + drafting * k) / self.max_num_batched_tokens)
        if turns > 1:  # over the token budget the running requests take turns
            return turns * self.step_seconds(b / turns, ctx_sum / turns, k, accepted, drafter_idle)
        t = self.hw.step_overhead_s + (b + drafting * k) * self.hw.token_overhead_s
        t += self.forward_seconds(self.target, b + drafting * k, ctx_sum, 1 + drafting * k / b)
        if self.temperature > 0:
            t += drafting * self.target.vocab_size * self.hw.rejection_noise_s_per_logit
        if self.draft is not None and not (drafter_idle and k == 0):
            # at k = 0 vLLM 0.32 still runs the draft over the step's tokens
            # (its KV cache must cover every position for later drafts)
            t += self.forward_seconds(self.draft, b * accepted, ctx_sum, accepted)
            t += max(k - 1, 0) * self.forward_seconds(self.draft, b, ctx_sum, 1)
            t += k * self.hw.draft_pass_overhead_s
        return t

    def slots_per_request(self, k: int) -> int:
        """KV slots a running request holds beyond its context when the
        engine drafts up to ``k`` tokens: its 1 + k scheduled tokens and the
        drafter's k lookahead slots (vLLM 0.32 ``num_lookahead_tokens``: k for
        EAGLE, MTP and draft models, 0 for n-gram)."""
        return 1 + k + (k if self.draft is not None else 0)

    def prefill_seconds(self, n: int, prompt_len: float, drafter_idle: bool = False) -> float:
        """Prefill of ``n`` prompts of ``prompt_len`` tokens (causal: each
        token attends to half the prompt on average); ``drafter_idle`` as in
        ``step_seconds``."""
        if n == 0:
            return 0.0
        # logits for each prompt's last token only
        t = self.forward_seconds(self.target, n * prompt_len, n * prompt_len / 2, prompt_len, n)
        if self.draft is not None and self.method != "ngram" and not drafter_idle:
            t += self.forward_seconds(self.draft, n * prompt_len, n * prompt_len / 2, prompt_len, n)
        return t


@dataclass
class SimulatedRollout:
    """A simulated rollout.

    Attributes:
        seconds: wall time until the last sequence finishes (max over replicas).
        tokens: response tokens generated.
        steps: engine steps of the slowest replica.
        trace: (time s, sequences in flight, k, step seconds, mean context
            tokens per sequence) at each event of the slowest replica.
    """

    seconds: float
    tokens: int
    steps: float
    trace: list[tuple[float, int, int, float, float]] = field(default_factory=list)


def _replica(engine: Engine, lengths: list[int], prompt_len: float, k_of, rates: list[float],
             idle: bool, k_max: int, max_chunk: int = 256) -> SimulatedRollout:
    cap = engine.max_num_seqs
    kv_cap = engine.kv_capacity_tokens()
    slots = engine.slots_per_request(k_max)
    queue = list(lengths)
    queue.reverse()
    active: list[tuple[float, float]] = []  # heap of (finish progress P_adm + length, P_adm)
    adm_sum = 0.0  # sum of P_adm over active sequences
    progress = t = steps = 0.0
    trace: list[tuple[float, int, int, float, float]] = []

    def admit() -> None:
        nonlocal adm_sum, t
        n = 0
        while queue and len(active) < cap:
            in_use = len(active) * (prompt_len + slots) + len(active) * progress - adm_sum
            if active and in_use + prompt_len + slots + queue[-1] > kv_cap:
                break
            length = queue.pop()
            heapq.heappush(active, (progress + length, progress))
            adm_sum += progress
            n += 1
        t += engine.prefill_seconds(n, prompt_len, idle)

    admit()
    while active:
        b = len(active)
        k = k_of(b)
        e = expected_tokens(rates, k)
        n_steps = max(1, min(max_chunk, math.ceil((active[0][0] - progress) / e)))
        ctx_mid = b * prompt_len + b * (progress + e * n_steps / 2) - adm_sum
        dt = engine.step_seconds(b, ctx_mid, k, accepted=e, drafter_idle=idle)
        trace.append((t, b, k, dt, ctx_mid / b))
        t += dt * n_steps
        steps += n_steps
        progress += e * n_steps
        while active and active[0][0] <= progress + 1e-9:
            adm_sum -= heapq.heappop(active)[1]
        admit()
    return SimulatedRollout(seconds=t, tokens=sum(lengths), steps=steps, trace=trace)


def simulate_rollout(engine: Engine, lengths: list[int], prompt_len: float, k_schedule,
                     rates: list[float]) -> SimulatedRollout:
    """Simulate one rollout of ``len(lengths)`` sequences.

    Args:
        engine: the engine (replicas share the sequences round-robin).
        lengths: response length of each sequence (tokens).
        prompt_len: prompt tokens per sequence.
        k_schedule: an int (fixed k) or a vLLM batch-size schedule
            [(lo, hi, k)] (``num_speculative_tokens_per_batch_size``).
        rates: acceptance rate per draft position (P(position i accepted)).

    Raises:
        ValueError: a negative k, k > 0 with ``method: none``, or no lengths.
    """
    if not lengths:
        raise ValueError("lengths: empty (no sequences to roll out)")
    k_of = _k_lookup(k_schedule)
    # the engine's rule (rayspec.rollout.adaptive): idle iff k is 0 in every range
    idle = k_schedule == 0 if isinstance(k_schedule, int) else drafts_nowhere(k_schedule)
    if engine.method == "none" and not idle:
        raise ValueError("k > 0 with method none")
    k_max = k_schedule if isinstance(k_schedule, int) else max(int(k) for *_, k in k_schedule)
    runs = [_replica(engine, lengths[r::engine.replicas], prompt_len, k_of, rates, idle, k_max)
            for r in range(min(engine.replicas, len(lengths)))]
    slowest = max(runs, key=lambda r: r.seconds)
    return SimulatedRollout(seconds=slowest.seconds, tokens=sum(lengths), steps=slowest.steps, trace=slowest.trace)


def _k_lookup(k_schedule):
    if isinstance(k_schedule, int):
        if k_schedule < 0:
            raise ValueError(f"k={k_schedule}: must be >= 0")
        return lambda b: k_schedule
    table = [(int(lo), int(hi), int(k)) for lo, hi, k in k_schedule]
    if any(k < 0 for *_, k in table):
        raise ValueError(f"k schedule {table}: k must be >= 0")

    def k_of(b: int) -> int:
        for lo, hi, k in table:
            if lo <= b <= hi:
                return k
        return table[-1][2] if b > table[-1][1] else table[0][2]
    return k_of


def best_schedule(engine: Engine, lengths: list[int], prompt_len: float, rates: list[float],
                  k_max: int) -> list[tuple[int, int, int]]:
    """The batch-size schedule of k that maximises modelled throughput:
    for each b, argmax_k b E(k) / t(b, k) at the mean context the plain
    rollout has when b sequences are in flight. Returned as vLLM's
    ``num_speculative_tokens_per_batch_size`` ([(lo, hi, k)], inclusive,
    adjacent equal k merged)."""
    plain = simulate_rollout(replace(engine, method="none", draft=None, replicas=1),
                             lengths[::engine.replicas], prompt_len, 0, rates)
    ctx_at = {b: ctx for _, b, _, _, ctx in plain.trace}  # the last (longest) context seen at b
    seen = sorted(ctx_at)
    top = seen[-1]
    ks = []
    for b in range(1, top + 1):
        ctx = b * ctx_at[min(seen, key=lambda s: abs(s - b))]
        ks.append(max(range(k_max + 1), key=lambda k: expected_tokens(rates, k)
                      / engine.step_seconds(b, ctx, k, expected_tokens(rates, k))))
    return merge_schedule(ks + [ks[-1]] * (engine.max_num_seqs - top))
