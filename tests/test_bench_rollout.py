"""jobs.bench_rollout on the tiny policy: every cell has the figures the
issue asks for, speedups are paired with the no-speculation cell of the same
round, the adaptive controller has its rollout cell, and a plot is written."""

from __future__ import annotations

import json

import pytest

from jobs.bench_rollout import parse_args


def test_quick_fills_only_what_is_not_given():
    a = parse_args(["--quick", "--concurrency", "1,2"])
    assert a.concurrency == [1, 2] and a.k == [1, 3] and a.methods == ["none", "eagle3", "ngram"]
    full = parse_args([])
    assert full.k == [1, 2, 3, 4, 5] and full.concurrency == [1, 8, 32, 128] and full.temperature == [1.0, 0.0]
    with pytest.raises(SystemExit):
        parse_args(["--methods", "none,medusa"])
    with pytest.raises(SystemExit):
        parse_args(["--fixed-group-size", "0"])


def test_fixed_cells_run_groups_on_fresh_prompts():
    from jobs.bench_rollout import fixed_cell_prompts

    grid = [(1.0, 1, 0), (1.0, 4, 0), (1.0, 4, 8), (1.0, 16, 8)]
    same = fixed_cell_prompts(10, grid, repeats=2, group_size=8, fresh=False)
    assert same[0, 1.0, 1, 0] == [0] and same[1, 1.0, 4, 8] == [0] * 4 and same[0, 1.0, 16, 8] == [0] * 8 + [1] * 8
    fresh = fixed_cell_prompts(10, grid, repeats=2, group_size=8, fresh=True)
    assert fresh[0, 1.0, 4, 0] == [1] * 4 and fresh[0, 1.0, 4, 8] == [2] * 4 and fresh[1, 1.0, 16, 8] == [8] * 8 + [9] * 8
    # no two cells share a problem, so a suffix-group engine drafts from no earlier answer to the same one
    used = [set(v) for v in fresh.values()]
    assert sum(map(len, used)) == len(set().union(*used)) == 10
    with pytest.raises(ValueError, match="10 prompts needed for the fixed cells, 9 available"):
        fixed_cell_prompts(9, grid, repeats=2, group_size=8, fresh=True)


def test_suffix_drafts_from_its_own_text_and_suffix_group_from_the_window(tmp_path):
    from rayspec.config import ConfigError
    from rayspec.tools.bench import bench_speculative_config

    own, group = (bench_speculative_config(m, None, 8, 32) for m in ("suffix", "suffix-group"))
    assert own["method"] == group["method"] == "suffix" and own["num_speculative_tokens"] == 8
    assert own["suffix_decoding_max_cached_requests"] == 0 and "suffix_decoding_max_cached_requests" not in group
    assert own["num_speculative_tokens_per_batch_size"] == [(1, 32, 8)]
    greedy, sampled = (bench_speculative_config(m, tmp_path, 3, 32) for m in ("eagle3", "eagle3-sampled"))
    assert greedy["method"] == sampled["method"] == "eagle3" and sampled["model"] == str(tmp_path)
    assert "draft_sample_method" not in greedy and sampled["draft_sample_method"] == "probabilistic"
    # built through SpeculativeConfig, as a run's: a k or a head directory it refuses, the bench refuses
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        bench_speculative_config("ngram", None, 17, 32)
    with pytest.raises(ConfigError, match="speculative_config.model"):
        bench_speculative_config("eagle3", tmp_path / "missing", 3, 32)


def test_table_columns_line_up_where_a_figure_is_missing():
    from jobs.bench_rollout import format_table

    cell = {"method": "none", "draft": "none", "shape": "fixed", "temperature": 1.0, "concurrency": 8, "k": 0,
            "tokens_per_s": 50.0, "speedup": 1.0, "acceptance_length": 1.0, "acceptance_rate": None,
            "cost_ratio": None, "physical_limit": None, "acceptance_rate_per_pos": []}
    spec = dict(cell, method="eagle3", k=1, acceptance_rate=0.5, cost_ratio=0.1, physical_limit=1.36,
                acceptance_rate_per_pos=[0.5])
    head, _, row0, row1 = format_table([cell, spec]).splitlines()
    assert row0.index("[") == row1.index("[") == head.index("accept/pos")


def _cell(method, conc, tps, speedup, k=0, **kw):
    return {"method": method, "draft": method, "shape": "fixed", "k": k, "concurrency": conc, "temperature": 1.0,
            "tokens_per_s": tps, "speedup": speedup, "wall_s": 1.0, "seconds_per_step": 1.0 / tps,
            "acceptance_length": 1.0, "acceptance_rate": None, "cost_ratio": None, "physical_limit": None,
            "acceptance_rate_per_pos": [0.0] * k, **kw}


def test_combine_rounds_takes_medians_of_paired_ratios():
    from jobs.bench_rollout import combine_rounds, plain_noise

    # the machine slows down 20% in round 2; the paired ratios do not see it
    rounds = [[_cell("none", 8, 100.0, 1.0), _cell("ngram", 8, 90.0, 0.9, k=1, acceptance_rate_per_pos=[0.4])],
              [_cell("none", 8, 80.0, 1.0), _cell("ngram", 8, 76.0, 0.95, k=1, acceptance_rate_per_pos=[0.5])],
              [_cell("none", 8, 90.0, 1.0), _cell("ngram", 8, 90.0, 1.0, k=1, acceptance_rate_per_pos=[0.6])]]
    none, ngram = combine_rounds(rounds)
    assert ngram["speedup"] == 0.95 and (ngram["speedup_min"], ngram["speedup_max"]) == (0.9, 1.0)
    assert ngram["tokens_per_s"] == 90.0 and ngram["tokens_per_s_runs"] == [90.0, 76.0, 90.0]
    assert ngram["acceptance_rate_per_pos"] == [0.5] and ngram["repeats"] == 3
    assert none["speedup"] == 1.0 and plain_noise([none, ngram]) == pytest.approx(20 / 90)
    assert "k_schedule_runs" not in ngram
    with pytest.raises(ValueError, match="ngram"):
        combine_rounds([rounds[0], rounds[1][:1]])


def test_eagle3_heads_share_an_engine_only_with_the_same_draft_vocabulary(tmp_path):
    from jobs.bench_rollout import engine_units

    heads = {}
    for name, vocab in (("untrained", None), ("full", 100), ("reduced", 10), ("reduced2", 10)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"vocab_size": 100, **({"draft_vocab_size": vocab} if vocab else {})}))
        heads[name] = d
    units = engine_units(["none", "eagle3", "draft_model"], heads, lambda: tmp_path / "trunc", 6)
    assert [(m, [n for n, _ in drafts]) for m, drafts in units] == [
        ("none", [""]), ("eagle3", ["untrained", "full"]), ("eagle3", ["reduced", "reduced2"]),
        ("draft_model", ["layers6"])]
    # one engine per drafter linear dtype, for EAGLE-3 engines only, its heads renamed where there are several
    from jobs.bench_rollout import with_draft_linear_dtypes

    key = "rayspec_draft_linear_dtype"
    both = with_draft_linear_dtypes(units[:2], ["float32", "auto"])
    assert [(m, [n for n, _ in drafts], extra) for m, drafts, extra in both] == [
        ("none", [""], {}), ("eagle3", ["untrained@float32", "full@float32"], {key: "float32"}),
        ("eagle3", ["untrained@auto", "full@auto"], {key: "auto"})]
    assert [drafts for _, drafts, _ in with_draft_linear_dtypes(units[1:2], ["auto"])] == [units[1][1]]


def test_refuses_bench_prompts_a_head_was_warm_started_on(tiny_llama_dir, gsm8k_dir, tmp_path, capsys):
    from jobs.bench_rollout import main
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy
    from rayspec.models.acceptance import write_acceptance

    head = save_head(init_head(load_policy(tiny_llama_dir)), tmp_path / "head")
    write_acceptance(head, [0.5, 0.2], data="gsm8k", train_prompts=[16, 2016])
    common = ["--model", str(tiny_llama_dir), "--data-path", str(gsm8k_dir), "--methods", "none,eagle3",
              "--eagle3", f"warm={head}", "--no-untrained-head", "--k", "2", "--concurrency", "1",
              "--repeats", "2", "--fresh-prompts", "--rollout-prompts", "0", "--out", str(tmp_path / "cells.json"),
              "--work-dir", str(tmp_path / "work")]
    assert main(common + ["--first-prompt", "2014"]) == 2
    err = capsys.readouterr().err
    assert "--first-prompt 2014: 2 of the bench's GSM8K train prompts (indices 2014-2015)" in err
    assert f"--eagle3 warm={head}" in err and not (tmp_path / "cells.json").exists()


@pytest.mark.slow
def test_bench_rollout_cells(tiny_llama_dir, gsm8k_dir, tmp_path, in_process_engine_core):
    from jobs.bench_rollout import main

    out = tmp_path / "cells.json"
    assert main(["--model", str(tiny_llama_dir), "--data-path", str(gsm8k_dir), "--methods", "none,eagle3,suffix-group",
                 "--k", "2", "--concurrency", "1,4", "--temperature", "1.0", "--max-tokens", "8", "--fixed-group-size", "2",
                 "--rollout-prompts", "2", "--group-size", "2", "--rollout-max-tokens", "16", "--repeats", "2",
                 "--out", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    cells = json.loads(out.read_text())
    for c in cells:
        for key in ("method", "k", "concurrency", "temperature", "tokens_per_s", "speedup",
                    "acceptance_length", "physical_limit"):
            assert key in c, (key, c)
        assert c["tokens_per_s"] > 0 and c["repeats"] == 2 and len(c["tokens_per_s_runs"]) == 2
        # rebuilt each round, the engines draw the same seeded responses and
        # the controller makes the same choice
        assert "responses_sha1_runs" not in c and "k_schedule_runs" not in c
    fixed = [c for c in cells if c["shape"] == "fixed"]
    assert {(c["method"], c["k"], c["concurrency"]) for c in fixed} == {
        ("none", 0, 1), ("none", 0, 4), *((m, k, c) for m in ("eagle3", "suffix-group") for k in (0, 2) for c in (1, 4))}
    none = {c["concurrency"]: c for c in fixed if c["method"] == "none"}
    for c in fixed:
        # median of two paired ratios: their mean, not the ratio of mean tokens/s
        paired = [t / n for t, n in zip(c["tokens_per_s_runs"], none[c["concurrency"]]["tokens_per_s_runs"])]
        assert c["speedup_runs"] == pytest.approx(paired) and c["speedup"] == pytest.approx(sum(paired) / 2)
        assert c["output_tokens"] == 8 * c["concurrency"]  # ignore_eos: constant concurrency
        if c["k"] == 0:  # a speculative engine at k = 0 samples as the plain one: the same responses
            assert c["acceptance_rate_per_pos"] == [] and c["acceptance_length"] == 1.0
            assert c["responses_sha1"] == none[c["concurrency"]]["responses_sha1"]
        if c["k"]:
            assert len(c["acceptance_rate_per_pos"]) == c["k"]
            assert c["physical_limit"] > 0 and c["cost_ratio"] is not None
        if c["k"] and c["method"] == "eagle3":
            # a head drafts at every decode step; only the prefill step's token comes without one
            assert 7 / 8 - 0.01 <= c["draft_fraction"] <= 1.0 and c["draft_length"] == 2
        if c["k"] and c["method"] == "suffix-group" and c["draft_length"] is not None:
            assert c["draft_length"] <= 2  # the scheduled k caps each suffix draft
    rollout = {(c["method"], c["draft"]): c for c in cells if c["shape"] == "rollout"}
    # adaptive k runs on the suffix engine too (its proposer takes the scheduled k)
    assert set(rollout) == {("none", "none"), ("eagle3", "untrained"), ("adaptive", "untrained"),
                            ("suffix-group", "suffix-group"), ("adaptive", "suffix-group")}
    rollout = {m: c for (m, d), c in rollout.items() if d != "suffix-group"}
    assert rollout["adaptive"]["k_schedule"] and rollout["adaptive"]["k"] == 2
    # an untrained head accepts nothing, so the controller turns speculation
    # off at every batch size; seeded per sequence, the adaptive rollout then
    # draws exactly the responses of the plain engine
    assert rollout["adaptive"]["k_schedule"] == "1-4:0"
    assert rollout["adaptive"]["responses_sha1"] == rollout["none"]["responses_sha1"]
    assert rollout["eagle3"]["responses_sha1"] != rollout["none"]["responses_sha1"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
