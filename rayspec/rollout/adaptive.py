"""Adaptive speculation: choose k (0 = no speculation) per batch size from
measured acceptance and measured step cost, and apply it to a running engine.

vLLM 0.32 chooses k per step from a batch-size schedule
(``num_speculative_tokens_per_batch_size``) fixed at engine build;
``rayspec.vllm.spec_schedule`` switches it on a running engine, idles the
drafter where k is 0 everywhere and samples draft-free steps with the plain
sampler.

Controller (``AdaptiveK``): with per-position acceptance rates r_i (P(draft
position i accepted), vLLM's ``spec_decode_num_accepted_tokens_per_pos`` /
``num_drafts``), a step with k drafts emits E(k) = 1 + sum_{i<k} r_i tokens per
sequence (Leviathan et al. 2023, Sec. 3.1, without the i.i.d. assumption). With
t(b, k) the measured seconds of one engine step at b sequences in flight, the
throughput is b * E(k) / t(b, k); the controller picks, for each b, the k in
0..K that maximises it, and k = 0 unless a speculative k beats plain decoding
by ``margin``. A schedule that drafts at some batch sizes keeps the drafter
in sync at the others (below), so it is kept only if the last rollout's shape
(token positions spent at each b) would run ``margin`` faster with it than
with k = 0 everywhere. Every ``probe_every`` draft refits (``probe``), when
the rates say no k pays anywhere, batch size 1 drafts k_max tokens anyway:
without drafts there is no acceptance to measure, and an online-trained
draft would never be tried again; the probe costs the drafter's sync for one
rollout and the steps run with one sequence left, where a draft token costs
least, and it measures every position at once (a 1-token probe left the
later positions at their old rates, which a schedule drafting fewer tokens
never measures again). t(b, k) is measured on the replica's own rollouts,
not timed before them: vLLM reports every engine step's batch and seconds
(``rayspec.vllm.step_timer``), and ``StepTimes`` keeps the decode
steps by kind (plain, k = 0 with the drafter in sync, k drafts) and batch
size; between the k measured, t is linear in k. Until a choice can rest on
measurements the controller schedules the rollout that measures what it
lacks (``schedule``): a replica's first rollout drafts k_max in its tail
(it measures the acceptance, a drafting step's cost, and a sync step's
above the tail), the next one drafts nothing (a plain step's cost); costs
past the batch sizes measured keep their ratio to a plain step. The rates
are updated after every rollout. They start from the draft's held-out rates where
``jobs.warmstart_draft`` recorded them beside the head
(``acceptance.json``).

A draft trained online comes with the DraftTrainer's estimate of its rates
(``draft_estimated``): the replicas' drafting replayed on the RL step's
responses with the head the step began with
(``rayspec.draft.loss.replay_drafting``), even where no replica drafted. The
estimate replaces the probe: a head the estimate says pays is drafted with at
once, wherever its measured predecessor was switched off, and one it says
does not pay costs nothing. The replay also comes by share of the rollout
in flight (``rayspec.draft.loss.acceptance_by_share``): a rollout's tail,
where a schedule on CPUs drafts, holds its longest responses, which the
replicas accepted at a quarter to a half of the whole rollout's replayed rate
(RL on 2 CPU cores, docs/benchmarks.md); so each batch size drafts by the
rates of its share of the rollout (``rates_at``). Each estimate is scaled
by a per-position calibration, measured / estimated where the schedule
drafted, learned from the rollouts that drafted right after an estimate:
the head sent out is one step further trained than the one replayed, and
the policy moved since the responses were sampled.

Match drafters (vLLM's ``ngram`` and ``suffix`` methods) draft only where
their match does, and suffix drafts end where the match does, up to k.
vLLM 0.32's suffix proposer refuses any k but its configured one, so the
plugin passes it the scheduled k (``_suffix_at_scheduled_k``): the long
tail of a rollout (few sequences left, verification nearly free) gets the
largest budget and a full batch none where drafting does not pay there. The
controller measures f, the share of sequence-steps that carried a draft
where k > 0 (``draft_fraction``), and predicts a step's tokens with it
(``best_k``); the step's cost is measured with the drafts the matches
made. Their drafts are the policy's own text, so
for them a policy refit counts as a draft refit (``probe``).

How the schedule reaches a running engine, which model runners carry it and
what CUDA graphs it keeps: ``rayspec.vllm.spec_schedule``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field

MATCH_DRAFTERS = ("ngram", "suffix")  # vLLM methods that draft only where their match does
# a rollout that measures the acceptance or a drafting step's cost drafts up to this many sequences in
# flight: its tail, where a draft costs least (on 2 CPU cores a 3-draft step at 64 sequences cost 3x a
# plain one, at one 1.45x); the rest of it runs sync steps, measured too
MEASURE_TAIL = 8


def uniform(k: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The schedule that drafts k tokens at every batch size."""
    return [(1, max_num_seqs, k)]


def drafts_nowhere(schedule) -> bool:
    """k is 0 in every (lo, hi, k) range: the drafter may idle."""
    return all(r[2] == 0 for r in schedule)


def expected_tokens(rates: list[float], k: int) -> float:
    """E(k) = 1 + sum_{i<k} r_i: tokens per sequence per verification step
    with k drafts and per-position acceptance rates ``rates`` (positions past
    the measured ones count 0)."""
    return 1.0 + sum(rates[:k])


def geometric_rate(rates: list[float]) -> float:
    """Per-token acceptance rate a of an i.i.d. model (Leviathan et al. 2023):
    accepted drafts over positions reached, sum_i r_i / sum_i r_{i-1} with
    r_0 = 1 (the maximum-likelihood a given the per-position rates)."""
    if not rates:
        return 0.0
    reached = 1.0 + sum(rates[:-1])
    return min(sum(rates) / reached, 1.0 - 1e-9)


def extrapolate_rates(rates: list[float], k_max: int) -> list[float]:
    """``rates`` (measured positions) continued to ``k_max`` positions with
    the geometric rate a of the measured ones: r_{n+j} = r_n a^j (empty or
    already long enough: unchanged)."""
    if not rates:
        return list(rates)
    a = geometric_rate(rates)
    return list(rates) + [rates[-1] * a ** (j + 1) for j in range(k_max - len(rates))]



def physical_limit(a: float, k: int, c: float, draft_fraction: float = 1.0) -> float:
    """Speedup bound for acceptance rate a, k drafts and cost ratio c
    (Leviathan et al. 2023, Eq. 1 and Thm 3.8): E = (1 - a^(k+1)) / (1 - a)
    tokens per verification step, over the cost 1 + k*c of one step in plain
    steps. ``draft_fraction`` f: the share of sequence-steps that carry a
    draft (an n-gram drafter drafts only where it finds a match), a the rate
    over those and c the cost averaged over all: 1 + f (E - 1) tokens per
    sequence-step."""
    e = (1.0 - a ** (k + 1)) / (1.0 - a) if a < 1 else k + 1.0
    return (1.0 + draft_fraction * (e - 1.0)) / (1.0 + k * c)


PLAIN, SYNC = "plain", "sync"  # k = 0 steps: the drafter idle / its forward keeping its KV in sync


def step_kind(k: int, drafter_idle: bool) -> str:
    """The ``StepCost`` curve a decode step with k drafts per sequence
    belongs to: ``plain`` or ``sync`` at k = 0, else k as a string."""
    return str(k) if k > 0 else (PLAIN if drafter_idle else SYNC)


@dataclass
class StepCost:
    """t(b, k): seconds of one engine decode step at b sequences in flight
    with k drafts each, as measured on the replica's own rollouts
    (``StepTimes.cost``).

    Attributes:
        k: the largest k (the engine's num_speculative_tokens).
        curves: {kind: [[b, seconds], ...] ascending in b}; kind ``plain``
            (k = 0, drafter idle), ``sync`` (k = 0, the drafter's forward
            keeping its KV in sync, as it runs wherever the schedule drafts
            at some batch size) or k as a string (``"1"`` .. ``"K"``).
            Between two points t is linear in log b; outside them it
            keeps its nearest point's ratio to a plain step (a plain step
            below its first point costs that point's seconds, past its
            last it grows per sequence). On a CPU a draft's cost ratio
            grows with the batch, so a drafting kind carried past its
            last point looks cheaper than it is (``reach`` bounds where
            the controller drafts on that), and below its first point
            dearer.
    """

    k: int
    curves: dict[str, list[list[float]]] = field(default_factory=dict)

    def _at(self, kind: str, b: int) -> float:
        pts = self.curves[kind]
        if b <= pts[0][0] or b >= pts[-1][0]:  # outside what was measured: its nearest point's ratio to plain
            near, t_near = pts[0] if b <= pts[0][0] else pts[-1]
            if kind != PLAIN and self.curves.get(PLAIN):
                return t_near * self._at(PLAIN, b) / self._at(PLAIN, near)
            return t_near if b <= near else t_near * b / near
        j = bisect.bisect_left([x for x, _ in pts], b)
        (b0, t0), (b1, t1) = pts[j - 1], pts[j]
        return t0 + (t1 - t0) * math.log(b / b0) / math.log(b1 / b0)

    def _drafted(self) -> list[int]:
        return sorted(int(kind) for kind, pts in self.curves.items() if kind.isdigit() and pts)

    def known(self, k: int) -> bool:
        """Whether t(b, k) rests on measurements (``seconds``): k = 0 on
        plain steps; k > 0 on steps of k drafts, or on plain steps and steps
        of some other k to interpolate or extrapolate from."""
        plain = bool(self.curves.get(PLAIN))
        drafted = self._drafted()
        return plain if k == 0 else k in drafted or (plain and bool(drafted))

    def _rests_on(self, k: int) -> tuple[int, int | None]:
        """(lo, hi): the measured drafting kinds t(b, k) is interpolated
        between (lo 0: the plain step), or extrapolated from (hi None)."""
        drafted = self._drafted()
        if k in drafted:
            return k, k
        return max((m for m in drafted if m < k), default=0), min((m for m in drafted if m > k), default=None)

    def reach(self, k: int) -> float:
        """The largest batch size where t(b, k) is close enough to a
        measurement to draft on: twice the largest batch size its drafting
        kinds were measured at (``_rests_on``); unbounded for k = 0.

        Past the batch sizes measured t(b, k) keeps its ratio to a plain
        step, which on a CPU understates a large batch's (the ratio grows
        with the batch: a fresh run drafted at 4-64 sequences on a ratio
        from 1-8 of 1.06x, and paid 2.8x at 29); within twice them, a
        schedule drafts one bucket past what was measured, its rollout
        measures that, and drafting reaches large batches bucket by bucket
        where it pays there (a GPU's), or stops where it does not."""
        if k == 0:
            return math.inf
        return 2 * min(self.curves[str(m)][-1][0] for m in self._rests_on(k) if m)

    def seconds(self, b: int, k: int) -> float:
        """t(b, k). k = 0: a plain step. k > 0: as measured, else linear in k between the nearest
        measured k below (0: t(b, 0)) and above, or past the largest
        measured one on the line from t(b, 0) through it. The first draft
        costs more than the next ones (it brings the rejection sampler into
        the step: measured on 2 CPU cores at 16 sequences, k = 1 +33% over
        plain, k = 8 +54%, ``jobs.bench_step``), which the line from t(b, 0)
        misses until a 1-draft step is measured.

        Raises:
            KeyError: t(b, k) rests on nothing measured (``known``).
        """
        if k == 0:
            return self._at(PLAIN, b)
        lo, hi = self._rests_on(k)
        if lo == k:
            return self._at(str(k), b)
        t0 = self.seconds(b, 0)
        t_lo = self._at(str(lo), b) if lo else t0
        if hi is not None:
            return t_lo + (self._at(str(hi), b) - t_lo) * (k - lo) / (hi - lo)
        if not lo:
            raise KeyError(f"no step with drafts measured (k = {k})")
        return t0 + (t_lo - t0) * k / lo

    def sync_seconds(self, b: int) -> float:
        """t(b, 0) with the drafter kept in sync, never below t(b, 0): the
        step runs the plain step's target forward and the drafter's forward
        besides, so a sync step timed faster is noise. Taken as measured, it
        made keeping the drafter in sync look cheaper than idling it: an RL
        run's start-up calibration put it at 0.104 s against 0.113 s plain
        at 16 sequences, and the shape rule kept a schedule drafting at 1-3
        sequences, in rollouts whose 16 sequences mostly ran to the token
        limit together, for a predicted 8% it did not get; its rollouts ran
        0.85x of plain decoding's (2026-11). Before a sync step is measured: t(b, 0) plus half of
        the smallest measured m-draft step's extra cost per draft (the
        drafter's forward without the verification), (t(b, m) - t(b, 0)) / 2m."""
        plain = self.seconds(b, 0)
        if self.curves.get(SYNC):
            return max(self._at(SYNC, b), plain)
        drafted = self._drafted()
        return plain + max(0.0, self._at(str(drafted[0]), b) - plain) / (2 * drafted[0]) if drafted else plain

    def cost_ratio(self, b: int) -> float:
        """c(b): extra cost of one draft token (drafting it and verifying it)
        in plain steps, (t(b, K) / t(b, 0) - 1) / K."""
        return (self.seconds(b, self.k) / self.seconds(b, 0) - 1.0) / self.k


class StepTimes:
    """The engine's decode steps as the replica's rollouts ran them: each
    step's seconds by kind (``step_kind``) and batch size, kept per kind and
    power-of-two bucket of batch sizes (1, 2-3, 4-7, ...), the ``window``
    most recent in each; ``cost`` summarises them as a ``StepCost`` (per
    bucket, the medians of its batch sizes and seconds).

    One rollout of 32 sequences of up to 48 tokens runs about 48 decode
    steps over every batch size from 32 down to 1, so a kind a rollout used
    is measured at every batch size it passed through; the medians take out
    single slow steps (a 2-core host also runs the trainer's and Ray's
    threads).

    Args:
        k: the largest k.
        window: steps kept per kind and bucket.
        prior: step costs to start from (``StepCost``, e.g. an earlier run's
            on this machine), one step per point, replaced as the window fills.
    """

    def __init__(self, k: int, window: int = 64, prior: StepCost | None = None):
        self.k, self.window = k, window
        self._steps: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for kind, pts in (prior.curves if prior else {}).items():
            for b, s in pts:
                self.add(kind, max(1, round(b)), s)

    def add(self, kind: str, b: int, seconds: float) -> None:
        """One decode step of ``kind`` at b sequences took ``seconds``."""
        steps = self._steps.setdefault((kind, b.bit_length()), [])
        steps.append((b, seconds))
        del steps[:-self.window]

    def steps(self) -> list[tuple[str, int, float]]:
        """The steps kept: [(kind, b, seconds)]."""
        return [(kind, b, t) for (kind, _), steps in self._steps.items() for b, t in steps]

    def __len__(self) -> int:
        return sum(len(v) for v in self._steps.values())

    def cost(self) -> StepCost:
        """The ``StepCost`` of the steps kept."""
        curves: dict[str, list[list[float]]] = {}
        for (kind, _), steps in sorted(self._steps.items()):
            curves.setdefault(kind, []).append([statistics.median(b for b, _ in steps),
                                                statistics.median(s for _, s in steps)])
        return StepCost(self.k, curves)


@dataclass
class AdaptiveK:
    """Chooses k per batch size; see the module docstring.

    Args:
        k_max: the engine's num_speculative_tokens (k never exceeds it).
        max_num_seqs: the engine's largest batch.
        cost: measured step costs (``StepTimes.cost``; the engine replaces
            it after every rollout; empty: nothing measured yet).
        margin: a speculative k is chosen only if its predicted throughput is
            at least ``margin`` times plain decoding's (1.0: any gain).
        ema: weight of the newest rollout in the acceptance rates (and the
            calibration), for a rollout of at least ``min_drafts`` drafts.
        min_drafts: a rollout of n < min_drafts drafts weighs
            ema * n / min_drafts: the one draft that a schedule drafting only
            at batch size 1 may make does not move the rates halfway to 0
            or 1.
        probe_every: draft refits between probes (1: after every refit).
        probe: the draft changed since the rates were measured (set by
            ``draft_changed`` every ``probe_every`` refits; cleared by the
            next measurement or estimate).
        calibration: per draft position, the running ratio of measured to
            estimated rate (``draft_estimated``; 1.0 where none was measured).
        positions: token positions per batch size in the last rollout
            ({b: n}, ``observe``): how long a rollout stays at each b.
        draft_fraction: f, the share of sequence-steps that carry a draft
            where k > 0: 1 for a model drafter (it drafts at every step);
            measured for a ``match_drafter`` (``update``'s
            ``sequence_steps``). A step then emits 1 + f (E(k) - 1) tokens
            per sequence; its measured cost t(b, k) is that of the drafts
            the matches made.
        match_drafter: the drafter drafts only where its match does
            (``MATCH_DRAFTERS``: n-gram, suffix), from the policy's own text:
            f is measured, and a policy refit counts as a draft refit.
        share_scale: per bucket j of the rollout's share in flight (b / n
            in (2^-(j+1), 2^-j], n the last rollout's sequences), per
            position, the estimated rate there over the estimate's overall
            rate (``draft_estimated``'s ``by_share``; empty: 1 everywhere).
            ``rates`` are overall rates; at batch size b the controller
            drafts by ``rates_at(b)``.
        sequences: sequences of the last rollout (``observe``; 0: none yet).
        reason: a few words on why the last ``schedule`` drafts what it does
            (the step line's; ``explain``).
    """

    k_max: int
    max_num_seqs: int
    cost: StepCost | None = None
    margin: float = 1.05
    ema: float = 0.5
    min_drafts: int = 16
    probe_every: int = 1
    rates: list[float] = field(default_factory=list)
    probe: bool = False
    positions: dict[int, int] = field(default_factory=dict)
    calibration: list[float] = field(default_factory=list)
    draft_fraction: float = 1.0
    match_drafter: bool = False
    share_scale: dict[int, list[float]] = field(default_factory=dict)
    sequences: int = 0
    reason: str = ""
    _refits: int = field(default=0, init=False, repr=False)  # since the last probe
    _estimate: list[float] | None = field(default=None, init=False, repr=False)  # not yet measured

    def __post_init__(self):
        if self.cost is None:
            self.cost = StepCost(self.k_max)

    def draft_changed(self) -> None:
        """A draft refit: probe again every ``probe_every`` of them."""
        self._refits += 1
        if self._refits >= self.probe_every:
            self._refits = 0
            self.probe = True

    def draft_estimated(self, rates: list[float], by_share: list | None = None) -> None:
        """The current draft's per-position acceptance rates as the
        DraftTrainer estimated them (``rayspec.draft.loss.replay_drafting``):
        they become the controller's rates, scaled by ``calibration`` and
        extrapolated to k_max, until a rollout measures the draft; no probe
        is needed for it.

        ``by_share``: the same replay by share of the rollout in flight
        (``rayspec.draft.loss.acceptance_by_share``: [(share, drafts,
        rates)]); it sets ``share_scale``, so the tail of a rollout drafts
        by the tail's rates. None or empty: one rate for every batch size."""
        est = extrapolate_rates(list(rates), self.k_max)[:self.k_max]
        cal = self.calibration + [1.0] * (len(est) - len(self.calibration))
        self._estimate = est
        self.rates = [min(r * c, 1.0) for r, c in zip(est, cal)]
        self.share_scale = {}
        for share, _, bucket in by_share or []:
            ext = extrapolate_rates(list(bucket), self.k_max)[:self.k_max]
            self.share_scale[round(-math.log2(share))] = [x / e if e > 0 else 1.0 for x, e in zip(ext, est)]
        self.probe, self._refits = False, 0

    def _scale(self, b: int) -> list[float] | None:
        """``share_scale`` at batch size b: the bucket of b / n, or the
        nearest one towards the full batch that the estimate had drafts in
        (None: no buckets)."""
        if not self.share_scale:
            return None
        n = self.sequences or self.max_num_seqs
        j = int(math.log2(n / b)) if b < n else 0
        have = sorted(self.share_scale)
        return self.share_scale[max((x for x in have if x <= j), default=have[0])]

    def rates_at(self, b: int) -> list[float]:
        """Per-position acceptance rates at batch size b: ``rates`` x
        ``share_scale`` of b's share of the rollout (at most 1)."""
        scale = self._scale(b)
        return [min(r * x, 1.0) for r, x in zip(self.rates, scale)] if scale else self.rates

    def observe(self, response_lens: list[int]) -> None:
        """Record how many token positions the last rollout spent at each
        batch size: its sequences start together (up to max_num_seqs) and
        leave at their lengths (tokens), so positions L_(i-1)..L_(i) of the
        ascending lengths run with n - i + 1 sequences in flight."""
        lens = sorted(response_lens)
        n, prev, out = len(lens), 0, {}
        self.sequences = n
        for i, length in enumerate(lens):
            if length > prev:
                b = min(n - i, self.max_num_seqs)
                out[b] = out.get(b, 0) + length - prev
                prev = length
        self.positions = out

    def drafted_tokens(self, schedule: list[tuple[int, int, int]]) -> int:
        """Tokens the last rollout (``observe``) generated at the batch sizes
        where ``schedule`` drafts: sum of b x positions(b) over them."""
        return sum(self._drafted_weights(schedule).values())

    def rates_where(self, schedule: list[tuple[int, int, int]]) -> list[float]:
        """Per-position rates over the batch sizes where ``schedule`` drafts
        in the last rollout's shape (``observe``), weighted by their tokens:
        what a rollout drafting by it should measure (``rates`` where
        there is no ``share_scale``)."""
        return [min(r * x, 1.0) for r, x in zip(self.rates, self._drafted_scale(schedule))]

    def _drafted_weights(self, schedule: list[tuple[int, int, int]]) -> dict[int, int]:
        """{b: b x positions(b)} at the batch sizes where ``schedule`` drafts."""
        ks = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
        return {b: b * n for b, n in self.positions.items() if ks.get(b, 0) > 0}

    def _drafted_scale(self, schedule: list | None) -> list[float]:
        """Per position, ``share_scale`` over the batch sizes where
        ``schedule`` drafted in the last rollout, weighted by their tokens
        (1 without buckets or a schedule)."""
        weights = self._drafted_weights(schedule) if self.share_scale and schedule else {}
        total = sum(weights.values())
        if not total:
            return [1.0] * self.k_max
        scaled = [[w * x for x in self._scale(b)] for b, w in weights.items()]
        return [sum(col) / total for col in zip(*scaled)]

    def rollout_seconds(self, schedule: list[tuple[int, int, int]]) -> float:
        """Predicted seconds of the last rollout's shape under ``schedule``:
        sum over b of positions(b) / (1 + f (E(k_b) - 1)) * t(b, k_b), a
        k = 0 step costing t_sync(b) unless k is 0 at every batch size (f:
        ``draft_fraction``)."""
        ks = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
        idle = drafts_nowhere(schedule)
        total = 0.0
        for b, n in self.positions.items():
            k = ks.get(b, 0)
            step = self.cost.seconds(b, k) if k or idle else self.cost.sync_seconds(b)
            total += n / self._tokens(b, k) * step
        return total

    def _tokens(self, b: int, k: int) -> float:
        """Tokens per sequence-step at b sequences and k: 1 + f (E_b(k) - 1)."""
        return 1.0 + self.draft_fraction * (expected_tokens(self.rates_at(b), k) - 1.0)

    def update(self, accepted_per_pos: list[int], num_drafts: int, positions: int,
               sequence_steps: int | None = None, schedule: list | None = None) -> None:
        """Fold one rollout's counters into the per-position rates.

        Args:
            accepted_per_pos: accepted tokens per draft position.
            num_drafts: verification steps that carried a draft.
            positions: how many leading positions every draft covered (the
                smallest non-zero k of the schedule used): a step with fewer
                drafts does not reach the later positions, so their counts
                over ``num_drafts`` would be biased low; they keep their rate.
            sequence_steps: sequence-steps at the batch sizes that drafted:
                num_drafts / sequence_steps updates ``draft_fraction`` of a
                ``match_drafter`` (a model drafter's f stays 1).
            schedule: the rollout's schedule: with ``share_scale``, the
                counters are rates where it drafted, so they are compared
                with the estimate there and divided by the scale there
                before they update the overall ``rates``. None: as overall.
        """
        if num_drafts <= 0 or positions <= 0:
            return
        scale = self._drafted_scale(schedule)
        new = [a / num_drafts for a in accepted_per_pos[:positions]]
        w = self.ema * min(1.0, num_drafts / self.min_drafts)
        if self.match_drafter and sequence_steps:  # the first measurement replaces f's prior of 1, as for the rates
            f = min(num_drafts / sequence_steps, 1.0)
            self.draft_fraction = (1 - self.ema) * self.draft_fraction + self.ema * f if self.rates else f
        self.probe = False
        if self._estimate is not None:  # the first measurement of an estimated draft
            self.calibration += [1.0] * (len(new) - len(self.calibration))
            for i, r in enumerate(new):
                if self._estimate[i] * scale[i] > 0:  # a ratio far off is noise from a few drafts: capped
                    ratio = min(r / (self._estimate[i] * scale[i]), 2.0)
                    self.calibration[i] = (1 - w) * self.calibration[i] + w * ratio
            self._estimate = None
        new = [min(r / x, 1.0) if x > 0 else r for r, x in zip(new, scale)]  # the overall rates
        if not self.rates:  # positions not yet measured: extrapolate geometrically
            self.rates = extrapolate_rates(new, self.k_max)
            return
        for i, r in enumerate(new):
            self.rates[i] = (1 - w) * self.rates[i] + w * r

    def best_k(self, b: int) -> int:
        """argmax_k b * (1 + f (E(k) - 1)) / t(b, k) over the k whose cost
        reaches b (``StepCost.reach``), k = 0 unless it beats plain decoding
        by ``margin``."""
        plain = 1.0 / self.cost.seconds(b, 0)
        best, best_tp = 0, plain * self.margin
        for k in range(1, self.k_max + 1):
            if b > self.cost.reach(k):
                continue
            tp = self._tokens(b, k) / self.cost.seconds(b, k)
            if tp > best_tp:
                best, best_tp = k, tp
        return best

    def schedule(self) -> list[tuple[int, int, int]]:
        """[(lo, hi, k)] covering 1..max_num_seqs, adjacent equal k merged;
        ``reason`` says why (``explain``).

        Until it is measured, what a choice needs is measured first: with no
        acceptance rates, or no step of k_max drafts timed, k_max in the
        rollout's tail, up to ``MEASURE_TAIL`` sequences in flight, where a
        draft costs least (the rollout measures both, and sync steps above
        it; where the last rollout had no tail, its sequences all running
        to the end together, at every batch size); then, with no plain step
        timed, k = 0 everywhere. A schedule that drafts somewhere keeps the
        drafter in sync at the batch sizes where it does not; it is kept
        only if the last rollout's shape (``observe``) would run ``margin``
        faster with it than with k = 0 everywhere."""
        zero = uniform(0, self.max_num_seqs)
        if not self.rates or not self.cost.known(self.k_max):
            tail = min(MEASURE_TAIL, self.max_num_seqs)
            if self.positions and min(self.positions) > tail:  # the last rollout had no tail: where it ran
                tail = self.max_num_seqs
            self.reason = (f"k {self.k_max} at 1-{tail} seqs: measuring "
                           + ("the draft's acceptance" if not self.rates else f"a {self.k_max}-draft step's cost"))
            return merge_schedule([self.k_max] * tail + [0] * (self.max_num_seqs - tail))
        if not self.cost.known(0):
            self.reason = "k 0: measuring a plain step's cost"
            return zero
        per_b = merge_schedule([self.best_k(b) for b in range(1, self.max_num_seqs + 1)])
        out = per_b
        if (self.positions and out != zero
                and self.rollout_seconds(out) * self.margin > self.rollout_seconds(zero)):
            out = zero
        self.reason = self.explain(out, vetoed=out != per_b)
        if self.probe and out == zero:
            out = [(1, 1, self.k_max)] + ([(2, self.max_num_seqs, 0)] if self.max_num_seqs > 1 else [])
            self.reason = f"k {self.k_max} at 1 seq: probing the new draft; " + self.reason
        return out

    def explain(self, schedule: list[tuple[int, int, int]], vetoed: bool = False) -> str:
        """Why ``schedule`` drafts what it does, in a few words: for the
        batch sizes where it drafts (or, where it drafts nowhere, one
        sequence in flight, where a draft token costs least), the tokens a
        step emits against what the step costs in plain steps, t(b, k) /
        t(b, 0), times ``margin`` (a k is chosen where tokens > that).
        ``vetoed``: per batch size some k paid, but over the last rollout's
        shape the drafter's sync forward would cost more than it saves.
        E.g. ``k 0: at 1 seq a 3-draft step costs 1.41x plain; draft 1.20 tok/step < 1.48``."""
        drafting = [r for r in schedule if r[2] > 0]
        if vetoed:
            return "k 0: drafting in the tail would save less than the drafter's sync costs over the rollout"
        if not drafting:
            ks = range(1, self.k_max + 1)
            k = max(ks, key=lambda k: self._tokens(1, k) / self.cost.seconds(1, k))
            lo = hi = 1
        else:
            lo, hi, k = max(drafting, key=lambda r: r[1] - r[0])
        ratio = self.cost.seconds(hi, k) / self.cost.seconds(hi, 0)
        tokens = self._tokens(hi, k)
        where = f"{lo} seq" if lo == hi == 1 else f"{lo}-{hi} seqs" if lo != hi else f"{lo} seqs"
        cmp = "<" if not drafting else ">"
        head = f"k 0: at {where} a {k}-draft step" if not drafting else f"k {k} at {where}: a step"
        return f"{head} costs {ratio:.2f}x plain; draft {tokens:.2f} tok/step {cmp} {ratio * self.margin:.2f}"


def merge_schedule(ks: list[int]) -> list[tuple[int, int, int]]:
    """The schedule [(lo, hi, k)] of k per batch size ``ks[b - 1]`` for
    b = 1..len(ks), adjacent equal k merged."""
    out: list[list[int]] = []
    for b, k in enumerate(ks, start=1):
        if out and out[-1][2] == k:
            out[-1][1] = b
        else:
            out.append([b, b, k])
    return [tuple(r) for r in out]


def format_schedule(schedule: list[tuple[int, int, int]]) -> str:
    """``1-6:3 7-64:0``: k per inclusive batch-size range."""
    return " ".join(f"{lo}-{hi}:{k}" if lo != hi else f"{lo}:{k}" for lo, hi, k in schedule)


def parse_schedule(text: str) -> list[tuple[int, int, int]]:
    """The inverse of ``format_schedule``: ``1-6:3 7-64:0`` -> [(1, 6, 3), (7, 64, 0)]."""
    out = []
    for part in text.split():
        rng, k = part.split(":")
        lo, _, hi = rng.partition("-")
        out.append((int(lo), int(hi or lo), int(k)))
    return out
