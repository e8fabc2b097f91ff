"""Adaptive speculation: the controller's choice of k from acceptance and
step cost, and switching k in a running vLLM engine."""

from __future__ import annotations

import json
import os

import pytest

from rayspec.draft.eagle3 import init_head, save_head
from rayspec.models import load_policy
from rayspec.models.acceptance import read_acceptance, write_acceptance
from rayspec.rollout.adaptive import (AdaptiveK, StepCost, StepTimes, expected_tokens, format_schedule,
                                      geometric_rate, parse_schedule, physical_limit, uniform)
from tests.conftest import copy_model_dir, engine_kwargs


def grid(bs, k, plain=None, spec=None, sync=None, spec1=None) -> StepCost:
    """A StepCost measured at batch sizes ``bs``: plain steps, k-draft steps,
    sync steps and 1-draft steps (None: not measured)."""
    kinds = {"plain": plain, str(k): spec, "sync": sync, "1": spec1}
    return StepCost(k, {kind: [[b, t] for b, t in zip(bs, ts)] for kind, ts in kinds.items() if ts})


# Step seconds shaped like SmolLM2 on 2 CPU cores (DESIGN.md): a k=3 step costs
# ~1.45x a plain one at 1 sequence and ~3x at 64.
CPU_COST = grid([1, 8, 64], 3, plain=[0.020, 0.030, 0.100], spec=[0.029, 0.075, 0.300])


def test_adaptive_engines_get_a_schedule_the_v1_runner_and_no_async_scheduling_unless_asked():
    from rayspec.rollout.engine import adaptive_engine_settings

    spec, kwargs, env = {"method": "eagle3", "num_speculative_tokens": 3}, {"max_num_seqs": 8}, {}
    adaptive_engine_settings(spec, kwargs, env)
    assert spec["num_speculative_tokens_per_batch_size"] == uniform(3, 1 << 16)
    # CUDA vLLM 0.32 would turn async scheduling on for EAGLE and pick the V2 runner
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and kwargs == {"max_num_seqs": 8, "async_scheduling": False}
    kwargs, env = {"async_scheduling": True}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    adaptive_engine_settings(dict(spec), kwargs, env)  # the user's choices stand
    assert kwargs == {"async_scheduling": True} and env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def test_expected_tokens_and_limits():
    assert expected_tokens([0.8, 0.6, 0.4], 0) == 1.0
    assert expected_tokens([0.8, 0.6, 0.4], 2) == pytest.approx(2.4)
    # Leviathan et al. Eq. 1: a=0.5, k=3 -> (1 - 0.5^4) / 0.5 = 1.875 tokens per step
    assert physical_limit(0.5, 3, 0.0) == pytest.approx(1.875)
    assert physical_limit(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert physical_limit(0.5, 3, 0.1, draft_fraction=0.2) == pytest.approx((1 + 0.2 * 0.875) / 1.3)
    # i.i.d. rates r_i = a^i give back a
    assert geometric_rate([0.6, 0.36, 0.216]) == pytest.approx(0.6)


def test_step_cost_interpolates_in_log_batch_and_linearly_in_k():
    assert CPU_COST.seconds(1, 0) == pytest.approx(0.020)
    assert CPU_COST.seconds(8, 3) == pytest.approx(0.075)
    assert CPU_COST.seconds(8, 1) == pytest.approx(0.030 + 0.045 / 3)
    assert CPU_COST.seconds(16, 0) == pytest.approx(0.030 + 0.070 / 3)  # a third of the way from 8 to 64 in log b
    assert CPU_COST.seconds(128, 0) == pytest.approx(0.200)  # past the last point: per sequence
    assert CPU_COST.cost_ratio(1) == pytest.approx(0.15)
    # with 1-draft steps measured: linear from plain to them, then from them to k = K
    kinked = grid([1, 8, 64], 3, plain=[0.020, 0.030, 0.100], spec=[0.029, 0.075, 0.300],
                  spec1=[0.024, 0.050, 0.200])
    assert kinked.seconds(8, 0) == pytest.approx(0.030) and kinked.seconds(8, 1) == pytest.approx(0.050)
    assert kinked.seconds(8, 2) == pytest.approx(0.0625) and kinked.seconds(8, 3) == pytest.approx(0.075)
    # only 1-draft steps measured: k = 3 on the line from plain through them
    low = grid([1, 8], 3, plain=[0.02, 0.03], spec1=[0.03, 0.05])
    assert low.known(3) and low.seconds(8, 3) == pytest.approx(0.03 + 3 * 0.02)
    # no plain steps yet: only the k measured is known; no drafting steps: only k = 0
    assert not grid([1], 3, spec=[0.03]).known(0) and grid([1], 3, spec=[0.03]).known(3)
    assert not grid([1], 3, spec=[0.03]).known(1)
    assert not grid([1], 3, plain=[0.03]).known(2) and not StepCost(3).known(0)
    assert not grid([1], 3, sync=[0.03]).known(0)  # a sync step is not a plain one
    # past the last batch size measured, a drafting step keeps its ratio to a plain step there
    tail_only = grid([1, 8, 64], 3, plain=[0.020, 0.030, 0.100])
    tail_only.curves["3"] = [[1, 0.029], [8, 0.075]]
    assert tail_only.seconds(64, 3) == pytest.approx(0.100 * 0.075 / 0.030)
    assert tail_only.seconds(128, 0) == pytest.approx(0.200)  # a plain one grows per sequence
    with pytest.raises(KeyError):
        grid([1], 3, plain=[0.03]).seconds(1, 2)
    # a sync step not yet measured: plain plus half a draft's extra cost per draft
    assert CPU_COST.sync_seconds(1) == pytest.approx(0.020 + 0.009 / 6)


def test_step_times_keep_medians_per_kind_and_batch_bucket():
    """Each rollout's decode steps land in power-of-two buckets of batch
    size per kind; the cost is the median of each bucket (a slow step does
    not move it), the window keeps the newest, and a prior (an earlier run's
    costs) counts as one step per point."""
    times = StepTimes(3, window=4)
    for b, t in [(31, 0.10), (30, 0.09), (28, 0.50), (17, 0.08), (1, 0.02), (1, 0.021)]:
        times.add("plain", b, t)
    times.add("3", 2, 0.05)
    cost = times.cost()
    assert cost.curves["plain"] == [[1, pytest.approx(0.0205)], [29, pytest.approx(0.095)]]
    assert cost.curves["3"] == [[2, 0.05]] and len(times) == 7
    for _ in range(4):  # the window: the 4 newest of a bucket
        times.add("3", 3, 0.07)
    assert times.cost().curves["3"] == [[3, 0.07]]
    again = StepTimes(3, prior=cost)
    assert again.cost() == cost
    again.add("plain", 1, 0.03)
    assert again.cost().curves["plain"][0] == [1, pytest.approx((0.0205 + 0.03) / 2)]


def test_good_draft_speculates_in_the_tail_only_and_bad_draft_never():
    ctl = AdaptiveK(k_max=3, max_num_seqs=64, cost=CPU_COST)
    assert ctl.schedule() == [(1, 8, 3), (9, 64, 0)]  # nothing measured yet: measure at k_max, in the tail
    ctl.update([600, 400, 250], num_drafts=1000, positions=3)
    sched = ctl.schedule()
    # k falls as the batch grows and drafting costs more (worked by hand from CPU_COST)
    assert format_schedule(sched) == "1:3 2:2 3-8:1 9-64:0"
    assert parse_schedule(format_schedule(sched)) == sched
    # every choice is at least as fast as plain decoding by the model
    for b in range(1, 65):
        k = ctl.best_k(b)
        assert expected_tokens(ctl.rates, k) / CPU_COST.seconds(b, k) >= 1 / CPU_COST.seconds(b, 0)
    bad = AdaptiveK(k_max=3, max_num_seqs=64, cost=CPU_COST)
    bad.update([10, 2, 0], num_drafts=1000, positions=3)
    assert bad.schedule() == [(1, 64, 0)]


def test_a_match_drafter_is_judged_by_the_share_of_steps_it_drafts_on():
    """n-gram and suffix draft only where their match does: a step then emits
    1 + f (E(k) - 1) tokens for its measured cost t(b, k) (that of the
    drafts the matches made), so the fixed margin over plain decoding takes
    more per draft when f is small."""
    every = AdaptiveK(k_max=3, max_num_seqs=64, cost=CPU_COST, match_drafter=True)
    every.update([600, 400, 250], num_drafts=1000, positions=3, sequence_steps=1000)
    assert every.draft_fraction == 1.0 and format_schedule(every.schedule()) == "1:3 2:2 3-8:1 9-64:0"
    model = AdaptiveK(k_max=3, max_num_seqs=64, cost=CPU_COST)  # a head drafts at every step: f stays 1
    model.update([600, 400, 250], num_drafts=1000, positions=3, sequence_steps=10000)
    assert model.draft_fraction == 1.0
    rare = AdaptiveK(k_max=3, max_num_seqs=64, cost=CPU_COST, match_drafter=True)
    rare.update([600, 400, 250], num_drafts=1000, positions=3, sequence_steps=10000)
    assert rare.draft_fraction == pytest.approx(0.1)  # the first measurement, not averaged with the prior 1
    sched = {b: rare.best_k(b) for b in range(1, 65)}
    assert sched[8] == 0 and sum(sched.values()) < sum(every.best_k(b) for b in range(1, 65))
    f, t = rare.draft_fraction, CPU_COST.seconds
    for b, k in sched.items():
        if k:
            assert (1 + f * (expected_tokens(rare.rates, k) - 1)) / t(b, k) >= rare.margin / t(b, 0)
    rare.update([600, 400, 250], num_drafts=1000, positions=3, sequence_steps=5000)
    assert rare.draft_fraction == pytest.approx(0.5 * 0.1 + 0.5 * 0.2)
    rare.observe([100] * 15 + [512])  # 16 sequences for 100 tokens, then 1 for 412
    assert rare.drafted_tokens([(1, 1, 3), (2, 64, 0)]) == 412
    assert rare.drafted_tokens(uniform(3, 64)) == 16 * 100 + 412


@pytest.mark.parametrize("method, probes", [("suffix", True), ("ngram", True), ("eagle3", False)])
def test_a_policy_refit_probes_a_match_drafter_but_not_a_model_one(method, probes):
    """An n-gram or suffix draft is the policy's own text, so a drafter
    switched off everywhere is probed again after a policy refit; a head's
    acceptance changes with its own refits (and their estimates)."""
    from types import SimpleNamespace

    from rayspec.rollout.engine import SpecVLLMEngine

    eng = object.__new__(SpecVLLMEngine)  # the bookkeeping only: no vLLM engine
    eng.llm = SimpleNamespace(reset_prefix_cache=lambda: None, collective_rpc=lambda method, args=(): [{}],
                              update_weight_version=lambda version: None, shutdown=lambda: None)
    eng.speculative_config = {"method": method, "num_speculative_tokens": 3}
    eng.max_num_seqs, eng.lora = 16, False
    eng.set_k_schedule = lambda schedule: setattr(eng, "k_schedule", schedule)
    eng.enable_adaptive(cost=CPU_COST, probe_every=1, rates=[0.0, 0.0, 0.0])  # measured: pays nowhere
    assert eng.adaptive.match_drafter == probes
    assert eng.k_schedule == [(1, 16, 0)]
    eng._loaded("policy", 1)
    assert eng.policy_version == 1
    assert eng.k_schedule == ([(1, 1, 3), (2, 16, 0)] if probes else [(1, 16, 0)])
    del eng.llm  # the fake has no engine core for __del__'s shutdown to stop


def test_rollout_shape_decides_whether_a_tail_schedule_pays():
    """Drafting in the tail keeps the drafter in sync at every batch size:
    kept when the rollout spends long enough in the tail, dropped when the
    tail is too short to repay the sync cost of the full batch."""
    cost = grid([1, 8, 64], 3, plain=[0.020, 0.030, 0.100], spec=[0.029, 0.075, 0.300],
                sync=[0.022, 0.032, 0.104])
    ctl = AdaptiveK(k_max=3, max_num_seqs=64, cost=cost)
    ctl.update([600, 400, 250], num_drafts=1000, positions=3)
    tail = ctl.schedule()
    assert format_schedule(tail) == "1:3 2:2 3-8:1 9-64:0"  # no shape known yet: per-b choice
    # 16 sequences; 15 stop at 100 tokens, one runs to 512
    ctl.observe([100] * 15 + [512])
    assert ctl.positions == {16: 100, 1: 412}
    assert ctl.schedule() == tail
    assert ctl.rollout_seconds(tail) < ctl.rollout_seconds(uniform(0, 64))
    # all 16 run to 500 tokens but one to 502: the tail cannot repay the sync cost
    ctl.observe([500] * 15 + [502])
    assert ctl.positions == {16: 500, 1: 2}
    assert ctl.schedule() == uniform(0, 64)
    # k = 0 everywhere idles the drafter: it costs plain steps, not sync steps
    assert ctl.rollout_seconds(uniform(0, 64)) == pytest.approx(500 * cost.seconds(16, 0) + 2 * cost.seconds(1, 0))


def test_a_sync_step_timed_below_a_plain_one_does_not_keep_a_tail_schedule():
    """An RL run's calibration (GSM8K preset, 2 CPU cores) timed the k = 0
    step with the drafter in sync at 0.104 s and the plain one at 0.113 s at
    16 sequences. Taken as measured, the shape rule kept drafting at 1-3
    sequences in a rollout whose 16 sequences all but 3 ran to 128 tokens:
    no tail to draft in, only the sync forward to pay."""
    cost = grid([1, 4, 16], 3, plain=[0.0694, 0.0763, 0.1130], spec=[0.0995, 0.1399, 0.2701],
                sync=[0.0722, 0.0730, 0.1039], spec1=[0.0821, 0.1117, 0.1652])
    assert cost.sync_seconds(16) == cost.seconds(16, 0)  # at least a plain step
    assert cost.sync_seconds(1) == pytest.approx(0.0722)  # above it: as measured
    ctl = AdaptiveK(k_max=3, max_num_seqs=64, cost=cost, rates=[0.482, 0.247, 0.125])
    ctl.observe([28, 35, 75, 107, 117] + [128] * 11)
    assert ctl.schedule() == uniform(0, 64)


def test_probe_every_n_draft_refits():
    ctl = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, probe_every=3)
    ctl.update([0, 0, 0], num_drafts=100, positions=3)
    for _ in range(2):
        ctl.draft_changed()
        assert ctl.schedule() == [(1, 16, 0)]
    ctl.draft_changed()
    assert ctl.schedule() == [(1, 1, 3), (2, 16, 0)]


def test_probe_after_draft_refit_and_partial_positions():
    ctl = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, min_drafts=1)
    ctl.update([0, 0, 0], num_drafts=100, positions=3)
    assert ctl.schedule() == [(1, 16, 0)]
    ctl.probe = True  # the engine sets this on a draft refit
    assert ctl.schedule() == [(1, 1, 3), (2, 16, 0)]
    # the probe measures every position; a schedule whose smallest k is 1
    # measures only rate 0, and the rest keep theirs
    ctl.update([90, 0, 0], num_drafts=100, positions=1)
    assert not ctl.probe
    assert ctl.rates[0] == pytest.approx(0.45) and ctl.rates[1:] == [0.0, 0.0]


def test_estimated_draft_is_drafted_by_its_estimate_and_calibrated_by_measurement():
    """The DraftTrainer's estimate decides for a refit instead of a probe:
    an estimate that pays drafts at once, one that does not stays at k = 0
    without probing; the first measurement after an estimate calibrates the
    next one (measured / estimated per position, capped at 2)."""
    ctl = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, ema=0.5, min_drafts=1)
    ctl.update([0, 0, 0], num_drafts=100, positions=3)
    assert ctl.schedule() == [(1, 16, 0)]
    ctl.draft_changed()
    ctl.draft_estimated([0.05, 0.01])  # pays nowhere: no probe either
    assert not ctl.probe and ctl.schedule() == [(1, 16, 0)]
    assert ctl.rates == pytest.approx([0.05, 0.01, 0.01 * geometric_rate([0.05, 0.01])])
    ctl.draft_changed()
    ctl.draft_estimated([0.8, 0.6, 0.45])
    assert format_schedule(ctl.schedule()) == "1:3 2-7:2 8-16:1"
    # the replicas accept half what was estimated at position 1, as much at 2, twice at 3
    ctl.update([40, 60, 90], num_drafts=100, positions=3)
    assert ctl.calibration == pytest.approx([0.75, 1.0, 1.5])
    assert ctl.rates == pytest.approx([0.6, 0.6, 0.675])  # EMA of estimate and measurement
    ctl.update([40, 60, 90], num_drafts=100, positions=3)  # a second measurement: no estimate to compare
    assert ctl.calibration == pytest.approx([0.75, 1.0, 1.5])
    ctl.draft_estimated([0.8, 0.6, 0.8])
    assert ctl.rates == pytest.approx([0.6, 0.6, 1.0])  # scaled, capped at 1


def test_estimate_by_share_drafts_the_tail_by_the_tails_rates_and_calibrates_where_it_drafted():
    """With the replay by share of the rollout in flight, batch sizes in the
    tail draft by the tail's rates (here far below the average, so not at
    all), a share without enough replayed drafts takes the next one towards
    the full batch, and the first measurement is compared with the estimate
    where the schedule drafted, then folded into the overall rates."""
    flat = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, ema=0.5, min_drafts=1)
    flat.draft_estimated([0.8, 0.6, 0.45])
    ctl = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, ema=0.5, min_drafts=1)
    ctl.observe([4] * 12 + [40] * 4)  # 16 sequences; the last 4 run on alone
    ctl.draft_estimated([0.8, 0.6, 0.45], [(1.0, 200, [0.9, 0.8, 0.675]), (0.25, 40, [0.1, 0.02, 0.0])])
    assert ctl.rates == pytest.approx([0.8, 0.6, 0.45])  # overall, as without buckets
    assert ctl.rates_at(16) == pytest.approx([0.9, 0.8, 0.675]) == ctl.rates_at(9)
    assert ctl.rates_at(6) == pytest.approx([0.9, 0.8, 0.675])  # share 3/8: no bucket of its own
    assert ctl.rates_at(4) == pytest.approx([0.1, 0.02, 0.0]) == ctl.rates_at(1)
    assert flat.best_k(1) == 3 and ctl.best_k(1) == ctl.best_k(4) == 0
    assert ctl.best_k(16) > 0
    # measured where the schedule drafted (b = 9..16) as estimated there: calibration stays 1
    ctl.update([90, 80, 0], num_drafts=100, positions=2, schedule=[(1, 8, 0), (9, 16, 2)])
    assert ctl.calibration == pytest.approx([1.0, 1.0])
    assert ctl.rates == pytest.approx([0.8, 0.6, 0.45])
    # the same counters against the overall estimate read as 12-33% better than estimated
    flat.update([90, 80, 0], num_drafts=100, positions=2)
    assert flat.calibration == pytest.approx([(1 + 0.9 / 0.8) / 2, (1 + 0.8 / 0.6) / 2])


def test_a_rollout_weighs_by_its_drafts():
    """A rollout whose schedule drafted only at batch size 1 may make one
    draft: accepted whole, it must not move the rates to 1 (nor, rejected,
    to 0), where a rollout of hundreds of drafts moves them by nearly ema.
    (A replica's first rollout after a warm head's record drafted once and
    took its rates from 0.30 / 0.09 to 0.65 / 0.55, so the next rollout
    drafted 2 tokens at 16 sequences and measured 0.41 / 0.18.)"""
    ctl = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, ema=0.5, min_drafts=16, rates=[0.3, 0.09, 0.035])
    ctl.update([1, 1, 1], num_drafts=1, positions=3)
    assert ctl.rates == pytest.approx([0.3 + 0.7 / 32, 0.09 + 0.91 / 32, 0.035 + 0.965 / 32])
    ctl.update([0, 0, 0], num_drafts=1, positions=3)
    before = ctl.rates[0]
    assert before == pytest.approx((0.3 + 0.7 / 32) * (1 - 1 / 32))
    ctl.update([4, 2, 1], num_drafts=8, positions=3)  # half of min_drafts: half of ema
    assert ctl.rates[0] == pytest.approx(0.75 * before + 0.25 * 0.5)
    many = AdaptiveK(k_max=3, max_num_seqs=16, cost=CPU_COST, ema=0.5, rates=[0.3, 0.09, 0.035])
    many.update([400, 180, 80], num_drafts=1000, positions=3)
    assert many.rates == pytest.approx([0.35, 0.135, 0.0575])  # from 16 drafts on: ema


def test_the_controller_measures_what_it_lacks_first_and_says_why():
    """No step is timed before the rollouts: with no acceptance rates, or no
    k_max-draft step measured, a rollout drafts k_max in its tail (up to 8
    sequences, where drafts cost least); with no plain step measured (sync
    steps do not count), nothing; then it chooses, and ``reason`` says why
    in the step line's words."""
    ctl = AdaptiveK(k_max=3, max_num_seqs=64)
    tail = [(1, 8, 3), (9, 64, 0)]
    assert ctl.schedule() == tail and ctl.reason == "k 3 at 1-8 seqs: measuring the draft's acceptance"
    assert AdaptiveK(k_max=2, max_num_seqs=4).schedule() == [(1, 4, 2)]
    ctl.update([600, 400, 250], num_drafts=1000, positions=3)
    assert ctl.schedule() == tail and ctl.reason == "k 3 at 1-8 seqs: measuring a 3-draft step's cost"
    ctl.cost = grid([1, 8], 3, spec=[0.029, 0.075], sync=[0.021, 0.031])
    assert ctl.schedule() == uniform(0, 64) and ctl.reason == "k 0: measuring a plain step's cost"
    ctl.cost = CPU_COST
    assert format_schedule(ctl.schedule()) == "1:3 2:2 3-8:1 9-64:0"
    # the widest range that drafts: a 1-draft step at 8 sequences costs 1.5x plain for 1.6 tokens
    assert ctl.reason == "k 1 at 3-8 seqs: a step costs 1.50x plain; draft 1.60 tok/step > 1.58"
    ctl.update([0, 0, 0], num_drafts=100000, positions=3)
    ctl.rates = [0.1, 0.02, 0.0]
    assert ctl.schedule() == uniform(0, 64)
    # at one sequence the best k is 1: 1.1 tokens for 0.020 + 0.003 s
    assert ctl.reason == "k 0: at 1 seq a 1-draft step costs 1.15x plain; draft 1.10 tok/step < 1.21"
    ctl.probe = True
    assert ctl.schedule() == [(1, 1, 3), (2, 64, 0)] and ctl.reason.startswith("k 3 at 1 seq: probing the new draft")


def test_a_replica_times_its_rollouts_decode_steps_by_kind_and_keeps_them_by_key(tmp_path, tiny_llama_dir):
    """After each ``generate`` at the rollouts' temperature the replica folds
    vLLM's per-step stats into its step costs: decode steps only, each of
    the kind its batch size's k made it, with its share of the call's time
    outside the timed model execution by its requests; the costs are kept under a key
    (machine, shapes, dtype, engine settings, temperature) that a later
    engine with the same key starts from."""
    from rayspec.rollout.engine import SpecVLLMEngine
    from rayspec.vllm.step_timer import EngineStep, StepTimer

    def engine(dtype="float32"):
        eng = object.__new__(SpecVLLMEngine)
        eng.__dict__.update(max_num_seqs=4, _model=str(tiny_llama_dir), _dtype=dtype, _threads="0-1",
                            _engine_kwargs={"max_num_seqs": 4}, _step_timer=StepTimer(),
                            speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
        eng.set_k_schedule = lambda schedule, drafter_idle=None: setattr(eng, "k_schedule", schedule)
        eng.enable_adaptive(rates=[0.5], temperature=1.0, cost_cache=str(tmp_path))
        return eng

    eng = engine()
    assert eng.k_schedule == uniform(3, 4) and not eng.adaptive.cost.known(3)
    schedule = [(1, 2, 3), (3, 4, 0)]
    steps = [EngineStep(4, 40, 0, 0, 0.2),  # the prefill: not a decode step
             EngineStep(0, 0, 4, 4, 0.05), EngineStep(0, 0, 3, 3, 0.04), EngineStep(0, 0, 2, 8, 0.06),
             EngineStep(0, 0, 1, 4, 0.03)]
    for st in steps:
        eng._step_timer.record(type("S", (), {"iteration_details": type("D", (), {
            "num_ctx_requests": st.prefill_requests, "num_ctx_tokens": st.prefill_tokens,
            "num_generation_requests": st.decode_requests, "num_generation_tokens": st.decode_tokens,
            "elapsed_ms": st.seconds * 1000, "is_dummy": False})()})(), None)
    eng._time_steps(schedule, {1.0}, wall_s=0.38 + 0.07)  # 5 ms a request outside the timed execution
    cost = eng.adaptive.cost
    # k = 0 steps where the schedule drafts elsewhere keep the drafter in sync
    assert cost.curves == {"sync": [[3, pytest.approx(0.055)], [4, pytest.approx(0.07)]],
                           "3": [[1, pytest.approx(0.035)], [2, pytest.approx(0.07)]]}
    assert eng._step_timer.take() == []
    kept = list(tmp_path.glob("*.json"))
    assert len(kept) == 1 and StepCost(**json.loads(kept[0].read_text())) == cost
    assert engine().adaptive.cost == cost  # the same key starts from them
    assert engine("bfloat16").adaptive.cost == StepCost(3)  # another dtype: measured anew
    greedy = engine()
    greedy._step_timer.record(type("S", (), {"iteration_details": type("D", (), {
        "num_ctx_requests": 0, "num_ctx_tokens": 0, "num_generation_requests": 1, "num_generation_tokens": 1,
        "elapsed_ms": 99.0, "is_dummy": False})()})(), None)
    greedy._time_steps(uniform(0, 4), {0.0, 1.0}, wall_s=0.1)  # not the rollouts' temperature: not timed
    assert greedy.adaptive.cost == cost
    kept[0].write_text("{not json")
    assert engine().adaptive.cost == StepCost(3)  # unreadable: measured anew


def test_acceptance_record_round_trips_and_bad_ones_name_the_file(tmp_path):
    assert read_acceptance(tmp_path) is None and read_acceptance(None) is None
    path = write_acceptance(tmp_path, [0.21, 0.06, 0.02], k=3, temperature=1.0)
    assert read_acceptance(tmp_path) == [0.21, 0.06, 0.02]
    assert not list(tmp_path.glob("*.tmp"))
    # a record without the key was measured with greedy drafts (vLLM's default):
    # not the rates of sampled ones, and the reverse
    assert read_acceptance(tmp_path, "probabilistic") is None
    write_acceptance(tmp_path, [0.43, 0.18], draft_sample_method="probabilistic")
    assert read_acceptance(tmp_path, "probabilistic") == [0.43, 0.18] and read_acceptance(tmp_path) is None
    for text, fragment in (("{", "not an acceptance record"), ('{"k": 3}', "not an acceptance record"),
                           ('{"acceptance_rate_per_pos": [0.5, NaN]}', "list of rates in [0, 1]"),
                           ('{"acceptance_rate_per_pos": 0.5}', "list of rates in [0, 1]"),
                           ('{"acceptance_rate_per_pos": [0.5], "draft_sample_method": "top-k"}',
                            "draft_sample_method must be one of")):
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)) as e:
            read_acceptance(tmp_path)
        assert fragment in str(e.value)


def test_run_copies_the_heads_acceptance_record(head_dir, tmp_path):
    """The RL driver serves a copy of the configured head; its recorded
    acceptance travels with it, so adaptive replicas start from it."""
    from rayspec.config import load_config
    from rayspec.driver import draft_start, prepare_draft

    head = copy_model_dir(head_dir, tmp_path / "warm")
    write_acceptance(head, [0.4, 0.1], final_lr=1.2e-4)
    cfg = load_config(None, ["rollout.speculative_config.method=eagle3",
                             f"rollout.speculative_config.model={head}",
                             "rollout.speculative_config.num_speculative_tokens=2"])
    served, _ = prepare_draft(cfg, "unused: the head is given", tmp_path / "run")
    assert read_acceptance(served) == [0.4, 0.1]
    # the DraftTrainer continues at the warm start's final rate, and the
    # training cadence starts from the recorded acceptance length (1 + 0.4 + 0.1)
    lr, _, prior = draft_start(cfg, served)
    assert lr == 1.2e-4 and prior == pytest.approx(1.5)
    (head / "acceptance.json").unlink()
    served, _ = prepare_draft(cfg, "unused", tmp_path / "run")
    assert read_acceptance(served) is None  # save_head replaced the copy whole


def test_idle_drafter_returns_no_drafts_without_its_forward():
    """The wrapped ``propose``: an idle drafter asked for 0 tokens skips its
    forward; asked for k > 0, or not idle, it runs as before."""
    from types import SimpleNamespace

    import torch

    from rayspec.vllm.spec_schedule import _propose_unless_idle

    class Proposer:
        device = torch.device("cpu")
        calls = 0

        def propose(self, num_speculative_tokens, common_attn_metadata=None):
            self.calls += 1
            return torch.zeros(common_attn_metadata.batch_size(), num_speculative_tokens, dtype=torch.int64)

    Proposer.propose = _propose_unless_idle(Proposer.propose)
    cad = SimpleNamespace(batch_size=lambda: 5)
    p = Proposer()
    assert p.propose(num_speculative_tokens=0, common_attn_metadata=cad).shape == (5, 0) and p.calls == 1
    p.rayspec_idle = True
    out = p.propose(num_speculative_tokens=0, common_attn_metadata=cad)
    assert out.shape == (5, 0) and out.dtype == torch.int64 and p.calls == 1
    assert p.propose(num_speculative_tokens=2, common_attn_metadata=cad).shape == (5, 2) and p.calls == 2


def test_step_without_drafts_samples_without_the_rejection_sampler():
    """The wrapped ``_sample``: spec-decode metadata with no drafts is
    dropped (the plain sampler runs), drafts or async scheduling keep it."""
    from types import SimpleNamespace

    from rayspec.vllm.spec_schedule import _plain_sample_without_drafts

    seen = []
    sample = _plain_sample_without_drafts(lambda self, logits, md: seen.append(md))
    runner = SimpleNamespace(use_async_scheduling=False)
    no_drafts, drafts = SimpleNamespace(max_spec_len=0), SimpleNamespace(max_spec_len=2)
    sample(runner, None, no_drafts)
    sample(runner, None, drafts)
    sample(runner, None, None)
    sample(SimpleNamespace(use_async_scheduling=True), None, no_drafts)
    assert seen == [None, drafts, None, no_drafts]


@pytest.mark.slow
def test_idle_drafter_drafts_again_with_its_kv(tiny_llama_dir, in_process_engine_core):
    """A schedule of 0 everywhere idles the drafter (no drafts; that it
    skips its forward is the unit test above); switching back drafts with
    the draft's KV intact: the policy
    as its own draft model, greedy, has every draft accepted, also on
    prompts first seen while idle (their prefix-cached blocks would hold no
    draft KV: without the cache reset, 0 of 92 drafts were accepted)."""
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "draft_model", "num_speculative_tokens": 2,
                                              "model": str(tiny_llama_dir),
                                              "num_speculative_tokens_per_batch_size": uniform(2, 4)},
                         dtype="float32", engine_kwargs=engine_kwargs(max_num_seqs=4),
                         env=cpu_engine_env(1, "all"))
    try:
        prompts = [[(7 * i + j) % 5000 + 100 for j in range(300)] for i in range(2)]
        eng.set_k_schedule(uniform(0, 4))
        _, stats = eng.generate(prompts, n=1, temperature=0.0, max_tokens=16)
        assert stats.num_drafts == 0
        eng.set_k_schedule([(1, 1, 0), (2, 4, 2)])
        _, stats = eng.generate(prompts, n=1, temperature=0.0, max_tokens=16)
        assert stats.num_draft_tokens > 0
        assert stats.accepted_per_pos == [stats.num_drafts] * 2
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiny_head(tiny_llama_dir, tmp_path_factory):
    head = tmp_path_factory.mktemp("adaptive") / "head"
    save_head(init_head(load_policy(tiny_llama_dir)), head)
    return head


@pytest.mark.slow
def test_engine_switches_k_at_run_time_and_adapts(tiny_llama_dir, tiny_head, in_process_engine_core, monkeypatch):
    """One engine: k=0 drafts nothing, k=2 drafts 2 per step, without a
    rebuild; the adaptive controller turns a useless draft off after one
    rollout and probes again after a draft refit."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from rayspec.draft.eagle3 import load_head, vllm_state_dict
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "eagle3", "num_speculative_tokens": 3,
                                              "model": str(tiny_head)},
                         dtype="float32", engine_kwargs=engine_kwargs(max_num_seqs=8),
                         env=cpu_engine_env(1, "all"), adaptive_k={"temperature": 1.0})
    try:
        # nothing timed at the start: the first rollout measures acceptance and a 3-draft step
        assert eng.adaptive.cost == StepCost(3) and eng.k_schedule == [(1, 8, 3)]
        eng.generate([[1, 2, 3, 4, 5, 6]], n=4, max_tokens=12)
        assert eng.adaptive.cost.known(3) and not eng.adaptive.cost.known(0)
        assert all(b in (1, 2, 3, 4) and 0 < t < 5 for b, t in eng.adaptive.cost.curves["3"])
        assert eng.k_schedule == [(1, 8, 0)]  # then a plain step's cost
        eng.generate([[1, 2, 3, 4, 5, 6]], n=4, max_tokens=12)
        assert eng.adaptive.cost.known(0) and "plain" in eng.adaptive.cost.curves
        measured = eng.adaptive.cost
        eng.generate([[1, 2, 3, 4, 5, 6]] * 4, max_tokens=12, temperature=0.0)  # greedy: not timed
        assert eng.adaptive.cost == measured
        prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
        rejection_calls = []
        forward = RejectionSampler.forward
        monkeypatch.setattr(RejectionSampler, "forward",
                            lambda *a, **kw: rejection_calls.append(1) or forward(*a, **kw))
        for k in (0, 2):
            eng.set_k_schedule(uniform(k, 8))
            rejection_calls.clear()
            _, stats = eng.generate(prompts, n=2, max_tokens=12)
            assert stats.k_schedule == [(1, 8, k)]
            assert stats.num_draft_tokens == k * stats.num_drafts
            assert (stats.num_drafts > 0) == (k > 0)
            # at k = 0 every step samples as a plain engine does (seen where
            # the engine core runs in this process: in_process_engine_core)
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                assert (len(rejection_calls) > 0) == (k > 0), (k, len(rejection_calls))
        # an untrained head accepts (almost) nothing: drafting costs more than it
        # gives (from here on the step costs are the test's: no call is timed)
        eng.adaptive.cost, eng._cost_temperature = grid([1, 8], 3, plain=[0.01, 0.02], spec=[0.02, 0.06]), None
        eng.adaptive.rates = []
        eng.set_k_schedule(eng.adaptive.schedule())
        _, stats = eng.generate(prompts, n=2, max_tokens=12)
        assert stats.k_schedule == [(1, 8, 3)] and stats.summary()["k_schedule"] == [[1, 8, 3]]
        assert eng.k_schedule == [(1, 8, 0)]
        eng.receive_refit("draft", vllm_state_dict(load_head(tiny_head)), 1)
        assert eng.k_schedule == [(1, 1, 3), (2, 8, 0)]
        # the DraftTrainer's estimate of draft 1 replaces the probe before the
        # rollout; an estimate of a draft this replica does not hold is ignored
        _, stats = eng.generate(prompts, n=2, max_tokens=12, draft_acceptance=(2, [0.9, 0.8, 0.7]))
        assert stats.k_schedule == [(1, 1, 3), (2, 8, 0)]
        _, stats = eng.generate(prompts, n=2, max_tokens=12, draft_acceptance=(1, [0.9, 0.8, 0.7]))
        assert stats.k_schedule == [(1, 2, 3), (3, 8, 2)] and stats.num_drafts > 0
        assert eng.k_schedule == [(1, 8, 0)]  # measured: the untrained head accepts nothing
        _, stats = eng.generate(prompts, n=2, max_tokens=12, draft_acceptance=(1, [0.9, 0.8, 0.7]))
        assert stats.k_schedule == [(1, 8, 0)]  # an estimate counts once per draft version
        # a fresh controller starts from the head's recorded acceptance
        # (jobs.warmstart_draft's held-out rates), extrapolated to k = 3, not
        # from k = 3 everywhere: rates that pay nowhere turn drafting off at once
        write_acceptance(tiny_head, [0.05, 0.01])
        try:
            eng.enable_adaptive(cost=eng.adaptive.cost)
            assert eng.adaptive.rates == pytest.approx([0.05, 0.01, 0.01 * geometric_rate([0.05, 0.01])])
            assert eng.k_schedule == [(1, 8, 0)]
            write_acceptance(tiny_head, [0.9, 0.8, 0.7])
            eng.enable_adaptive(cost=eng.adaptive.cost)
            assert eng.k_schedule[0][:1] + eng.k_schedule[0][2:] == (1, 3)  # k = 3 at one sequence
            eng.enable_adaptive(cost=eng.adaptive.cost, rates=[])  # measure first, as before
            assert eng.adaptive.rates == [] and eng.k_schedule == [(1, 8, 3)]
        finally:
            (tiny_head / "acceptance.json").unlink()
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_engine_without_schedule_refuses_to_switch(tiny_llama_dir, tiny_head, in_process_engine_core):
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "eagle3", "num_speculative_tokens": 2,
                                              "model": str(tiny_head)},
                         dtype="float32", engine_kwargs=engine_kwargs(max_num_seqs=4),
                         env=cpu_engine_env(1, "all"))
    try:
        with pytest.raises(Exception, match="without speculative_config.num_speculative_tokens_per_batch_size"):
            eng.set_k_schedule(uniform(0, 4))
    finally:
        eng.shutdown()


def test_drafting_reaches_past_the_batch_sizes_measured_one_bucket_at_a_time():
    """A k-draft step measured only in a rollout's tail (1-8 sequences) is
    drafted with up to twice that, even where its ratio to a plain step,
    carried past the last measurement, says it pays at 64 (on a CPU the
    ratio grows with the batch: a fresh run drafted at 4-64 sequences on a
    ratio of 1.06x from 1-8, and paid 2.8x at 29). The rollout that drafts
    there measures the next bucket, and drafting reaches further."""
    import math

    cost = StepCost(3, {"plain": [[1, 0.020], [8, 0.030], [64, 0.100]], "3": [[1, 0.022], [8, 0.033]]})
    assert cost.reach(3) == cost.reach(1) == 16 and cost.reach(0) == math.inf
    assert cost.seconds(64, 3) == pytest.approx(0.100 * 0.033 / 0.030)  # carried: it would pay there
    ctl = AdaptiveK(k_max=3, max_num_seqs=64, cost=cost, rates=[0.6, 0.4, 0.2])
    assert ctl.schedule() == [(1, 16, 3), (17, 64, 0)]
    cost.curves["3"].append([16, 0.05])
    assert cost.reach(3) == 32 and ctl.schedule() == [(1, 32, 3), (33, 64, 0)]


def test_a_rollout_without_a_tail_measures_where_it_runs_and_costs_outside_keep_their_ratio():
    """Where the last rollout's sequences all ran to the end together (no
    batch size at or below the measuring tail), the measuring rollout
    drafts at every batch size, or it would never measure a drafting step.
    Outside the batch sizes a kind was measured at, its cost keeps the
    nearest point's ratio to a plain step: a tail never measured costs the
    full batch's ratio, not the full batch's seconds."""
    ctl = AdaptiveK(k_max=3, max_num_seqs=32)
    ctl.observe([48] * 32)
    assert ctl.positions == {32: 48} and ctl.schedule() == [(1, 32, 3)]
    assert ctl.reason == "k 3 at 1-32 seqs: measuring the draft's acceptance"
    cost = StepCost(3, {"plain": [[1, 0.047], [16, 0.080]], "3": [[16, 0.228]]})
    assert cost.seconds(1, 3) == pytest.approx(0.047 * 0.228 / 0.080)
    assert StepCost(3, {"plain": [[16, 0.080]]}).seconds(1, 0) == pytest.approx(0.080)  # plain: the nearest
