"""jobs.bench_step on the tiny policy: decode steps are timed part by part,
plain (k = 0, drafter idle) and speculative, beside the model's t(b, k), for
an EAGLE-3 and a suffix engine."""

from __future__ import annotations

import json


def test_bench_step_times_each_part_of_a_decode_step(tiny_llama_dir, tmp_path, in_process_engine_core):
    from jobs.bench_step import main

    out = tmp_path / "step.json"
    assert main(["--model", str(tiny_llama_dir), "--methods", "eagle3,suffix", "--concurrency", "2",
                 "--k", "0,2", "--max-tokens", "8", "--prompt-len", "12", "--out", str(out),
                 "--work-dir", str(tmp_path / "work")]) == 0
    plain, spec, suffix0, suffix2 = json.loads(out.read_text())
    assert [(c["method"], c["k"]) for c in (plain, spec, suffix0, suffix2)] == \
        [("eagle3", 0), ("eagle3", 2), ("suffix", 0), ("suffix", 2)]
    assert (plain["k"], spec["k"]) == (0, 2)
    for c in (plain, spec):
        # 8 tokens per sequence: the first comes with the prefill, which is not a decode step
        assert 1 <= c["decode_steps"] <= 7
        assert 0 < c["forward_ms"] < c["target_ms"] < c["step_ms"] and c["sampler_ms"] > 0
        assert c["model_step_ms"] > 0 and c["model_forward_ms"] > 0
    # k = 0 idles the drafter (its propose returns at once); with drafts it runs k passes a step
    assert 0 <= plain["drafter_ms"] < 0.2 * spec["drafter_ms"]
    assert plain["acceptance_length"] == 1.0 and spec["acceptance_length"] >= 1.0
    assert 0.5 < spec["draft_fraction"] <= 1.0 and plain["draft_fraction"] == 0.0  # the prefill token has no draft
    # the suffix drafter is not idled at k = 0: it still adds each step's tokens to its tree
    assert suffix0["drafter_ms"] > 0 and suffix0["acceptance_length"] == 1.0
    assert 0.0 <= suffix2["draft_fraction"] <= 1.0 and suffix2["step_ms"] > suffix2["drafter_ms"] > 0
    assert suffix0["model_step_ms"] is None  # the performance model has no suffix drafter


def test_bench_step_names_a_bad_drafter_linear_dtype(capsys):
    import pytest

    from jobs.bench_step import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--draft-linear-dtype", "float32,fp16"])
    assert "--draft-linear-dtype: additional_config.rayspec_draft_linear_dtype: 'fp16'" in capsys.readouterr().err
