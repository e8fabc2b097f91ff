"""One RL step: rollout (simulated), logprob recomputation, policy update and
weight sync, in sync or async mode, and the workload that drives it.

    train_s   = 6 N_active T / (peak * MFU * train devices)     (Kaplan et al. 2020, Sec. 2.1)
    logprob_s = 2 N_active T / (peak * MFU * train devices)     (one forward of the step's T tokens)
    sync_s    = one refit through the weight transport         (perfmodel.weight_sync)

    sync:  step = rollout + logprob + train + sync      (colocated: all devices take turns)
    async: step = max(rollout, logprob + train) + sync  (split devices, policy lag >= 1)

With policy lag 1 each rollout still drains into its tail (the generator may
start batch n+1 only when batch n's weights arrive). With lag >= 2 the
generator always has the next batch queued, so freed slots refill and the
tail is paid once per ``policy_lag`` steps: the rollout of ``policy_lag``
batches back to back, divided by ``policy_lag``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayspec.perfmodel.simulate import Engine, SimulatedRollout, simulate_rollout
from rayspec.perfmodel.weight_sync import TRANSPORTS, sync_time


def capped_exponential_lengths(n: int, mean: float, cap: int, seed: int = 0) -> list[int]:
    """``n`` response lengths (tokens): exponential, truncated at ``cap``
    (those longer hit the cap, as responses cut at max_new_tokens), with the
    scale chosen so the truncated mean is ``mean``: E[min(X, cap)] =
    s (1 - exp(-cap / s)).

    Raises:
        ValueError: ``mean`` not in (0, cap).
    """
    if not 0 < mean < cap:
        raise ValueError(f"mean response length {mean}: must be in (0, cap={cap})")
    lo, hi = 1e-6, cap * 1e3
    for _ in range(200):  # bisection on s: the truncated mean grows with s
        s = (lo + hi) / 2
        lo, hi = (s, hi) if s * (1 - math.exp(-cap / s)) < mean else (lo, s)
    x = np.random.default_rng(seed).exponential(s, size=n)
    return [int(v) for v in np.clip(np.ceil(x), 1, cap)]


@dataclass
class Workload:
    """What one RL step generates and trains on.

    Attributes:
        lengths: response length per sequence of one step (tokens);
            prompts_per_step * group_size of them.
        prompt_len: prompt tokens per sequence.
        rates: acceptance rate per draft position (P(position i accepted)).
        source: where it came from.
    """

    lengths: list[int]
    prompt_len: float
    rates: list[float]
    source: str = ""

    @property
    def tokens(self) -> float:
        """Tokens the trainer processes per step (prompt + response)."""
        return len(self.lengths) * self.prompt_len + sum(self.lengths)

    @classmethod
    def from_run(cls, run_dir: str | Path, prompt_len: float | None = None, seed: int = 0) -> Workload:
        """Read a rayspec run directory: ``config.yaml`` (sequences per
        step, max_new_tokens) and ``metrics.jsonl``: the response lengths of
        the step with the most (``response_lens``; older runs log only
        ``response_len_mean``, then capped-exponential lengths with the
        run's mean response length), ``prompt_len_mean`` (else
        ``prompt_len``), acceptance rates per position (drafts-weighted
        mean over steps).

        Raises:
            ValueError: a missing or empty file (named), or no prompt length.
        """
        from omegaconf import OmegaConf

        run = Path(run_dir)
        for f in ("config.yaml", "metrics.jsonl"):
            if not (run / f).is_file():
                raise ValueError(f"{run / f}: missing (not a rayspec run directory)")
        cfg = OmegaConf.load(run / "config.yaml")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        if not records:
            raise ValueError(f"{run / 'metrics.jsonl'}: no steps")
        seqs = cfg.data.prompts_per_step * cfg.grpo.group_size
        with_lens = [r["response_lens"] for r in records if r.get("response_lens")]
        if with_lens:
            lengths = max(with_lens, key=sum)
        else:
            mean = sum(r["response_len_mean"] for r in records) / len(records)
            lengths = capped_exponential_lengths(seqs, min(mean, cfg.grpo.max_new_tokens - 0.5),
                                                 cfg.grpo.max_new_tokens, seed)
        prompts = [r["prompt_len_mean"] for r in records if "prompt_len_mean" in r]
        if prompts:
            prompt_len = sum(prompts) / len(prompts)
        if prompt_len is None:
            raise ValueError(f"{run / 'metrics.jsonl'}: no prompt_len_mean; give the prompt length")
        drafts = sum(r.get("num_drafts", 0) for r in records)
        k = max((len(r.get("acceptance_rate_per_pos", [])) for r in records), default=0)
        rates = [sum(r["acceptance_rate_per_pos"][i] * r.get("num_drafts", 0) for r in records
                     if len(r.get("acceptance_rate_per_pos", [])) > i) / drafts if drafts else 0.0
                 for i in range(k)]
        return cls(lengths=list(lengths), prompt_len=float(prompt_len), rates=rates, source=str(run))


def geometric_rates(acceptance_length: float, k: int, k_max: int) -> list[float]:
    """Per-position rates r_i = a^i (i = 1..k_max) of an i.i.d. acceptance
    rate a (Leviathan et al. 2023, Sec. 3.1) whose acceptance length at
    ``k`` drafts, 1 + a + ... + a^k, equals ``acceptance_length``.

    Raises:
        ValueError: ``acceptance_length`` not in [1, k + 1).
    """
    a = band_rates({k: acceptance_length})[0]  # one band from r_0 = 1: r_i = a^i
    return [a ** i for i in range(1, k_max + 1)]


def band_rates(acceptance_lengths: dict[int, float]) -> list[float]:
    """Per-position rates r_1..r_K from acceptance lengths measured at
    several k (a chain draft proposes the same tokens whatever k is, so the
    rates of positions <= k do not depend on k): each band (k_prev, k] sums
    to AL(k) - AL(k_prev), and within a band the rate falls by a constant
    factor c from the band's start, r_i = r_{k_prev} c^(i - k_prev) (the
    i.i.d. shape of Leviathan et al. 2023, Sec. 3.1, band by band; r_0 = 1).

    Args:
        acceptance_lengths: {k: acceptance length at k}, AL(0) = 1 implied.

    Returns:
        [r_1, ..., r_K], K the largest k, non-increasing.

    Raises:
        ValueError: a band whose sum is not in [0, (k - k_prev) r_{k_prev})
            (named), i.e. lengths that fall with k or grow faster than full
            acceptance.
    """
    rates: list[float] = []
    k_prev, al_prev, r_prev = 0, 1.0, 1.0
    for k, al in sorted(acceptance_lengths.items()):
        n, band = k - k_prev, al - al_prev
        if n < 1 or not 0.0 <= band < n * r_prev:
            raise ValueError(f"acceptance length {al} at k={k}: the band ({k_prev}, {k}] would sum to "
                             f"{band:.3f}, must be in [0, {n * r_prev:.3f})")
        lo, hi = 0.0, 1.0
        for _ in range(100):  # bisection on c: the band's sum grows with c
            c = (lo + hi) / 2
            lo, hi = (c, hi) if r_prev * sum(c ** i for i in range(1, n + 1)) < band else (lo, c)
        rates += [r_prev * c ** i for i in range(1, n + 1)]
        k_prev, al_prev, r_prev = k, al, rates[-1]
    return rates


@dataclass(frozen=True)
class Pipeline:
    """How the RL step is laid out.

    Attributes:
        mode: ``sync`` (rollout, then training, on the same devices) or
            ``async`` (rollout devices and training devices overlap).
        train_devices: devices of the policy update (sync/colocated: all).
        policy_lag: policy updates between the sampling weights and the
            trained ones (0 in sync mode).
        weight_sync: the weight transport, ``collective`` | ``object_store``.
        nodes: nodes the trainer's rank 0 and the replicas span.
    """

    mode: str = "sync"
    train_devices: int = 1
    policy_lag: int = 0
    weight_sync: str = "collective"
    nodes: int = 1

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"pipeline mode {self.mode!r}: must be sync or async")
        if self.mode == "async" and self.policy_lag < 1:
            raise ValueError(f"async pipeline with policy_lag={self.policy_lag}: must be >= 1")
        if self.weight_sync not in TRANSPORTS:
            raise ValueError(f"weight_sync={self.weight_sync!r}: must be one of {TRANSPORTS}")
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes}: must be >= 1")
        if self.train_devices < 1:
            raise ValueError(f"train_devices={self.train_devices}: must be >= 1")


@dataclass
class StepTime:
    """Seconds of one modelled RL step and its parts."""

    rollout: SimulatedRollout
    rollout_s: float
    logprob_s: float
    train_s: float
    sync_s: float
    step_s: float


def simulate_step(engine: Engine, work: Workload, pipe: Pipeline, k_schedule) -> StepTime:
    """Model one RL step (see the module docstring).

    Args:
        engine: the rollout engine (its replicas are the rollout devices).
        work: lengths, prompt length, acceptance rates.
        pipe: sync or async layout.
        k_schedule: fixed k or a batch-size schedule [(lo, hi, k)].
    """
    hw, target = engine.hw, engine.target
    if pipe.mode == "async" and pipe.policy_lag >= 2:
        lengths = [n for i in range(pipe.policy_lag)
                   for n in np.random.default_rng(i).permutation(work.lengths).tolist()]
        ro = simulate_rollout(engine, lengths, work.prompt_len, k_schedule, work.rates)
        rollout_s = ro.seconds / pipe.policy_lag
    else:
        ro = simulate_rollout(engine, work.lengths, work.prompt_len, k_schedule, work.rates)
        rollout_s = ro.seconds
    rate = hw.peak_flops * hw.train_mfu * pipe.train_devices
    train_s = 6.0 * target.active_params * work.tokens / rate
    logprob_s = 2.0 * target.active_params * work.tokens / rate
    sync_s = sync_time(pipe.weight_sync, target.weight_bytes(1e9, hw.dtype_bytes), hw, pipe.nodes, pipe.mode).seconds
    return StepTime(ro, rollout_s, logprob_s, train_s, sync_s, _step_s(pipe, rollout_s, logprob_s, train_s, sync_s))


def _step_s(pipe: Pipeline, rollout_s: float, logprob_s: float, train_s: float, sync_s: float) -> float:
    if pipe.mode == "sync":
        return rollout_s + logprob_s + train_s + sync_s
    return max(rollout_s, logprob_s + train_s) + sync_s


def with_sync(st: StepTime, pipe: Pipeline, sync_s: float) -> StepTime:
    """``st`` with another weight sync's seconds (another transport)."""
    return dataclasses.replace(st, sync_s=sync_s,
                               step_s=_step_s(pipe, st.rollout_s, st.logprob_s, st.train_s, sync_s))
