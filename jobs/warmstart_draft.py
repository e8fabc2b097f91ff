"""In-domain EAGLE-3 warm start: ``python -m jobs.warmstart_draft --out DIR [preset.yaml] [key=value ...]``.

    python -m jobs.warmstart_draft --out runs/warm data.name=gsm8k data.path=../shared/data/gsm8k \\
        --train-prompts 256 --samples 4 --eval-every 100

1. The policy (``model.path``) samples ``--samples`` responses to each of
   ``--train-prompts`` prompts of ``data.*``, those after the first
   ``--heldout-prompts`` (held out), at temperature ``grpo.temperature`` up
   to ``grpo.max_new_tokens`` on a plain vLLM engine (no drafts: an untrained
   head only slows generation down).
2. The head: ``rollout.speculative_config.model`` when given, else a new one
   whose draft vocabulary is the ``draft.draft_vocab_size`` most frequent
   tokens of those responses (their coverage, and the held-out responses',
   go to ``result.json``). Acceptance length on the held-out prompts with
   the head as it is ("before").
3. Optimizer steps of ``eagle3_loss`` (``draft.ttt_steps``,
   ``draft.tv_loss_weight``) on the verifier's features of the generated
   samples (``rayspec.draft.warmstart``), peak learning rate ``draft.lr``
   (null: 1e-3) with warmup and cosine decay over ``--steps``. Every ``--eval-every``
   steps the head is loaded into the same engine (refit) and held-out
   acceptance length is measured at the RL temperature and greedily, with
   the drafts the run will make
   (``rollout.speculative_config.draft_sample_method``: greedy drafts cap a
   position's acceptance at E[max p] at T = 1, sampled ones do not, so early
   stopping on greedy drafts stops where only they saturate); training stops
   once it has not improved by ``--min-delta`` for ``--patience``
   evaluations (early stopping), or at ``--steps``. The best evaluation is
   the result ("after").

``DIR`` holds ``corpus.jsonl``, ``draft_head/`` (the best head: load it with
``rollout.speculative_config.model=DIR/draft_head``; its ``acceptance.json``
holds the "after" rates, where adaptive speculation starts from, and
``final_lr``, the rate of the best head's last step, which online training
continues at), ``best_head/`` (the best head so far, with its
``acceptance.json`` from the evaluation that made it the best: while a warm
start runs, or after one was interrupted, ``draft_head/`` is the last saved
training step's head and has no record, so load ``best_head/``), the
optimizer state, ``result.json`` (every evaluation under ``history``) and
``acceptance.png`` (held-out acceptance length against training tokens).
Re-running with the same ``DIR`` resumes: the corpus is reused (a larger
``--train-prompts`` grows it; the draft vocabulary stays the one chosen
first), training continues from the saved step, and ``--steps`` is the
total; a run that stopped early stays stopped. The learning-rate schedule
is a function of the step and ``--steps``, so a larger ``--steps`` on
resume stretches it: the rate jumps back up to the stretched schedule's
(a warm restart: 0.1x to 0.69x the peak going from 600 to 1400 steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from jobs.cli import split_args
from rayspec.config import ConfigError, load_config
from rayspec.draft.warmstart import HEAD, WarmStartOptions


def parse_args(argv):
    defaults = WarmStartOptions()
    ap = argparse.ArgumentParser(prog="python -m jobs.warmstart_draft", description=__doc__.split("\n\n")[0],
                                 epilog="the positional arguments are a preset and key=value config overrides, "
                                        "as for jobs.grpo (python -m jobs.grpo --help lists them)")
    ap.add_argument("--out", required=True, help="output directory (resumable)")
    ap.add_argument("--train-prompts", type=int, default=defaults.train_prompts)
    ap.add_argument("--heldout-prompts", type=int, default=defaults.heldout_prompts)
    ap.add_argument("--samples", type=int, default=defaults.samples, help="responses per training prompt")
    ap.add_argument("--heldout-samples", type=int, default=defaults.heldout_samples,
                    help="responses per held-out prompt")
    ap.add_argument("--steps", type=int, default=defaults.steps,
                    help="most optimizer steps in total (the learning-rate schedule's length)")
    ap.add_argument("--eval-every", type=int, default=defaults.eval_every,
                    help="steps between held-out evaluations (0: once, at --steps)")
    ap.add_argument("--patience", type=int, default=defaults.patience,
                    help="evaluations without improvement before training stops")
    ap.add_argument("--min-delta", type=float, default=defaults.min_delta,
                    help="held-out acceptance length gain that counts as improvement")
    ap.add_argument("--micro-batch", type=int, default=defaults.micro_batch, help="samples per optimizer step")
    ap.add_argument("--save-every", type=int, default=defaults.save_every)
    ap.add_argument("--feature-cache-gib", type=float, default=defaults.feature_cache_gib,
                    help="host memory for the verifier features of training micro-batches (GiB); "
                         "those past it are recomputed each epoch")
    ap.add_argument("config", nargs="*", help="[preset.yaml] key=value overrides")
    args = ap.parse_intermixed_args(argv)
    options = WarmStartOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WarmStartOptions)})
    return args, options


def main(argv: list[str] | None = None) -> int:
    args, options = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        preset, overrides = split_args(args.config)
        cfg = load_config(preset, overrides + ["rollout.speculative_config.method=eagle3"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s: %(message)s")
    from rayspec.draft.warmstart import warm_start

    try:
        result = warm_start(cfg, args.out, options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    held, k = result["heldout_prompts"], result["k"]
    print(f"{'':<8}{'acc len':>9}{'tok/s':>8}  accept/pos   (held-out: {held} prompts x "
          f"{options.heldout_samples}, T={cfg.grpo.temperature}, k={k})")
    for name in ("before", "after"):
        r = result[name]
        rates = ",".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"])
        print(f"{name:<8}{r['acceptance_length']:>9.2f}{r['tokens_per_s']:>8.1f}  [{rates}]")
    trained = result["train"]
    print(f"head: {args.out}/{HEAD}  (step {result['best']['step']} of {trained['steps']}, "
          f"{trained['train_tokens']} training tokens, {result['train_seconds']:.0f} s; "
          f"{result.get('stopped') or 'ran to --steps'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
