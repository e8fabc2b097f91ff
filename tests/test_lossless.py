"""Speculative sampling is lossless on this engine build: chi-square tests
against a policy whose next-token distributions are known exactly.

The fast tests check the statistics (calibrated under an exact sampler, with
power against known sampler bugs); the slow ones run ``jobs.check_lossless``
on real vLLM engines: every draft kind in-process at T=1.0, and the EAGLE-3
rollout Serve app an RL run uses at T=1.0 and 0.7. The full matrix (every
kind at both temperatures, through Serve) is in docs/lossless.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rayspec.tools import lossless

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chain():
    """(logits [32, 32], p at T=1, q: a perturbed draft at T=1)."""
    logits = lossless.markov_logits()
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return logits, torch.softmax(logits, -1).numpy(), torch.softmax(logits + noise, -1).numpy()


def _spec_sample(p, q, rng, mode="residual", seqs=1000, length=100, k=3):
    first = rng.integers(1, p.shape[0] - 1, size=seqs)
    out = lossless.reference_speculative_sample(p, q, first, k, length, rng, mode)
    return lossless.transition_counts([[f] for f in first], out, p.shape[0])


def test_markov_llama_samples_the_chain(tmp_path, chain):
    from rayspec.models import make_markov_llama

    logits, p, _ = chain
    d = make_markov_llama(tmp_path / "m", logits)
    # equal up to fp32 weights and the final norm's epsilon; the tests take
    # their exact distribution from the saved model itself
    assert np.abs(lossless.transition_probs(d, 1.0) - p).max() < 1e-4
    p07 = torch.softmax(logits / 0.7, -1).numpy()
    assert np.abs(lossless.transition_probs(d, 0.7) - p07).max() < 1e-4
    # the next token depends on the last one only, whatever came before
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    with torch.no_grad():
        long = model(torch.tensor([[4, 9, 17, 2, 30, 11]])).logits[0, -1]
        short = model(torch.tensor([[11]])).logits[0, -1]
    assert torch.allclose(long, short, atol=1e-9)
    with pytest.raises(ValueError, match="V <= 64"):
        make_markov_llama(tmp_path / "big", torch.zeros(65, 65))


def test_counts_and_continuation_probs(chain):
    _, p, _ = chain
    counts = lossless.transition_counts([[1, 2, 3], [4]], [[5, 3, 5], [3]], 8)
    assert counts[3, 5] == 2 and counts[5, 3] == 1 and counts[4, 3] == 1 and counts.sum() == 4
    cont = lossless.continuation_probs(p, 5, 2)
    assert cont.shape == (1, 32 ** 2) and abs(cont.sum() - 1) < 1e-12
    assert np.isclose(cont[0, 7 * 32 + 9], p[5, 7] * p[7, 9])
    # a response that stopped on EOS (token V-1) lands in an EOS-padded cell
    c = lossless.continuation_counts([[7, 9, 2], [7, 31]], 32, 3)
    assert c[0, (7 * 32 + 9) * 32 + 2] == 1 and c[0, (7 * 32 + 31) * 32 + 31] == 1


def test_gof_is_calibrated_under_exact_sampling(chain):
    """300 exact multinomial samples: the false-alarm rate at alpha = 0.01 is
    about 0.01, p-values are about uniform, and TV never passes its bound."""
    _, p, _ = chain
    rng = np.random.default_rng(0)
    rows = rng.multinomial(100_000, np.full(32, 1 / 32))
    results = [lossless.gof_test(np.stack([rng.multinomial(n, pi) for n, pi in zip(rows, p)]), p)
               for _ in range(300)]
    pvals = np.array([r.p_value for r in results])
    assert (pvals <= 0.01).mean() <= 0.03
    assert 0.4 < pvals.mean() < 0.6
    assert all(r.tv <= r.tv_bound for r in results)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_speculative_sampler_passes(chain, temperature):
    logits, _, _ = chain
    p = torch.softmax(logits / temperature, -1).numpy()
    q = torch.softmax((logits + 1.0) * torch.rand(logits.shape, generator=torch.Generator().manual_seed(2),
                                                  dtype=torch.float64) / temperature, -1).numpy()
    r = lossless.gof_test(_spec_sample(p, q, np.random.default_rng(1)), p)
    assert r.passed and r.tokens == 100_000, r


def test_gof_has_power_against_biased_samplers(chain):
    """100k tokens reject resampling from p after a rejection (instead of the
    residual max(0, p - q)) and a sampler at temperature 1.05 instead of 1."""
    logits, p, q = chain
    rng = np.random.default_rng(3)
    biased = lossless.gof_test(_spec_sample(p, q, rng, mode="target"), p)
    assert not biased.passed and biased.p_value < 1e-6 and biased.tv > biased.tv_bound
    warm = torch.softmax(logits / 1.05, -1).numpy()
    r = lossless.gof_test(_spec_sample(warm, warm, rng), p)
    assert not r.passed and r.p_value < 1e-6
    # the sequence-level homogeneity test tells the biased sampler from an exact one
    first = np.full(16_000, 5)
    exact = lossless.reference_speculative_sample(p, q, first, 3, 3, rng)
    again = lossless.reference_speculative_sample(p, q, first, 3, 3, rng)
    bad = lossless.reference_speculative_sample(p, q, first, 3, 3, rng, "target")
    cc = lambda r: lossless.continuation_counts(r, 32, 3)  # noqa: E731
    assert lossless.homogeneity_test(cc(exact), cc(again)).passed
    assert lossless.homogeneity_test(cc(exact), cc(bad)).p_value < 1e-6


def test_gof_flags_samples_outside_the_support(chain):
    _, p, _ = chain
    rng = np.random.default_rng(4)
    counts = np.stack([rng.multinomial(3000, pi) for pi in p])
    zero = int(np.argmin(p[3]))
    counts[3, zero] += 1
    r = lossless.gof_test(counts, p)
    assert r.outside_support == 1 and not r.passed
    with pytest.raises(ValueError, match="shape"):
        lossless.gof_test(counts[:2], p)


@pytest.mark.parametrize("argv,message", [
    (["--cases", "none,bogus"], "--cases: unknown ['bogus']"),
    (["--temperature", "1.0,0"], "every temperature must be > 0"),
    (["--sequences", "20000"], "--sequences=20000"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    from jobs import check_lossless

    with pytest.raises(SystemExit) as e:
        check_lossless.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def _run_check(tmp_path, *argv) -> list[dict]:
    out = tmp_path / "lossless.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.check_lossless", "--out", str(out), *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    table = proc.stdout[proc.stdout.find("case "):]
    print(table)
    assert proc.returncode == 0, f"{table}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_draft_kind_is_lossless_in_vllm(tmp_path):
    """No speculation, draft = target (greedy: one-hot q), a disjoint draft,
    a perturbed sampled draft (full q), sampled drafts of an EAGLE-3 head with
    a reduced draft vocabulary (q = 0 off it), n-gram, suffix, and EAGLE-3 on
    a LoRA replica (against the adapted chain): 60k tokens each at
    T=1.0 and 2000 3-token continuations pass; the unpatched engine fails on
    10k. (q = p sampled, and 100k tokens a case, are in the full run,
    docs/lossless.md.)"""
    from rayspec.vllm.cpu_fixes import needs_patch

    rows = _run_check(tmp_path, "--via", "engine", "--temperature", "1.0", "--tokens", "60000",
                      "--sequences", "2000", "--cases",
                      "none,draft_target,disjoint,perturbed_probabilistic,eagle3_probabilistic,ngram,suffix,"
                      "eagle3_lora,unpatched")
    by = {(r["case"], r["test"]): r for r in rows}
    assert len(by) == 18
    for (case, test), r in by.items():
        assert r["tokens"] >= (60_000 if test == "token" else 2000) or case == "unpatched", r
        assert r["family_alpha"] == 0.01 and r["via"] == "engine"
        assert r["passed"] == (case != "unpatched" or not needs_patch()), r
        if test == "sequence" and case not in ("none", "eagle3_lora"):  # a LoRA replica samples another chain
            assert "vs_none_p_value" in r
    assert by[("none", "token")]["draft_tokens"] == 0
    for case in ("draft_target", "disjoint", "perturbed_probabilistic", "eagle3_probabilistic", "ngram", "suffix",
                 "eagle3_lora"):
        assert by[(case, "token")]["draft_tokens"] > 10_000, case  # the case did speculate
    assert by[("draft_target", "token")]["acceptance_length"] > 1.5
    assert by[("disjoint", "token")]["acceptance_length"] == 1.0  # every draft rejected
    if needs_patch():
        assert by[("unpatched", "token")]["p_value"] < 1e-6


@pytest.mark.slow
def test_eagle3_rollout_app_is_lossless(tmp_path):
    """The path RL rollouts take: a Serve replica of the rollout app with a
    fresh EAGLE-3 head, T=0.7 (the sampler's temperature path; T=1.0 is
    ``test_every_draft_kind_…``'s), 60k tokens and 2000 continuations, as
    that test's cases (100k and 16000: docs/lossless.md's full run)."""
    rows = _run_check(tmp_path, "--via", "serve", "--cases", "eagle3", "--temperature", "0.7",
                      "--tokens", "60000", "--sequences", "2000")
    assert {(r["temperature"], r["test"]) for r in rows} == {(0.7, "token"), (0.7, "sequence")}
    for r in rows:
        assert r["passed"] and r["via"] == "serve" and r["draft_tokens"] > 10_000, r


def test_greedy_compare_finds_the_first_differing_token():
    from jobs.check_greedy import compare

    assert compare([[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 2, 3], [4, 9], [6, 7]]) == (1, [1, 2])


@pytest.mark.slow
def test_greedy_continuations_with_and_without_speculation(tmp_path, tiny_llama_dir, gsm8k_dir):
    """fp32 greedy on GSM8K prompts: each draft kind's continuations are
    compared token by token with plain decoding's (the tiny model's peaked
    distributions leave no near-ties, so they match)."""
    out = tmp_path / "greedy.json"
    proc = subprocess.run([sys.executable, "-m", "jobs.check_greedy", "--model", str(tiny_llama_dir),
                           "--data-path", str(gsm8k_dir), "--prompts", "8", "--max-tokens", "32",
                           "--draft-layers", "4", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"none (batch 1)", "eagle3", "draft_model", "ngram"}
    for r in rows.values():
        assert r["prompts"] == 8 and len(r["first_diff"]) == 8 - r["identical"]
        assert r["identical_rate"] >= 0.75, r
    assert rows["ngram"]["acceptance_length"] > 1.0  # the speculative engines did speculate
