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
import json
import logging
import sys
import time
from pathlib import Path

from rayspec.config import DEFAULT_DRAFT_LR, DEFAULT_DRAFT_SAMPLE_METHOD, ConfigError, load_config

DEFAULT_PRESET = Path(__file__).parent / "configs" / "default.yaml"
GENERATE_CHUNK = 128  # prompts per engine call while the corpus is generated


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m jobs.warmstart_draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (resumable)")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--heldout-prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="responses per training prompt")
    ap.add_argument("--heldout-samples", type=int, default=4, help="responses per held-out prompt")
    ap.add_argument("--steps", type=int, default=2000,
                    help="most optimizer steps in total (the learning-rate schedule's length)")
    ap.add_argument("--eval-every", type=int, default=100,
                    help="steps between held-out evaluations (0: once, at --steps)")
    ap.add_argument("--patience", type=int, default=3,
                    help="evaluations without improvement before training stops")
    ap.add_argument("--min-delta", type=float, default=0.01,
                    help="held-out acceptance length gain that counts as improvement")
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per optimizer step")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--feature-cache-gib", type=float, default=4.0,
                    help="host memory for the verifier features of training micro-batches (GiB); "
                         "those past it are recomputed each epoch")
    args, rest = ap.parse_known_args(argv)
    preset = DEFAULT_PRESET
    if rest and rest[0].endswith((".yaml", ".yml")):
        preset = Path(rest.pop(0))
    unknown = [a for a in rest if "=" not in a]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, preset, rest


def acceptance(engine, prompts: list[list[int]], n: int, cfg,
               temperature: float | None = None) -> tuple[dict, list[list[int]]]:
    """(acceptance figures of ``n`` samples of each prompt at ``temperature``
    (None: the RL temperature), their response ids)."""
    batch, stats = engine.generate(prompts, n=n, max_tokens=cfg.grpo.max_new_tokens,
                                   temperature=cfg.grpo.temperature if temperature is None else temperature)
    return {"acceptance_length": stats.acceptance_length,
            "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
            "tokens_per_s": stats.tokens_per_s, "output_tokens": stats.output_tokens}, batch.response_ids


def main(argv: list[str] | None = None) -> int:
    args, preset, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(preset, overrides + ["rollout.speculative_config.method=eagle3"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s: %(message)s")
    from rayspec.data import chat_prompt_ids, load_problems
    from rayspec.draft.eagle3 import init_head, load_head, save_head, vllm_state_dict
    from rayspec.draft.vocab import coverage, select_draft_vocab, token_counts
    from rayspec.draft.warmstart import (BEST, CORPUS, HEAD, corpus_prompt_span, lr_at, missing_prompts,
                                      read_corpus, split_prompts, train_head, write_corpus)
    from rayspec.models import load_policy, load_tokenizer, resolve_model_path
    from rayspec.rollout.adaptive import uniform, write_acceptance
    from rayspec.rollout.engine import SpecVLLMEngine, replica_env

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    prompts = [chat_prompt_ids(tok, p) for p in load_problems(cfg.data)]
    try:
        train_p, held = split_prompts(prompts, args.train_prompts, args.heldout_prompts)
    except ValueError as e:
        print(f"error: --train-prompts/--heldout-prompts: {e}", file=sys.stderr)
        return 2
    policy = load_policy(model_dir).eval()
    spec = cfg.rollout.speculative_config
    result_path = out / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if result.get("heldout_prompts", args.heldout_prompts) != args.heldout_prompts:
        print(f"error: --heldout-prompts {args.heldout_prompts}: {result_path} was scored on "
              f"{result['heldout_prompts']} held-out prompts", file=sys.stderr)
        return 2
    k = spec.num_speculative_tokens
    seqs = cfg.rollout.engine_kwargs.get("max_num_seqs", 256)
    engine_args = dict(dtype=cfg.model.dtype, engine_kwargs=dict(cfg.rollout.engine_kwargs),
                       env=replica_env(cfg.rollout))
    samples = read_corpus(out / CORPUS) if (out / CORPUS).is_file() else []
    try:
        todo = missing_prompts(train_p, samples, held)
    except ValueError as e:
        print(f"error: {out / CORPUS}: {e}", file=sys.stderr)
        return 2
    if todo:  # a new corpus, or a larger --train-prompts grows it
        t0, tokens = time.perf_counter(), 0
        engine = SpecVLLMEngine(str(model_dir), None, **engine_args)
        try:  # written chunk by chunk: an interrupted generation resumes from its last chunk
            for i in range(0, len(todo), GENERATE_CHUNK):
                batch, _ = engine.generate(todo[i:i + GENERATE_CHUNK], n=args.samples,
                                           temperature=cfg.grpo.temperature, max_tokens=cfg.grpo.max_new_tokens)
                samples += zip(batch.prompt_ids, batch.response_ids)
                tokens += sum(map(len, batch.response_ids))
                write_corpus(samples, out / CORPUS)
        finally:
            engine.shutdown()
        print(f"corpus: {len(todo)} new prompts x {args.samples} samples, {tokens} response tokens "
              f"in {time.perf_counter() - t0:.0f} s; {len(samples)} samples in all")
    V = policy.config.vocab_size
    counts = token_counts((r for _, r in samples), V)
    if not (out / HEAD / "model.safetensors").is_file():
        n = cfg.draft.draft_vocab_size
        vocab = None if spec.model or n is None or n >= V else select_draft_vocab(
            counts, n, always=[t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None])
        head = load_head(spec.model) if spec.model else init_head(
            policy, cfg.draft.aux_hidden_state_layer_ids, seed=cfg.trainer.seed, draft_vocab=vocab)
        save_head(head, out / HEAD)
    head_ids = load_head(out / HEAD).draft_ids
    draft_vocab = {"draft_vocab_size": V if head_ids is None else head_ids.numel(), "vocab_size": V,
                   "train_coverage": 1.0 if head_ids is None else coverage(counts, head_ids)}
    # held-out acceptance with the run's drafts (greedy or sampled): what early
    # stopping watches and acceptance.json records, where adaptive k starts
    engine = SpecVLLMEngine(
        str(model_dir), {"method": "eagle3", "model": str(out / HEAD), "num_speculative_tokens": k,
                         "draft_sample_method": spec.draft_sample_method,
                         "num_speculative_tokens_per_batch_size": uniform(k, seqs)}, **engine_args)
    try:
        if "before" not in result:
            result["before"], _ = acceptance(engine, held, args.heldout_samples, cfg)
            result["heldout_prompts"] = len(held)
            result_path.write_text(json.dumps(result, indent=1))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        history, best = result.get("history", []), result.get("best")
        done = history[-1]["step"] if history else 0
        peak_lr = DEFAULT_DRAFT_LR if cfg.draft.lr is None else cfg.draft.lr
        tokens_per_step = args.micro_batch * sum(len(r) for _, r in samples) / len(samples)
        t0, seconds_before = time.perf_counter(), result.get("train_seconds", 0.0)

        def record_acceptance(head_dir: Path) -> None:  # the best head's rates, for adaptive k
            write_acceptance(head_dir, best["after"]["acceptance_rate_per_pos"], k=k,
                             temperature=cfg.grpo.temperature,
                             draft_sample_method=spec.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD,
                             data=cfg.data.name, heldout_prompts=len(held),
                             heldout_samples=args.heldout_samples, policy=str(model_dir), train_steps=best["step"],
                             final_lr=lr_at(best["step"] - 1, peak_lr, args.steps),
                             train_prompts=corpus_prompt_span(prompts, samples))

        while not result.get("stopped") and done < args.steps:
            target = min(args.steps, done + args.eval_every) if args.eval_every else args.steps
            trained = train_head(policy, samples, out, target, peak_lr, cfg.draft.ttt_steps, pad,
                                 micro_batch=args.micro_batch, save_every=args.save_every,
                                 seed=cfg.trainer.seed, schedule_steps=args.steps,
                                 tv_weight=cfg.draft.tv_loss_weight,
                                 feature_cache_bytes=int(args.feature_cache_gib * 2 ** 30))
            done = trained["steps"]
            engine.update_draft(vllm_state_dict(load_head(out / HEAD)), done)
            at_t, held_responses = acceptance(engine, held, args.heldout_samples, cfg)
            greedy, _ = acceptance(engine, held, 1, cfg, temperature=0.0)
            history.append({"step": done, "train_tokens": round(done * tokens_per_step), **trained,
                            "acceptance_length": at_t["acceptance_length"],
                            "greedy_acceptance_length": greedy["acceptance_length"],
                            "seconds": seconds_before + time.perf_counter() - t0})
            print(f"step {done}: held-out acceptance length {at_t['acceptance_length']:.3f} "
                  f"(T={cfg.grpo.temperature}), {greedy['acceptance_length']:.3f} (greedy), "
                  f"loss {trained['draft_loss']:.3f}")
            if best is None or at_t["acceptance_length"] > best["acceptance_length"] + args.min_delta:
                best = {"step": done, "acceptance_length": at_t["acceptance_length"], "after": at_t}
                save_head(load_head(out / HEAD), out / BEST)
                record_acceptance(out / BEST)
                if head_ids is not None:
                    draft_vocab["heldout_coverage"] = coverage(token_counts(held_responses, V), head_ids)
            elif args.eval_every and (done - best["step"]) // args.eval_every >= args.patience:
                result["stopped"] = (f"held-out acceptance length did not improve by {args.min_delta} "
                                     f"in {args.patience} evaluations after step {best['step']}")
            result.update(history=history, best=best, after=best["after"], train=history[-1],
                          train_seconds=history[-1]["seconds"], corpus_samples=len(samples),
                          draft_vocab=draft_vocab, heldout_prompts=len(held), model=str(model_dir),
                          dtype=cfg.model.dtype, data=cfg.data.name, k=k, temperature=cfg.grpo.temperature)
            result_path.write_text(json.dumps(result, indent=1))
            plot_history(history, out / "acceptance.png", cfg.grpo.temperature)
        if best is None:
            raise SystemExit(f"error: --steps {args.steps}: nothing to train")
        # the head the run hands on is the best held-out one (its fp32
        # training state stays the last step's, where a resumed run continues)
        save_head(load_head(out / BEST), out / HEAD)
        record_acceptance(out / HEAD)
    finally:
        engine.shutdown()
    print(f"{'':<8}{'acc len':>9}{'tok/s':>8}  accept/pos   (held-out: {len(held)} prompts x "
          f"{args.heldout_samples}, T={cfg.grpo.temperature}, k={k})")
    for name in ("before", "after"):
        r = result[name]
        rates = ",".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"])
        print(f"{name:<8}{r['acceptance_length']:>9.2f}{r['tokens_per_s']:>8.1f}  [{rates}]")
    trained = result["train"]
    print(f"head: {out / HEAD}  (step {result['best']['step']} of {trained['steps']}, "
          f"{trained['train_tokens']} training tokens, {result['train_seconds']:.0f} s; "
          f"{result.get('stopped') or 'ran to --steps'})")
    return 0


def plot_history(history: list[dict], path: Path, temperature: float) -> None:
    """Held-out acceptance length against training tokens (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [h["train_tokens"] for h in history]
    ax.plot(x, [h["acceptance_length"] for h in history], "o-", label=f"T={temperature}")
    ax.plot(x, [h["greedy_acceptance_length"] for h in history], "s--", label="greedy")
    ax.set_xlabel("training tokens (response tokens seen)")
    ax.set_ylabel("held-out acceptance length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
