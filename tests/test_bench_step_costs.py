"""jobs.bench_step_costs: adaptive k's step costs measured in rollouts
against the start-up calibration they replaced (the baseline it reproduces,
and its report)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs import bench_step_costs as bench
from rayspec.rollout.adaptive import StepTimes


def test_the_baseline_times_each_kind_from_an_empty_prefix_cache_and_keeps_the_median(monkeypatch):
    """The start-up calibration as rayspec ran it: (a long run - a 1-token
    run) / its steps, each run from an empty prefix cache (both must pay the
    same prefill), at T = 1 with logprobs, every kind once untimed first,
    the kinds in reverse order every other round, the median kept: a timing
    slowed 10x by another process (the second round's k = 3 run at 4
    sequences) does not move it."""
    step_s = {(0, None): 0.010, (0, False): 0.011, (1, None): 0.015, (3, None): 0.025}
    clock, state, timed, calls = [0.0], {}, [], []

    class LLM:
        def reset_prefix_cache(self):
            calls.append("reset")

        def generate(self, prompts, params):
            calls.append((len(prompts), params.max_tokens, params.temperature, params.logprobs))
            b, n, kind = len(prompts), params.max_tokens, (state["k"], state["idle"])
            if n > 1:
                timed.append((b, kind))
            slow = 10.0 if n > 1 and (b, kind) == (4, (3, None)) and timed.count((4, (3, None))) == 2 else 1.0
            clock[0] += 0.1 * b + (n - 1) * step_s[kind] * slow  # prefill, then the steps
            return []

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = SimpleNamespace(llm=LLM(), max_num_seqs=4,
                             set_k_schedule=lambda s, drafter_idle=None: state.update(k=s[0][2], idle=drafter_idle))
    cost = bench.calibrate(engine, 3, [1, 4], tokens=8, rounds=3)
    kinds = list(step_s)
    assert [kind for _, kind in timed[4:]] == kinds + kinds + kinds[::-1] * 2 + kinds * 2  # after the warm-up
    assert cost == {"plain": {1: pytest.approx(0.010), 4: pytest.approx(0.010)},
                    "sync": {1: pytest.approx(0.011), 4: pytest.approx(0.011)},
                    "1": {1: pytest.approx(0.015), 4: pytest.approx(0.015)},
                    "3": {1: pytest.approx(0.025), 4: pytest.approx(0.025)}}
    runs = [c for c in calls if c != "reset"]
    assert {c[2:] for c in runs} == {(1.0, 0)}
    assert calls == [x for r in runs for x in ("reset", r)]  # a reset before every run


def test_the_report_compares_each_methods_spread_over_rounds_and_the_pooled_rollouts(tmp_path):
    args = SimpleNamespace(k=3, batch_sizes=[1, 16])
    rounds = [{"calibration": {"plain": {1: 0.040, 16: 0.070}, "3": {1: 0.060, 16: 0.180}},
               "online": {"plain": {1: 0.041, 16: 0.072}, "3": {1: 0.062}}, "calibration_s": 120.0,
               "rollouts_s": 20.0},
              {"calibration": {"plain": {1: 0.044, 16: 0.070}, "3": {1: 0.075, 16: 0.190}},
               "online": {"plain": {1: 0.043, 16: 0.071}, "3": {1: 0.064}}, "calibration_s": 125.0,
               "rollouts_s": 21.0}]
    pooled = StepTimes(3)
    for kind, b, t in (("plain", 1, 0.042), ("plain", 16, 0.071), ("3", 1, 0.063)):
        pooled.add(kind, b, t)
    rows = bench.summarize(rounds, pooled, args)
    by = {(r["kind"], r["b"]): r for r in rows}
    assert by["plain", 1]["calibration_spread"] == pytest.approx(0.1)
    assert by["3", 1]["calibration_spread"] == pytest.approx(0.25) and by["3", 1]["online_spread"] == pytest.approx(
        1 / 31)
    assert by["3", 16]["online_ms"] == [] and by["3", 16]["online_pooled_ms"] == pytest.approx(63 * 71 / 42)
    table = bench.format_table(rows, rounds)
    assert "25.0%" in table and "start-up calibration 120-125" in table
    bench.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
