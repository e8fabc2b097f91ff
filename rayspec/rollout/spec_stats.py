"""Speculative-decoding statistics from vLLM's own per-request metrics, the watch over them, and what a
rollout reads of a vLLM completion (its sampled logprobs and weight versions)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters over one or more ``generate`` calls.

    Attributes:
        num_drafts: verification steps that carried a draft.
        num_draft_tokens: draft tokens proposed (tokens).
        num_accepted_tokens: draft tokens accepted (tokens).
        accepted_per_pos: accepted tokens per draft position, length k.
        output_tokens: generated tokens (tokens).
        wall_s: wall-clock seconds of the calls.
        replicas: per Serve replica id, that replica's own SpecStats (a sum
            of stats keeps every replica's entry, summed per replica).
        k_schedule: the [(lo, hi, k)] batch-size schedule the engine drafted
            with (adaptive speculation); empty when k was fixed.
        k_reason: why the adaptive controller chose that schedule, in a few
            words (``AdaptiveK.reason``); empty when k was fixed.
        draft_stale_repairs: times a replica found the draft weights it
            held were not those of its last refit (lost in a sleep / wake
            or a refit) and loaded them again before generating.
        node: a replica's Ray node (the id's first 8 hex digits, as the
            placement plan prints it); empty outside Ray and in sums.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    output_tokens: int = 0
    wall_s: float = 0.0
    replicas: dict[str, "SpecStats"] = field(default_factory=dict)
    k_schedule: list = field(default_factory=list)
    draft_stale_repairs: int = 0
    k_reason: str = ""
    node: str = ""

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """P(draft position i accepted) = accepted_i / drafts."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def drafted_share(self) -> float:
        """Share of the generated tokens that verification steps carrying a
        draft emitted ((drafts + accepted) / output tokens; 0.0 without output)."""
        return min(1.0, (self.num_drafts + self.num_accepted_tokens) / self.output_tokens) \
            if self.output_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        """Acceptance length, per-position rates, tokens and tokens/s of these counters."""
        out = {"acceptance_length": self.acceptance_length,
               "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
               "output_tokens": self.output_tokens, "tokens_per_s": self.tokens_per_s}
        if self.k_schedule:
            out["k_schedule"] = [list(r) for r in self.k_schedule]
            out["k_reason"] = self.k_reason
        if self.node:
            out["node"] = self.node
        return out

    def then(self, other: "SpecStats") -> "SpecStats":
        """The counters of ``other`` run after these (not beside them): wall seconds add up."""
        out = self + other
        out.wall_s = self.wall_s + other.wall_s
        for k in set(self.replicas) & set(other.replicas):
            out.replicas[k] = self.replicas[k].then(other.replicas[k])
        return out

    def __add__(self, other: "SpecStats") -> "SpecStats":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return SpecStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            self.output_tokens + other.output_tokens,
            # replicas run concurrently: the slowest one bounds the wall time
            max(self.wall_s, other.wall_s),
            {k: self.replicas[k] + other.replicas[k] if k in self.replicas and k in other.replicas
             else self.replicas.get(k) or other.replicas[k]
             for k in {**self.replicas, **other.replicas}},
            self.k_schedule or other.k_schedule,
            self.draft_stale_repairs + other.draft_stale_repairs,
            self.k_reason or other.k_reason,
            self.node if self.node == other.node else "",  # one replica's entries summed keep its node
        )


def sampled_logprobs(c) -> list[float]:
    """A vLLM ``CompletionOutput``'s logprob of each token it sampled (built with ``logprobs=0``)."""
    return [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def weight_spans(c, offset: int = 0) -> list[tuple[int, int, int]]:
    """A vLLM ``CompletionOutput``'s [(policy version, start, end)] token spans
    (``CompletionOutput.weight_versions``), moved by ``offset`` tokens."""
    return [(int(w.version), offset + w.start, offset + w.end) for w in c.weight_versions or ()]


def completion_stats(outputs, wall_s: float = 0.0) -> SpecStats:
    """SpecStats of finished requests from their own speculative-decoding
    metrics (vLLM 0.32's per-sequence ``CompletionOutput.spec_decode_metrics``,
    kept by an engine built with ``per_request_spec_decode_metrics="summary"``):
    exact whatever else the engine batched beside them, where vLLM's
    engine-wide counters are not.

    Each sequence's ``histogram[j]`` counts its verification steps that
    carried a draft and accepted ``j`` draft tokens, so drafts = sum(h),
    accepted = sum(j * h[j]), and position i accepted = sum(h[j] for j > i):
    the same counts as vLLM's Prometheus counters (``vllm:spec_decode_*``),
    which the scheduler updates at the same place.

    Args:
        outputs: ``RequestOutput``s (each with one or more completions).
        wall_s: the call's wall-clock seconds.

    Returns:
        SpecStats with ``output_tokens`` the completions' tokens; no
        draft counts where the engine kept no metrics (plain decoding).
    """
    out = SpecStats(wall_s=wall_s)
    for request in outputs:
        for c in request.outputs:
            out.output_tokens += len(c.token_ids)
            m = c.spec_decode_metrics
            if m is None:
                continue
            h = list(m.histogram)
            per_pos = [sum(h[i + 1:]) for i in range(len(h) - 1)]
            out.num_drafts += sum(h)
            out.num_draft_tokens += m.num_draft_tokens
            out.num_accepted_tokens += sum(j * n for j, n in enumerate(h))
            acc = out.accepted_per_pos + [0] * (len(per_pos) - len(out.accepted_per_pos))
            out.accepted_per_pos = [a + b for a, b in zip(acc, per_pos + [0] * (len(acc) - len(per_pos)))]
    return out


class AcceptanceWatch:
    """Finds an acceptance collapse on a replica: its position-1 acceptance
    rate below ``fraction`` of the median over its last ``window`` steps,
    for ``patience`` steps in a row, while the draft head it drafted with
    did not change. That is the sign of draft weights lost on the replica
    (a wake or a refit that left it a different head), which a new head
    would not explain. Replicas that drafted nothing in a step are skipped.

    Args:
        fraction: the collapse threshold, as a fraction of the median.
        window: steps of each replica's history the median covers.
        patience: consecutive collapsed steps before it is reported.
    """

    def __init__(self, fraction: float = 0.5, window: int = 5, patience: int = 2):
        self.fraction, self.window, self.patience = fraction, window, patience
        self._history: dict[str, list[float]] = {}  # replica -> position-1 rates of steps before
        self._low: dict[str, int] = {}  # replica -> consecutive collapsed steps, same head
        self._head: dict[str, int] = {}  # replica -> the draft version of its last step

    def observe(self, stats: SpecStats, draft_version: int) -> list[dict]:
        """Look at one step's rollout.

        Args:
            stats: the step's SpecStats (``replicas``: per replica).
            draft_version: the draft head's version the rollout drafted with.

        Returns:
            One entry per replica that collapsed this step: {"replica",
            "rate" (position 1), "median" (of its window), "steps"}.
        """
        found = []
        for rid, s in sorted(stats.replicas.items()):
            if not s.num_drafts or not s.accepted_per_pos:
                continue
            rate = s.acceptance_rate_per_pos[0]
            past = self._history.setdefault(rid, [])
            if self._head.get(rid, draft_version) != draft_version:
                self._low[rid] = 0  # a new head: its rate may move for that reason
            self._head[rid] = draft_version
            median = sorted(past)[len(past) // 2] if past else None
            if median is not None and len(past) >= self.patience and rate < self.fraction * median:
                self._low[rid] = self._low.get(rid, 0) + 1
                if self._low[rid] >= self.patience:
                    found.append({"replica": rid, "rate": rate, "median": median, "steps": self._low[rid]})
                continue  # collapsed steps stay out of the median
            self._low[rid] = 0
            past.append(rate)
            del past[:-self.window]
        return found
