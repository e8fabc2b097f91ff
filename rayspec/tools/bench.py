"""What the rollout benchmarks share (``jobs.bench_rollout``,
``jobs.bench_step``, ``jobs.bench_step_costs``): their argument parsing,
one timed cell of sequences on an engine, the untrained head a policy is
benchmarked with, and an engine's speculative config by the benchmarks'
method names."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any, NamedTuple

from rayspec.rollout.adaptive import uniform
from rayspec.rollout.engine import vllm_speculative_config


def ints(s: str) -> list[int]:
    """A comma-separated list of ints (an argparse type)."""
    return [int(x) for x in s.split(",") if x]


def floats(s: str) -> list[float]:
    """A comma-separated list of floats (an argparse type)."""
    return [float(x) for x in s.split(",") if x]


def draft_linear_dtypes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """``--draft-linear-dtype``'s comma-separated values; an unknown one
    ends the job through ``ap.error``, naming it (``rayspec.vllm.cpu_fixes.draft_linear_dtype``)."""
    from rayspec.config import DRAFT_LINEAR_DTYPE
    from rayspec.vllm.cpu_fixes import draft_linear_dtype

    values = [d for d in text.split(",") if d]
    for d in values:
        try:
            draft_linear_dtype({DRAFT_LINEAR_DTYPE: d}, None)
        except ValueError as e:
            ap.error(f"--draft-linear-dtype: {e}")
    return values


class Cell(NamedTuple):
    """One measured cell: vLLM's spec-decode counters, seconds per engine step
    (exact when every sequence runs to max_tokens), tokens/s, SHA-1 of the
    responses' token ids, response lengths (tokens)."""

    stats: Any
    step_s: float
    tokens_per_s: float
    digest: str
    response_lens: list[int]


def measure_cell(engine, prompts, conc: int, temperature: float, max_tokens: int, ignore_eos: bool) -> Cell:
    """Run ``conc`` sequences, sequence i on ``prompts[i % len(prompts)]``
    (see ``Cell``).

    Sequence i samples with seed i, so cells that stop at EOS draw the same
    responses wherever the engine samples the same way (no speculation, or a
    speculative engine at k = 0): their tokens/s differ by engine cost only,
    not by which sequences happened to run long."""
    from vllm import SamplingParams, TokensPrompt

    from rayspec.rollout.spec_stats import completion_stats

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos, seed=i)
              for i in range(conc)]
    batch = [TokensPrompt(prompt_token_ids=p) for p in (prompts * conc)[:conc]]
    t0 = time.perf_counter()
    outs = engine.llm.generate(batch, params)
    wall = time.perf_counter() - t0
    stats = completion_stats(outs, wall)
    tokens = stats.output_tokens
    # every engine step emits one token per sequence plus its accepted drafts;
    # vLLM also counts drafts accepted past max_tokens, so a cell a few tokens
    # long (a warm-up) can read no steps at all: at least one
    steps = max(tokens - stats.num_accepted_tokens, conc) / conc
    digest = hashlib.sha1(json.dumps([list(c.token_ids) for o in outs for c in o.outputs]).encode())
    return Cell(stats, wall / steps, tokens / wall, digest.hexdigest(),
                [len(c.token_ids) for o in outs for c in o.outputs])


def work_dir_for(work_dir: str, model_dir) -> Path:
    """The policy's folder under ``--work-dir`` (one per policy path), where
    its untrained head and truncated draft are made once."""
    return Path(work_dir) / hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:12]


def untrained_head(model_dir, work: Path) -> Path:
    """An untrained EAGLE-3 head for the policy, saved in ``work`` on first use."""
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy

    head = work / "untrained_head"
    if not (head / "config.json").is_file():
        save_head(init_head(load_policy(model_dir)), head)
    return head


def bench_speculative_config(method: str, draft_dir, kmax: int, max_seqs: int) -> dict | None:
    """A bench engine's ``speculative_config`` for ``method`` (``none``,
    ``eagle3``, ``eagle3-sampled``: drafts sampled from the head's q, accepted
    with min(1, p/q); ``draft_model``, ``ngram``, ``suffix``: the sequence's
    own text only; ``suffix-group``: also vLLM's window of other responses),
    through ``SpeculativeConfig`` as a run's: built with the largest k and a
    batch-size schedule, so k changes at run time; None for no speculation."""
    if method == "none":
        return None
    base = {"suffix-group": "suffix", "eagle3-sampled": "eagle3"}.get(method, method)
    keys = {"model": str(draft_dir)} if base in ("eagle3", "draft_model") else {}
    if method == "eagle3-sampled":
        keys["draft_sample_method"] = "probabilistic"
    if method == "ngram":
        keys.update(prompt_lookup_max=4, prompt_lookup_min=2)
    if method == "suffix":
        keys["suffix_decoding_max_cached_requests"] = 0
    spec = vllm_speculative_config(method=base, num_speculative_tokens=kmax, **keys)
    spec["num_speculative_tokens_per_batch_size"] = uniform(kmax, max_seqs)
    return spec
