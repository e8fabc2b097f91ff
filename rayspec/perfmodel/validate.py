"""Validation of the performance model, both directions.

``here``: calibrated on this machine's no-speculation cells only
(``calibrate.fit_plain``), predict every cell of a ``jobs.bench_rollout``
run (tokens/s per method, k and concurrency) and report the error.

``published``: with Qwen3-8B's shape on 32 GB200 and the per-position
acceptance the published EAGLE-3 lengths imply (``band_rates``), calibrate
on the k = 3 figures only (``calibrate_k3``), then predict the k = 5 / 7
generation speedups, the sync and async step speedups of NeMo-RL's
speculative rollouts (arXiv 2604.26779; figures as reported in its public
summaries) and project Qwen3-235B-A22B; beside them, what adaptive k would
have chosen (``adaptive_k``) and rayspec's weight transports against
published refit times (``weight_sync_anchors``). Every assumption the
paper does not state is in ``PAPER_ASSUMPTIONS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rayspec.model_shape import ModelShape
from rayspec.perfmodel import hardware
from rayspec.perfmodel.calibrate import cell_seconds
from rayspec.perfmodel.pipeline import Pipeline, Workload, band_rates, capped_exponential_lengths, simulate_step
from rayspec.perfmodel.simulate import Engine, best_schedule, simulate_rollout
from rayspec.perfmodel.weight_sync import TRANSPORTS, sync_time
from rayspec.rollout.adaptive import format_schedule, parse_schedule

HERE_TOLERANCE = 0.20
PAPER_TOLERANCE = 0.15


def here(cells: list[dict], hw: hardware.Hardware, target: ModelShape,
         prompt_lens: dict[int, float], max_num_seqs: int, rollout_cap: int) -> list[dict]:
    """Predict each cell of a ``jobs.bench_rollout`` run.

    Fixed-concurrency cells: prefill, then tokens / E steps of t(b, k) at
    the cell's mid context (``calibrate.cell_seconds``), E the cell's
    measured acceptance length (n-gram: over the fraction of sequences that
    drafted, ``ngram_draft_fractions``). Rollout cells: a
    simulated rollout of the cell's own response lengths
    (``response_lens``; older runs without them: capped-exponential lengths
    at the cell's mean, cap ``rollout_cap``) under the cell's k or k
    schedule.

    Args:
        cells: the run's cells.
        hw: the calibrated hardware.
        target: the policy's shape.
        prompt_lens: mean prompt tokens at each concurrency (the bench runs
            the first b prompts at concurrency b).
        max_num_seqs: the bench engine's max_num_seqs.
        rollout_cap: the rollout cells' max tokens.

    Returns:
        One row per cell: method, draft, shape, k, concurrency, measured and
        predicted tokens/s, relative error (predicted / measured - 1).
    """
    fractions = ngram_draft_fractions(cells)
    rows = []
    for c in cells:
        draft_kind = "ngram" if c["draft"] == "ngram" else ("none" if c["draft"] == "none" else "eagle3")
        method = draft_kind if c["method"] == "adaptive" else c["method"]
        draft = target.eagle3_head() if method == "eagle3" else None
        f = fractions.get(c["k"], 1.0) if method == "ngram" else 1.0
        eng = Engine(target, hw, method, draft, max_num_seqs=max_num_seqs, temperature=c.get("temperature", 1.0),
                     draft_fraction=f)
        rates = [f * r for r in c.get("acceptance_rate_per_pos") or []]
        b = c["concurrency"]
        if c["shape"] == "fixed":
            e = 1.0 + f * (c["acceptance_length"] - 1.0) if c["k"] else 1.0
            pred = c["output_tokens"] / cell_seconds(eng, b, prompt_lens[b], c["output_tokens"] / b, c["k"], e)
        else:
            lengths = c.get("response_lens") or capped_exponential_lengths(
                b, min(c["output_tokens"] / b, rollout_cap - 0.5), rollout_cap)
            sched = parse_schedule(c["k_schedule"]) if c.get("k_schedule") else c["k"]
            ro = simulate_rollout(eng, lengths, prompt_lens[b], sched, rates)
            pred = c["output_tokens"] / ro.seconds
        rows.append(dict(method=c["method"], draft=c["draft"], shape=c["shape"], k=c["k"], concurrency=b,
                         measured=c["tokens_per_s"], predicted=pred, error=pred / c["tokens_per_s"] - 1.0))
    return rows


def ngram_draft_fractions(cells: list[dict]) -> dict[int, float]:
    """{k: f}: the fraction of sequence-steps in which the n-gram drafter
    found a match and drafted, from the fixed-concurrency ngram cells of a
    ``jobs.bench_rollout`` run, averaged over concurrencies. Per cell: steps
    = wall_s / seconds_per_step, accepted = output_tokens - steps b, drafts =
    accepted / (acceptance_length - 1), f = drafts / (steps b)."""
    per_k: dict[int, list[float]] = {}
    for c in cells:
        if c["method"] == "ngram" and c["shape"] == "fixed" and c["k"] and c["acceptance_length"] > 1:
            seq_steps = c["wall_s"] / c["seconds_per_step"] * c["concurrency"]
            drafts = (c["output_tokens"] - seq_steps) / (c["acceptance_length"] - 1)
            per_k.setdefault(c["k"], []).append(min(1.0, max(drafts / seq_steps, 1e-3)))
    return {k: sum(v) / len(v) for k, v in per_k.items()}


@dataclass(frozen=True)
class Figure:
    """A published figure and the model's projection of it: one row of
    ``jobs.project_speedup --validate --out``.

    Attributes:
        case: the run (``RL-Zero``, ``RL-Think``, ``RL-Think async``,
            ``235B``, ``here``, ``weight sync``).
        figure: what is measured, with its unit.
        k: num_speculative_tokens (None: no speculation, or a schedule).
        published: the published (or here: measured) value; nan where none.
        projected: the model's value.
        role: ``fitted`` (a calibration target), ``predicted`` or
            ``projection`` (nothing published to compare with).
    """

    case: str
    figure: str
    k: int | None
    published: float
    projected: float
    role: str = "predicted"

    @property
    def error(self) -> float:
        return self.projected / self.published - 1.0

    def to_dict(self) -> dict:
        pub = None if math.isnan(self.published) else self.published
        return dict(case=self.case, figure=self.figure, k=self.k, published=pub, projected=self.projected,
                    role=self.role, error=None if pub is None else self.error)


@dataclass(frozen=True)
class PaperRun:
    """One published run of NeMo-RL's speculative rollouts (Qwen3-8B, 32
    GB200, GRPO on DAPO-Math-17K, an EAGLE-3 head trained offline).

    Attributes:
        acceptance_lengths: {k: EAGLE-3 acceptance length (tokens per step)}.
        generation_speedup: {k: generation speedup against no speculation}.
        generation_s: generation seconds per step without speculation.
        step_s: sync step seconds (no speculation, k = 3).
    """

    acceptance_lengths: dict[int, float]
    generation_speedup: dict[int, float]
    generation_s: float
    step_s: tuple[float, float]


PAPER_RUNS = {
    "RL-Zero": PaperRun({3: 3.32, 5: 4.35, 7: 5.06}, {3: 1.77, 5: 1.44, 7: 1.21}, 100.0, (151.2, 107.5)),
    "RL-Think": PaperRun({3: 2.77, 5: 3.23, 7: 3.48}, {3: 1.53, 5: 0.84, 7: 0.71}, 133.6, (185.3, 137.4)),
}
# RL-Think async at policy lag 1: 12 generation nodes and 4 training nodes of 4 GB200, step seconds
PAPER_ASYNC = dict(run="RL-Think", k=3, rollout_gpus=48, train_gpus=16, policy_lag=1, step_s=(75.0, 60.5))
PAPER_235B = {"512 GB200 sync rollout": 2.72, "512 GB200 sync end to end": 1.70,
              "2048 GB200 async lag 2 rollout": 3.5, "2048 GB200 async lag 2 end to end": 2.5}
RESPONSE_CAP = 16384
PROMPT_LEN = 256
SEQUENCES = 512 * 16
GPUS_PER_NODE = 4  # GB200 NVL72 compute trays

# What the paper (as summarised publicly) does not state, and what the model
# assumes instead, stated once.
PAPER_ASSUMPTIONS = {
    "parallelism": "vLLM TP=1, 32 data-parallel replicas (an 8B bf16 model fits one GB200); "
                   "colocated sync: the policy update uses the same 32 GPUs",
    "engine": "max_num_seqs 256, max_num_batched_tokens 16384, CUDA graphs up to 512 query tokens "
              "(vLLM's default before it appended the decode sizes, min(2 max_num_seqs (1 + k), 512)); "
              "larger forwards run outside graphs",
    "rollout batch": "512 prompts x 16 samples per step (DAPO's recipe), prompts of 256 tokens",
    "response lengths": "capped exponential, cap 16384 tokens, the mean chosen so that the plain rollout takes "
                        "the published generation seconds (100.0 s RL-Zero, 133.6 s RL-Think)",
    "acceptance": "per position from the published EAGLE-3 acceptance lengths at k = 3 / 5 / 7: each band sums "
                  "to the length's increase, geometric within a band (pipeline.band_rates)",
    "draft": "EAGLE-3 head with a 32k draft vocabulary",
    "calibrated": "draft_pass_overhead_s on the two k = 3 generation speedups only; train_mfu on RL-Zero's plain "
                  "step (151.2 - 100.0 s of logprobs, update and refit); everything else is the gb200 preset",
    "async": "RL-Think on 48 rollout + 16 training GPUs at policy lag 1; the batch per step (not published) "
             "chosen so the plain async step takes the published 75.0 s",
    "235B": "Qwen3-235B-A22B, vLLM TP=8 per replica, the RL-Zero workload; async splits the GPUs in half",
}


def paper_engines(hw: hardware.Hardware, target: ModelShape | None = None, tp: int = 1,
                  replicas: int = 32) -> tuple[Engine, Engine]:
    """(plain, EAGLE-3) engines under ``PAPER_ASSUMPTIONS`` (Qwen3-8B default)."""
    target = target or ModelShape.from_hf_config("qwen3-8b")
    common = dict(tp=tp, replicas=replicas, max_num_seqs=256, cudagraph_max_tokens=512,
                  max_num_batched_tokens=16384)
    return (Engine(target, hw, "none", None, **common),
            Engine(target, hw, "eagle3", target.eagle3_head(32000), **common))


def paper_workload(name: str, plain: Engine) -> Workload:
    """The workload of run ``name``: ``SEQUENCES`` capped-exponential
    response lengths whose plain rollout on ``plain`` takes the published
    generation seconds, per-position acceptance from the published lengths
    (``band_rates``).

    Raises:
        ValueError: no mean length below the cap reaches those seconds.
    """
    run = PAPER_RUNS[name]
    seconds, sequences = run.generation_s, SEQUENCES
    rates = band_rates(run.acceptance_lengths)

    def plain_s(mean: float) -> float:
        return simulate_rollout(plain, capped_exponential_lengths(sequences, mean, RESPONSE_CAP), PROMPT_LEN, 0,
                                rates).seconds

    lo, hi = 1.0, RESPONSE_CAP - 1.0
    if plain_s(hi) < seconds:
        raise ValueError(f"{name}: no mean response length under {RESPONSE_CAP} takes {seconds} s")
    for _ in range(30):  # bisection: the plain rollout grows with the mean length
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if plain_s(mid) < seconds else (lo, mid)
    return Workload(capped_exponential_lengths(sequences, lo, RESPONSE_CAP), PROMPT_LEN, rates,
                    source=f"{name}: capped exponential, mean {lo:.0f} tokens (see PAPER_ASSUMPTIONS)")


def _speedup(plain: Engine, spec: Engine, work: Workload, k_schedule) -> float:
    return (simulate_rollout(plain, work.lengths, work.prompt_len, 0, work.rates).seconds
            / simulate_rollout(spec, work.lengths, work.prompt_len, k_schedule, work.rates).seconds)


@dataclass
class Calibration:
    """The GPU preset calibrated on the paper's k = 3 figures, and the
    workloads it was calibrated with."""

    hw: hardware.Hardware
    field: str
    workloads: dict[str, Workload]


def calibrate_k3(field: str = "draft_pass_overhead_s", bounds: tuple[float, float] = (0.0, 10e-3),
                 hw: hardware.Hardware | None = None, iterations: int = 30) -> Calibration:
    """Fit one hardware field on the two k = 3 generation speedups (least
    squares in log error, golden-section search within ``bounds``), then
    ``train_mfu`` on RL-Zero's plain step. The workloads are solved to the
    published plain generation seconds first (and again for each trial
    value of a field that changes plain steps). k = 5 and 7 are not used.

    Raises:
        ValueError: an unknown field (``Hardware.with_overrides``).
    """
    base = (hw or hardware.get("gb200")).with_overrides(**{field: bounds[0]})
    solved = {n: paper_workload(n, paper_engines(base)[0]) for n in PAPER_RUNS}

    def trial(v: float) -> tuple[float, dict[str, Workload]]:
        plain, spec = paper_engines(base.with_overrides(**{field: v}))
        for n, w in solved.items():  # re-solved only where the field moves plain steps
            plain_s = simulate_rollout(plain, w.lengths, w.prompt_len, 0, w.rates).seconds
            if abs(plain_s / PAPER_RUNS[n].generation_s - 1.0) > 1e-3:
                solved[n] = paper_workload(n, plain)
        works = dict(solved)
        loss = sum(math.log(_speedup(plain, spec, w, 3) / PAPER_RUNS[n].generation_speedup[3]) ** 2
                   for n, w in works.items())
        return loss, works

    g = (math.sqrt(5) - 1) / 2
    a, b = bounds
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = trial(c)[0], trial(d)[0]
    for _ in range(iterations):  # one new trial a round: the kept point is the next round's other
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = trial(c)[0]
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = trial(d)[0]
    value = (a + b) / 2
    hw_v = base.with_overrides(**{field: value})
    works = trial(value)[1]
    plain, _ = paper_engines(hw_v)
    zero = simulate_step(plain, works["RL-Zero"], _sync_pipe(32), 0)
    busy = PAPER_RUNS["RL-Zero"].step_s[0] - PAPER_RUNS["RL-Zero"].generation_s - zero.sync_s
    mfu = 8.0 * plain.target.active_params * works["RL-Zero"].tokens / (hw_v.peak_flops * 32 * busy)
    return Calibration(hw_v.with_overrides(train_mfu=mfu), field, works)


def _sync_pipe(gpus: int) -> Pipeline:
    return Pipeline("sync", train_devices=gpus, nodes=math.ceil(gpus / GPUS_PER_NODE))


def published(cal: Calibration) -> list[Figure]:
    """Every published figure of the paper next to its projection under
    ``PAPER_ASSUMPTIONS`` and the calibration ``cal``."""
    plain, spec = paper_engines(cal.hw)
    out = []
    for name, run in PAPER_RUNS.items():
        work = cal.workloads[name]
        steps = {k: simulate_step(spec if k else plain, work, _sync_pipe(32), k) for k in (0, 3, 5, 7)}
        out.append(Figure(name, "generation seconds, no speculation", None, run.generation_s,
                          steps[0].rollout_s, "fitted"))
        for k in (3, 5, 7):
            out.append(Figure(name, "generation speedup", k, run.generation_speedup[k],
                              steps[0].rollout_s / steps[k].rollout_s, "fitted" if k == 3 else "predicted"))
        out.append(Figure(name, "sync step seconds, no speculation", None, run.step_s[0], steps[0].step_s,
                          "fitted" if name == "RL-Zero" else "predicted"))
        out.append(Figure(name, "sync step speedup", 3, run.step_s[0] / run.step_s[1],
                          steps[0].step_s / steps[3].step_s))
    out += _async_figures(cal)
    return out


def _async_figures(cal: Calibration) -> list[Figure]:
    a = PAPER_ASYNC
    replicas = a["rollout_gpus"]
    pipe = Pipeline("async", train_devices=a["train_gpus"], policy_lag=a["policy_lag"],
                    nodes=(a["rollout_gpus"] + a["train_gpus"]) // GPUS_PER_NODE)
    plain, spec = paper_engines(cal.hw, replicas=replicas)
    full = cal.workloads[a["run"]]

    def plain_step(n: int) -> float:
        return simulate_step(plain, replace(full, lengths=full.lengths[:n]), pipe, 0).step_s

    lo, hi = replicas, len(full.lengths)  # the batch whose plain async step takes the published seconds
    while hi - lo > replicas:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plain_step(mid) < a["step_s"][0] else (lo, mid)
    work = replace(full, lengths=full.lengths[:lo])
    s0, s3 = simulate_step(plain, work, pipe, 0), simulate_step(spec, work, pipe, a["k"])
    case = f"{a['run']} async"
    return [Figure(case, f"async lag {a['policy_lag']} step seconds, no speculation ({lo} sequences)", None,
                   a["step_s"][0], s0.step_s, "fitted"),
            Figure(case, f"async lag {a['policy_lag']} step speedup", a["k"], a["step_s"][0] / a["step_s"][1],
                   s0.step_s / s3.step_s)]


def project_235b(cal: Calibration) -> list[Figure]:
    """Qwen3-235B-A22B projections next to the paper's simulator figures."""
    q = ModelShape.from_hf_config("qwen3-235b-a22b")
    work = cal.workloads["RL-Zero"]
    out = []
    for gpus in (512, 2048):
        plain, spec = paper_engines(cal.hw, q, tp=8, replicas=gpus // 8)
        s0, s3 = simulate_step(plain, work, _sync_pipe(gpus), 0), simulate_step(spec, work, _sync_pipe(gpus), 3)
        if gpus == 512:
            out.append(Figure("235B", "512 GB200 sync rollout speedup", 3, PAPER_235B["512 GB200 sync rollout"],
                              s0.rollout_s / s3.rollout_s))
            out.append(Figure("235B", "512 GB200 sync step speedup", 3, PAPER_235B["512 GB200 sync end to end"],
                              s0.step_s / s3.step_s))
            continue
        half_plain, half_spec = paper_engines(cal.hw, q, tp=8, replicas=gpus // 16)
        for lag in (1, 2):
            pipe = Pipeline("async", train_devices=gpus // 2, policy_lag=lag, nodes=gpus // GPUS_PER_NODE)
            a, a0 = simulate_step(half_spec, work, pipe, 3), simulate_step(half_plain, work, pipe, 0)
            if lag == 2:
                out.append(Figure("235B", "2048 GB200 async lag 2 rollout speedup vs sync plain", 3,
                                  PAPER_235B["2048 GB200 async lag 2 rollout"], s0.rollout_s / a.rollout_s))
                out.append(Figure("235B", "2048 GB200 async lag 2 step speedup vs sync plain", 3,
                                  PAPER_235B["2048 GB200 async lag 2 end to end"], s0.step_s / a.step_s))
            out.append(Figure("235B", f"2048 GB200 async lag {lag} step speedup vs async plain", 3,
                              float("nan"), a0.step_s / a.step_s, "projection"))
    return out


def adaptive_k(cal: Calibration, k_max: int = 7) -> list[dict]:
    """What rayspec's controller would run on the paper's workloads: fixed
    k = 3 / 5 / 7 and the best batch-size schedule of k (``best_schedule``,
    vLLM's ``num_speculative_tokens_per_batch_size``) from the same
    acceptance, with generation and sync step speedups (projected)."""
    plain, spec = paper_engines(cal.hw)
    rows = []
    for name, work in cal.workloads.items():
        base = simulate_step(plain, work, _sync_pipe(32), 0)
        sched = best_schedule(spec, work.lengths, work.prompt_len, work.rates, k_max)
        for label, ks in (("k=3", 3), ("k=5", 5), ("k=7", 7), ("schedule", sched)):
            st = simulate_step(spec, work, _sync_pipe(32), ks)
            rows.append(dict(case=name, k=label, schedule=format_schedule(sched) if label == "schedule" else None,
                             published=PAPER_RUNS[name].generation_speedup.get(ks) if isinstance(ks, int) else None,
                             generation_speedup=base.rollout_s / st.rollout_s, step_speedup=base.step_s / st.step_s))
    return rows


# Published refit times (as summarised publicly); hardware and node counts
# the sources do not give are marked assumed. (source, model, weight bytes,
# preset, preset overrides, nodes, published seconds)
WEIGHT_SYNC_ANCHORS = [
    ("NeMo-RL NCCL refit", "4B bf16", 8e9, "h100", {}, 1, 0.075),
    ("NeMo-RL NCCL refit", "Qwen3-235B bf16 (nodes assumed 4)", 470e9, "h100", {}, 4, 4.75),
    ("prime-rl NCCL broadcast (44 GB/s per GPU)", "GLM-5 scale, 1.5 TB bf16 assumed; 64 + 32 H200", 1.5e12,
     "h200", {}, 12, 2.84),
    ("Kimi checkpoint-engine", "Qwen3-235B bf16 on 8 H800 (NVLink 400 GB/s)", 470e9, "h100",
     {"link_bw": 200e9}, 1, 6.2),
    ("Perplexity RDMA", "1T, 1 TB fp8 assumed (nodes assumed 16)", 1e12, "h200", {}, 16, 1.3),
]


def weight_sync_anchors(cal: Calibration) -> list[dict]:
    """rayspec's transports (``perfmodel.weight_sync``) beside published
    refit times on the same model size and hardware, then at 8B and 235B on
    the paper's GB200 runs as a share of the modelled k = 3 step."""
    rows = []
    for source, model, nbytes, preset, over, nodes, secs in WEIGHT_SYNC_ANCHORS:
        hw = hardware.get(preset, **over)
        rows.append(dict(source=source, model=model, nodes=nodes, published_s=secs,
                         **{t: (None if t == "shared_memory" and nodes > 1 else sync_time(t, nbytes, hw, nodes).seconds)
                            for t in TRANSPORTS}))
    plain, spec = paper_engines(cal.hw)
    step8 = simulate_step(spec, cal.workloads["RL-Zero"], _sync_pipe(32), 3)
    q = ModelShape.from_hf_config("qwen3-235b-a22b")
    _, spec235 = paper_engines(cal.hw, q, tp=8, replicas=64)
    step235 = simulate_step(spec235, cal.workloads["RL-Zero"], _sync_pipe(512), 3)
    for label, shape, st, nodes in (("rayspec, Qwen3-8B, 32 GB200 (RL-Zero k=3)", plain.target, step8, 8),
                                    ("rayspec, Qwen3-235B-A22B, 512 GB200 (RL-Zero k=3)", q, step235, 128)):
        nbytes = shape.weight_bytes(1e9, cal.hw.dtype_bytes)
        for t in TRANSPORTS:
            if t == "shared_memory":
                continue  # colocated replicas span nodes here
            s = sync_time(t, nbytes, cal.hw, nodes).seconds
            rows.append(dict(source=label, model=f"{nbytes / 1e9:.0f} GB", nodes=nodes, published_s=None,
                             transport=t, sync_s=s, share_of_step=s / (st.step_s - st.sync_s + s)))
    return rows
