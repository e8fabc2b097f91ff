"""Engine-step benchmark: where one decode step's time goes, plain and
speculative, next to the performance model's t(b, k).

    python -m jobs.bench_step [--methods eagle3] [--concurrency 1,8,32] [--k 0,1,3]
        [--max-tokens 64] [--prompt-len 100] [--eagle3 DIR] [--data-path DIR]
        [--hardware cpu] [--out bench_step.json]

One engine per method, in ``--methods`` order (``none``: no speculation;
``eagle3``: an untrained head unless ``--eagle3`` names one, a head's cost
does not depend on its training; ``eagle3-sampled``: the same head drafting
by sampling (``draft_sample_method: probabilistic``); ``suffix`` / ``suffix-group``: vLLM's
suffix decoding over the sequence's own text / also the engine's window of
responses, as ``jobs.bench_rollout`` builds them), runs its engine core in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so vLLM's model runner
can be timed. Each cell runs ``concurrency`` prompts to ``--max-tokens`` new
tokens (ignore_eos: the concurrency holds) at temperature 1 with k fixed at
every batch size: synthetic prompts of ``--prompt-len`` tokens, or with
``--data-path`` GSM8K chat prompts from ``--first-prompt`` in GRPO groups of
``--group-size`` (what a suffix drafter matches depends on the text). On
EAGLE-3, k = 0 idles the drafter and samples with the plain sampler
(``rayspec.rollout.adaptive``), so it is a plain step; a suffix drafter
still adds each step's tokens to its tree at k = 0. Per decode step (no
prompt tokens scheduled), in ms:

- ``target``: ``GPUModelRunner.execute_model``: the target's forward over
  b (1 + k) query tokens, its LM head and input preparation;
  ``forward`` is the transformer body alone (``_model_forward``);
- ``sampler``: ``_sample``: the plain sampler, or the rejection sampler
  (Leviathan et al. 2023) with drafts;
- ``drafter``: the drafter's k passes (``SpecDecodeBaseProposer.propose``),
  or the suffix tree's update and match (``SuffixDecodingProposer.propose``);
- ``step``: ``execute_model`` + ``sample_tokens``, everything the worker does.

Also per cell: the measured acceptance length E and f, the share of
sequence-steps that carried a draft (for EAGLE-3 at k > 0 all but the
prefill's; for suffix those with a match). Beside them, for plain and
EAGLE-3 cells, the model's t(b, k) and target forward
(``rayspec.perfmodel.simulate``, preset ``--hardware``) at the cell's mid
context and measured E. The timers wrap private methods of vLLM 0.32's
model runner; another version may lack them (the job then names the
missing one).

Prints a table and writes JSON (``--out``: a list of cells). Run it twice with
the methods in reverse order to see this machine's drift.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from unittest import mock

from rayspec.tools.bench import (bench_speculative_config, draft_linear_dtypes, ints, measure_cell,
                                 untrained_head, work_dir_for)

METHODS = ("none", "eagle3", "eagle3-sampled", "suffix", "suffix-group")
MODELLED = ("none", "eagle3")  # what rayspec.perfmodel models a step of


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", type=lambda v: v.split(","), default=["eagle3"],
                    help=f"engines, in this order, of {', '.join(METHODS)}")
    ap.add_argument("--eagle3", help="an EAGLE-3 head directory (default: an untrained head)")
    ap.add_argument("--draft-linear-dtype", default="auto",
                    help="vLLM additional_config.rayspec_draft_linear_dtype of the EAGLE-3 engines; several, "
                         "comma-separated: one engine each, in that order, named method@dtype")
    ap.add_argument("--concurrency", type=ints, default=[1, 8, 32])
    ap.add_argument("--k", type=ints, default=[0, 1, 3])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--data-path", help="GSM8K directory: its chat prompts instead of synthetic ones")
    ap.add_argument("--first-prompt", type=int, default=1000, help="first GSM8K train problem used")
    ap.add_argument("--group-size", type=int, default=8, help="samples per GSM8K prompt (a GRPO group)")
    ap.add_argument("--hardware", default="cpu", help="performance-model preset for the model columns")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--out", default="bench_step.json")
    ap.add_argument("--work-dir", default="/tmp/rayspec-bench-rollout",
                    help="the untrained head goes here (one folder per policy, shared with jobs.bench_rollout)")
    args = ap.parse_args(argv)
    from rayspec.perfmodel import hardware

    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        ap.error(f"--methods: {','.join(bad) or 'none given'}, expected some of {', '.join(METHODS)}")
    if max(args.k) < 1 and set(args.methods) - {"none"}:
        ap.error(f"--k: {','.join(map(str, args.k))}: a speculative engine is built with the largest k, "
                 "which must be >= 1")
    if args.group_size < 1:
        ap.error(f"--group-size: {args.group_size}, expected >= 1")
    args.draft_linear_dtype = draft_linear_dtypes(ap, args.draft_linear_dtype)

    try:
        hardware.get(args.hardware)
    except ValueError as e:
        ap.error(str(e))
    return args


def _model_row(eng, b: int, k: int, e: float, prompt_len: int, max_tokens: int) -> dict:
    """The performance model's step and target forward (ms) for a cell."""
    ctx = b * (prompt_len + max_tokens / 2)
    return {"model_step_ms": 1e3 * eng.step_seconds(b, ctx, k, e, drafter_idle=k == 0),
            "model_forward_ms": 1e3 * eng.forward_seconds(eng.target, b * (1 + k), ctx, 1 + k)}


def format_table(cells: list[dict]) -> str:
    cols = ("method", "concurrency", "k", "acceptance_length", "draft_fraction", "step_ms", "target_ms",
            "forward_ms", "sampler_ms", "drafter_ms", "model_step_ms", "model_forward_ms")
    lines = ["method          b  k      E     f   step  target forward sampler drafter | model: step forward"]
    for c in cells:
        row = [c[key] for key in cols]
        lines.append("{:<12} {:>4} {:>2} {:>6.2f} {:>5.2f} {:>6.1f} {:>7.1f} {:>7.1f} {:>7.1f} {:>7.1f} | ".format(
            *row[:10]) + " ".join("{:>11}".format("-") if v is None else "{:>11.1f}".format(v) for v in row[10:]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from rayspec.models import resolve_model_path

    model_dir = resolve_model_path(args.model, args.cache_dir)
    head = None
    if args.eagle3:
        head = Path(args.eagle3)
        if not (head / "config.json").is_file():
            raise SystemExit(f"error: --eagle3 {args.eagle3}: no EAGLE-3 head there (config.json)")
    elif {"eagle3", "eagle3-sampled"} & set(args.methods):
        head = untrained_head(model_dir, work_dir_for(args.work_dir, model_dir))
    try:
        prompts = _prompts(args, model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: --data-path {args.data_path}: {e}") from None
    # the timers patch the model runner in this process, so the engine core
    # must run here; the caller's environment is restored afterwards
    with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        cells = [c for m in args.methods
                 for d in (args.draft_linear_dtype if m.startswith("eagle3") else [None])
                 for c in _run(args, model_dir, m, head, prompts, d)]
    print(format_table(cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(cells, indent=1))
    print(f"wrote {args.out}")
    return 0


def _prompts(args, model_dir) -> list[list[int]]:
    """Token ids of the largest cell's prompts (a cell of b sequences runs the
    first b): synthetic, or GSM8K chat prompts, each ``--group-size`` times
    in a row.

    Raises:
        FileNotFoundError, ValueError: ``--data-path`` has no GSM8K train
            split, or too few problems after ``--first-prompt``.
    """
    b = max(args.concurrency)
    if not args.data_path:
        return [[100 + (7 * i + j) % 3000 for j in range(args.prompt_len)] for i in range(b)]
    from rayspec.data import prompt_ids, load_gsm8k
    from rayspec.models import load_tokenizer

    groups = -(-b // args.group_size)
    problems = load_gsm8k(args.data_path, "train")[args.first_prompt:args.first_prompt + groups]
    if len(problems) < groups:
        raise ValueError(f"{groups} problems needed from --first-prompt {args.first_prompt}, "
                         f"{len(problems)} there")
    tok = load_tokenizer(model_dir)
    return [prompt_ids(tok, p) for p in problems for _ in range(args.group_size)][:b]


def _run(args, model_dir, method: str, head: Path | None, prompts: list[list[int]],
         draft_linear_dtype: str | None) -> list[dict]:
    """One engine's cells: every concurrency x k (k = 0 only for ``none``)."""
    from tqdm import tqdm

    from rayspec.model_shape import ModelShape
    from rayspec.perfmodel import hardware
    from rayspec.perfmodel.simulate import Engine
    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from rayspec.config import DRAFT_LINEAR_DTYPE
    from rayspec.vllm.engine_access import step_timers

    target = ModelShape.from_hf_config(str(model_dir))
    model = Engine(target, hardware.get(args.hardware), "eagle3", target.eagle3_head())
    max_seqs = max(args.concurrency)
    spec = bench_speculative_config(method, head, max(args.k), max_seqs)
    engine = SpecVLLMEngine(str(model_dir), spec, dtype=args.dtype, env=cpu_engine_env(args.kv_cache_gib, "all"),
                            engine_kwargs={"enforce_eager": True, "max_num_seqs": max_seqs, "seed": 0,
                                           "max_model_len": max(map(len, prompts)) + args.max_tokens + 16,
                                           "enable_prefix_caching": False,
                                           "additional_config": {DRAFT_LINEAR_DTYPE: draft_linear_dtype}
                                           if draft_linear_dtype else {}})
    label = f"{method}@{draft_linear_dtype}" if draft_linear_dtype and len(args.draft_linear_dtype) > 1 else method
    prompt_len = sum(map(len, prompts)) / len(prompts)
    cells = []
    try:
        for b in tqdm(args.concurrency, desc=f"{label}: concurrency", disable=None):
            for k in (args.k if spec else [0]):
                if spec:
                    engine.set_k_schedule(uniform(k, max_seqs))
                measure_cell(engine, prompts[:b], b, 1.0, 4, ignore_eos=True)  # warm-up at this shape, untimed
                with step_timers(k) as acc:
                    cell = measure_cell(engine, prompts[:b], b, 1.0, args.max_tokens, ignore_eos=True)
                steps = acc["target"][1]
                ms = {name: 1e3 * acc[name][0] / max(steps, 1) for name in ("target", "forward", "sampler", "sample_tokens", "drafter")}
                s = cell.stats
                e = s.acceptance_length if k else 1.0
                f = s.num_drafts / max(s.output_tokens - s.num_accepted_tokens, 1) if k else 0.0
                cells.append({"method": label, "concurrency": b, "k": k, "acceptance_length": e,
                              "draft_fraction": f, "decode_steps": steps,
                              "step_ms": ms["target"] + ms["sample_tokens"], "target_ms": ms["target"],
                              "forward_ms": ms["forward"], "sampler_ms": ms["sampler"], "drafter_ms": ms["drafter"],
                              **(_model_row(model, b, k, e, prompt_len, args.max_tokens) if method in MODELLED
                                 else {"model_step_ms": None, "model_forward_ms": None})})
    finally:
        engine.shutdown()
    return cells


if __name__ == "__main__":
    raise SystemExit(main())
