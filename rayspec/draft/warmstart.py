"""In-domain warm start of an EAGLE-3 head before RL.

The policy generates responses to prompts of the RL dataset, one forward of
the policy over each (prompt + response) captures the verifier's features, and
the head is trained on them with the same loss as online (``eagle3_loss``).
The seeds' system (NeMo-RL speculative rollouts, arXiv 2604.26779) measured
1.77x generation with a draft initialised on in-domain data against 1.51x with
a generic one.

Everything lands in one output directory, so an interrupted run resumes:

    corpus.jsonl          one generated sample per line ({"prompt_ids", "response_ids"})
    draft_head/           the head (vLLM checkpoint format, ``save_head``)
    best_head/            the best held-out head so far (the job's result)
    trainer_state.*       fp32 head weights, AdamW state, step counter (resume)
    result.json           acceptance length before / after on held-out prompts
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from rayspec.batch import RolloutBatch
from rayspec.config import DEFAULT_DRAFT_LR, DEFAULT_DRAFT_SAMPLE_METHOD
from rayspec.draft.capture import capture_eagle3_features
from rayspec.draft.eagle3 import Eagle3Head, aux_layer_ids, init_head, load_head, save_head, vllm_state_dict
from rayspec.draft.loss import SHIPPED_DTYPE, eagle3_loss, verifier_normalizers
from rayspec.models.acceptance import acceptance_record

CORPUS = "corpus.jsonl"
HEAD = "draft_head"
BEST = "best_head"
GENERATE_CHUNK = 128  # prompts per engine call while the corpus is generated


def write_corpus(samples: Iterable[tuple[list[int], list[int]]], path: Path) -> None:
    """Write (prompt_ids, response_ids) samples as JSONL atomically (temp file,
    rename), so a corpus being extended is never left half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for p, r in samples:
            f.write(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n")
    os.replace(tmp, path)


def read_corpus(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) per line of a corpus written by ``write_corpus``.

    Raises:
        ValueError: a line is not a sample; the message names the file and line.
    """
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            out.append((list(row["prompt_ids"]), list(row["response_ids"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a corpus sample ({e!r})") from None
    return out


def features(policy, samples: list[tuple[list[int], list[int]]], aux_layer_ids: list[int],
             pad_id: int) -> dict[str, torch.Tensor]:
    """Verifier features of a micro-batch of samples (one no-grad forward).

    Returns:
        dict as the DraftTrainer takes it: input_ids [B, L] int64,
        aux_hidden [B, L, 3H] and final_hidden [B, L, H] (bf16, as shipped
        online), loss_mask [B, L-1] float (response tokens), and the
        verifier's normalisers at T = 1 (``loss.verifier_normalizers``).
    """
    n = len(samples)
    batch = RolloutBatch([p for p, _ in samples], [r for _, r in samples],
                         [[0.0] * len(r) for _, r in samples], list(range(n)))
    t = batch.to_padded(pad_id)
    with torch.no_grad(), capture_eagle3_features(policy, aux_layer_ids) as feats:
        policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
    return {"input_ids": t["input_ids"], "aux_hidden": feats["aux_hidden"].to(SHIPPED_DTYPE),
            "final_hidden": feats["final_hidden"].to(SHIPPED_DTYPE), "loss_mask": t["response_mask"],
            **verifier_normalizers(feats["final_hidden"], t["response_mask"], policy.lm_head.weight)}


def _save_state(head: Eagle3Head, opt: torch.optim.Optimizer, step: int, out: Path) -> None:
    """fp32 head weights and AdamW state (``draft_head/`` is bf16, as vLLM
    loads it; resuming from it would round the master weights). The frozen
    output layer is the policy's and is not stored twice.
    safetensors + JSON, not torch.save: no pickle in what a later run loads."""
    sd = opt.state_dict()
    tensors = {f"head.{k}": v.detach().contiguous() for k, v in head.state_dict().items()
               if k != "lm_head.weight"}
    tensors.update({f"opt.{k}.{i}": v.contiguous() for i, st in sd["state"].items()
                    for k, v in st.items() if torch.is_tensor(v)})
    save_file(tensors, str(out / ".trainer_state.safetensors.tmp"))
    (out / ".trainer_state.json.tmp").write_text(json.dumps({"step": step, "param_groups": sd["param_groups"]}))
    os.replace(out / ".trainer_state.safetensors.tmp", out / "trainer_state.safetensors")
    os.replace(out / ".trainer_state.json.tmp", out / "trainer_state.json")


def _load_state(head: Eagle3Head, opt: torch.optim.Optimizer, out: Path) -> int:
    """Restore what ``_save_state`` wrote; returns the step (0: nothing saved)."""
    if not (out / "trainer_state.json").is_file():
        return 0
    meta = json.loads((out / "trainer_state.json").read_text())
    tensors = load_file(str(out / "trainer_state.safetensors"))
    missing, unexpected = head.load_state_dict(
        {k[5:]: v for k, v in tensors.items() if k.startswith("head.")}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{out}/trainer_state.safetensors does not match the head in {out / HEAD}: "
                         f"missing {missing}, unexpected {unexpected}")
    state: dict[int, dict] = {}
    for name, v in tensors.items():
        if name.startswith("opt."):
            key, i = name[4:].rsplit(".", 1)
            state.setdefault(int(i), {})[key] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return int(meta["step"])


def lr_at(step: int, lr: float, schedule_steps: int | None) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over
    the first 5% of ``schedule_steps``, then cosine decay to 10% of ``lr`` at
    ``schedule_steps`` (constant ``lr`` for None). A function of the step
    alone, so a resumed run continues the same schedule."""
    if not schedule_steps:
        return lr
    warmup = max(1, schedule_steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, schedule_steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_head(policy, samples: list[tuple[list[int], list[int]]], out_dir: str | os.PathLike,
               steps: int, lr: float, ttt_steps: int, pad_id: int, micro_batch: int = 4,
               save_every: int = 50, seed: int = 0, schedule_steps: int | None = None,
               tv_weight: float = 0.0, feature_cache_bytes: int | None = 4 << 30) -> dict[str, float]:
    """Train the head in ``<out_dir>/draft_head`` on ``samples`` for ``steps``
    optimizer steps in total, resuming from the step saved there.

    Each step is one micro-batch (``micro_batch`` samples, cycling through a
    seeded shuffle of ``samples``), the EAGLE-3 TTT loss against the policy's
    next-token distribution. The output layer stays the policy's (frozen), as
    online, so vLLM shares it with the verifier. The head and AdamW state are
    saved every ``save_every`` steps and at the end (each file atomically).

    Args:
        policy: transformers Llama-family causal LM (fp32, eval mode).
        samples: (prompt_ids, response_ids) pairs.
        out_dir: directory holding ``draft_head/`` (written by the caller first).
        steps: total optimizer steps, counting those of earlier runs.
        lr: AdamW peak learning rate (``lr_at``).
        ttt_steps: training-time-test depth.
        pad_id: tokenizer pad id.
        schedule_steps: length of the learning-rate schedule (``lr_at``;
            None: constant ``lr``), the most steps a run may take when it is
            trained in parts with evaluations between them.
        tv_weight: weight of ``eagle3_loss``'s total-variation term.
        feature_cache_bytes: micro-batches' verifier features are kept in
            host memory as they are first computed, up to this many bytes;
            the others are recomputed each time they come round (None: no
            limit). They take 4 H bf16 values per token: 33 GB for 1M
            tokens of an 8B policy (H = 4096).

    Returns:
        {"steps": total steps done, "draft_loss": mean loss of the last <= 20
        steps of this call (nan if none ran), "draft_top1": top-1 agreement of
        draft step 0 over them}.
    """
    out = Path(out_dir)
    head: Eagle3Head = load_head(out / HEAD)
    # bf16 rows, frozen, as online (the DraftTrainer gets rank 0's bf16 layers)
    out_rows = head.draft_rows(policy.lm_head.weight.detach().to(SHIPPED_DTYPE))
    head.set_output_rows(out_rows)
    head.lm_head.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    done = _load_state(head, opt, out)
    ids = aux_layer_ids(head.cfg, policy.config.num_hidden_layers)
    embed = policy.model.embed_tokens.weight.detach().float()
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    chunks = [order[i:i + micro_batch] for i in range(0, len(order), micro_batch)]
    cache: dict[int, dict] = {}  # features of a fixed set of chunks: in a cycle, LRU would miss every time
    cached = 0
    losses, top1 = [], []
    head.train()
    for step in tqdm(range(done, steps), initial=done, total=steps, desc="warm start",
                     unit="step", disable=None):
        c = step % len(chunks)
        f = cache.get(c) or features(policy, [samples[i] for i in chunks[c]], ids, pad_id)
        size = sum(t.nbytes for t in f.values())
        if c not in cache and (feature_cache_bytes is None or cached + size <= feature_cache_bytes):
            cache[c], cached = f, cached + size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, schedule_steps)
        loss, acc = eagle3_loss(head, f, embed, out_rows, ttt_steps, tv_weight=tv_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses, top1 = (losses + [loss.item()])[-20:], (top1 + [acc[0] if acc else 0.0])[-20:]
        if (step + 1) % save_every == 0 or step + 1 == steps:
            save_head(head, out / HEAD)
            _save_state(head, opt, step + 1, out)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"steps": max(done, steps), "draft_loss": mean(losses), "draft_top1": mean(top1)}


def split_prompts(items: Iterable, num_train: int, num_heldout: int) -> tuple[list, list]:
    """The first ``num_heldout`` items held out and the next ``num_train`` for
    training (disjoint). Held-out items come first so that a corpus grown by a
    larger ``num_train`` is still scored on the same held-out items.

    Raises:
        ValueError: fewer items than ``num_train + num_heldout``.
    """
    items = list(items)
    if len(items) < num_train + num_heldout:
        raise ValueError(f"need {num_train} + {num_heldout} prompts, the dataset has {len(items)}")
    return items[num_heldout:num_heldout + num_train], items[:num_heldout]


def missing_prompts(prompts: list[list[int]], samples: list[tuple[list[int], list[int]]],
                    heldout: list[list[int]]) -> list[list[int]]:
    """The training prompts (token ids) that have no sample in the corpus yet:
    what a resumed warm start generates to grow its corpus.

    Raises:
        ValueError: a held-out prompt has samples in the corpus (it was made
            with other ``--train-prompts`` / ``--heldout-prompts``), so held-out
            acceptance would be measured on training data.
    """
    have = {tuple(p) for p, _ in samples}
    leaked = sum(tuple(p) in have for p in heldout)
    if leaked:
        raise ValueError(f"{leaked} of the {len(heldout)} held-out prompts are in the corpus: it was "
                         "generated with another split; use a new --out or the split it was made with")
    return [p for p in prompts if tuple(p) not in have]


def corpus_prompt_span(prompts: list[list[int]], samples: list[tuple[list[int], list[int]]]) -> list[int] | None:
    """[first, end): the smallest span of dataset indices holding every
    prompt of ``prompts`` (the dataset's, as token ids, in its order) that
    the corpus has samples of; None where it has none. A benchmark whose
    prompts fall in it would measure the head on its training data
    (``trained_prompt_overlap``)."""
    have = {tuple(p) for p, _ in samples}
    seen = [i for i, p in enumerate(prompts) if tuple(p) in have]
    return [seen[0], seen[-1] + 1] if seen else None


def trained_prompt_overlap(head_dir: str | os.PathLike, data: str, indices: Iterable[int]) -> list[int]:
    """The ``indices`` of dataset ``data`` (e.g. "gsm8k", train split) inside
    the ``train_prompts`` span that the warm start recorded in the head's
    ``acceptance.json`` for that dataset, sorted; [] where the head has no
    such record (no overlap can be shown then, for a head made elsewhere)."""
    record = acceptance_record(head_dir) or {}
    span = record.get("train_prompts")
    if record.get("data") != data or not span:
        return []
    return sorted(i for i in set(indices) if span[0] <= i < span[1])


def acceptance(engine, prompts: list[list[int]], n: int, cfg,
               temperature: float | None = None) -> tuple[dict, list[list[int]]]:
    """(acceptance figures of ``n`` samples of each prompt at ``temperature``
    (None: the RL temperature), their response ids)."""
    batch, stats = engine.generate(prompts, n=n, max_tokens=cfg.grpo.max_new_tokens,
                                   temperature=cfg.grpo.temperature if temperature is None else temperature)
    return {"acceptance_length": stats.acceptance_length,
            "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
            "tokens_per_s": stats.tokens_per_s, "output_tokens": stats.output_tokens}, batch.response_ids


@dataclass(frozen=True)
class WarmStartOptions:
    """A warm start's schedule (``jobs.warmstart_draft``'s options).

    Args:
        train_prompts: prompts of ``data.*`` (after the held-out ones) the
            policy answers for the training corpus.
        heldout_prompts: the first prompts, never trained on: acceptance is
            measured on them.
        samples / heldout_samples: responses per training / held-out prompt.
        steps: most optimizer steps in total (the learning-rate schedule's length).
        eval_every: steps between held-out evaluations (0: once, at ``steps``).
        patience: evaluations without improvement before training stops.
        min_delta: held-out acceptance length gain (tokens per verification
            step) that counts as improvement.
        micro_batch: samples per optimizer step.
        save_every: steps between saved training states (resume points).
        feature_cache_gib: host memory for the verifier features of training
            micro-batches (GiB); those past it are recomputed each epoch.
    """

    train_prompts: int = 64
    heldout_prompts: int = 16
    samples: int = 4
    heldout_samples: int = 4
    steps: int = 2000
    eval_every: int = 100
    patience: int = 3
    min_delta: float = 0.01
    micro_batch: int = 4
    save_every: int = 50
    feature_cache_gib: float = 4.0


def warm_start(cfg, out: str | os.PathLike, args: WarmStartOptions, report=print) -> dict:
    """Warm-start an EAGLE-3 head for ``cfg``'s policy on its own responses
    to ``cfg.data``'s prompts (see the module docstring and
    ``jobs.warmstart_draft``): generate the corpus (resumable, chunk by
    chunk), make or load the head, train it with held-out evaluations and
    early stopping, and leave the best head in ``out/draft_head`` with its
    acceptance record. ``report`` gets one line per corpus chunk and
    evaluation.

    Returns:
        ``result.json``'s content: "before" / "after" held-out acceptance,
        "history" of every evaluation, "best", "train", "draft_vocab".

    Raises:
        ValueError: the prompts, corpus or an earlier result do not fit the
            options (named).
    """
    from rayspec.data import prompt_ids, load_problems
    from rayspec.draft.vocab import coverage, token_counts
    from rayspec.models import load_policy, load_tokenizer, resolve_model_path
    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.engine import SpecVLLMEngine, replica_env

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    prompts = [prompt_ids(tok, p) for p in load_problems(cfg.data)]
    try:
        train_p, held = split_prompts(prompts, args.train_prompts, args.heldout_prompts)
    except ValueError as e:
        raise ValueError(f"train_prompts / heldout_prompts: {e}") from None
    result_path = out / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if result.get("heldout_prompts", args.heldout_prompts) != args.heldout_prompts:
        raise ValueError(f"heldout_prompts {args.heldout_prompts}: {result_path} was scored on "
                         f"{result['heldout_prompts']} held-out prompts")
    engine_args = dict(dtype=cfg.model.dtype, engine_kwargs=dict(cfg.rollout.engine_kwargs),
                       env=replica_env(cfg.rollout))
    samples = _grow_corpus(cfg, model_dir, train_p, held, out, args, engine_args, report)
    policy = load_policy(model_dir).eval()
    head_ids, draft_vocab = _prepare_head(cfg, policy, tok, samples, out)
    # held-out acceptance with the run's drafts (greedy or sampled): what early
    # stopping watches and acceptance.json records, where adaptive k starts
    spec, k = cfg.rollout.speculative_config, cfg.rollout.speculative_config.num_speculative_tokens
    engine = SpecVLLMEngine(
        str(model_dir), {"method": "eagle3", "model": str(out / HEAD), "num_speculative_tokens": k,
                         "draft_sample_method": spec.draft_sample_method,
                         "num_speculative_tokens_per_batch_size": uniform(
                             k, cfg.rollout.engine_kwargs.get("max_num_seqs", 256))}, **engine_args)
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
        record = {"k": k, "temperature": cfg.grpo.temperature,
                  "draft_sample_method": spec.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD,
                  "data": cfg.data.name, "heldout_prompts": len(held), "heldout_samples": args.heldout_samples,
                  "policy": str(model_dir), "train_prompts": corpus_prompt_span(prompts, samples)}
        while not result.get("stopped") and done < args.steps:
            target = min(args.steps, done + args.eval_every) if args.eval_every else args.steps
            trained = train_head(policy, samples, out, target, peak_lr, cfg.draft.ttt_steps, pad,
                                 micro_batch=args.micro_batch, save_every=args.save_every,
                                 seed=cfg.trainer.seed, schedule_steps=args.steps,
                                 tv_weight=cfg.draft.tv_loss_weight,
                                 feature_cache_bytes=int(args.feature_cache_gib * 2 ** 30))
            done = trained["steps"]
            engine.receive_refit("draft", vllm_state_dict(load_head(out / HEAD)), done)
            at_t, held_responses = acceptance(engine, held, args.heldout_samples, cfg)
            greedy, _ = acceptance(engine, held, 1, cfg, temperature=0.0)
            history.append({"step": done, "train_tokens": round(done * tokens_per_step), **trained,
                            "acceptance_length": at_t["acceptance_length"],
                            "greedy_acceptance_length": greedy["acceptance_length"],
                            "seconds": seconds_before + time.perf_counter() - t0})
            report(f"step {done}: held-out acceptance length {at_t['acceptance_length']:.3f} "
                   f"(T={cfg.grpo.temperature}), {greedy['acceptance_length']:.3f} (greedy), "
                   f"loss {trained['draft_loss']:.3f}")
            if best is None or at_t["acceptance_length"] > best["acceptance_length"] + args.min_delta:
                best = {"step": done, "acceptance_length": at_t["acceptance_length"], "after": at_t}
                save_head(load_head(out / HEAD), out / BEST)
                _record_best(out / BEST, best, record, peak_lr, args.steps)
                if head_ids is not None:
                    draft_vocab["heldout_coverage"] = coverage(token_counts(held_responses, draft_vocab["vocab_size"]),
                                                               head_ids)
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
            raise ValueError(f"steps {args.steps}: nothing to train")
        # the head the run hands on is the best held-out one (its fp32
        # training state stays the last step's, where a resumed run continues)
        save_head(load_head(out / BEST), out / HEAD)
        _record_best(out / HEAD, best, record, peak_lr, args.steps)
    finally:
        engine.shutdown()
    return result


def _grow_corpus(cfg, model_dir, train_prompts: list, held: list, out: Path, args: WarmStartOptions,
                 engine_args: dict, report) -> list[tuple[list[int], list[int]]]:
    """The corpus in ``out``, grown by ``args.samples`` responses of the
    policy (a plain engine: an untrained head only slows generation) to each
    training prompt it lacks, written chunk by chunk so an interrupted
    generation resumes from its last chunk.

    Raises:
        ValueError: the corpus holds held-out prompts or is not a corpus (named).
    """
    from rayspec.rollout.engine import SpecVLLMEngine

    samples = read_corpus(out / CORPUS) if (out / CORPUS).is_file() else []
    try:
        todo = missing_prompts(train_prompts, samples, held)
    except ValueError as e:
        raise ValueError(f"{out / CORPUS}: {e}") from None
    if not todo:
        return samples
    t0, tokens = time.perf_counter(), 0
    engine = SpecVLLMEngine(str(model_dir), None, **engine_args)
    try:
        for i in range(0, len(todo), GENERATE_CHUNK):
            batch, _ = engine.generate(todo[i:i + GENERATE_CHUNK], n=args.samples,
                                       temperature=cfg.grpo.temperature, max_tokens=cfg.grpo.max_new_tokens)
            samples += zip(batch.prompt_ids, batch.response_ids)
            tokens += sum(map(len, batch.response_ids))
            write_corpus(samples, out / CORPUS)
    finally:
        engine.shutdown()
    report(f"corpus: {len(todo)} new prompts x {args.samples} samples, {tokens} response tokens "
           f"in {time.perf_counter() - t0:.0f} s; {len(samples)} samples in all")
    return samples


def _prepare_head(cfg, policy, tok, samples: list, out: Path) -> tuple:
    """The head in ``out/draft_head``: kept where there is one, else
    ``rollout.speculative_config.model``, else a new head whose draft
    vocabulary is the ``draft.draft_vocab_size`` most frequent tokens of the
    corpus. Returns (its draft ids or None, the draft vocabulary's record:
    sizes and the corpus's coverage)."""
    from rayspec.draft.vocab import coverage, select_draft_vocab, token_counts

    spec, V = cfg.rollout.speculative_config, policy.config.vocab_size
    counts = token_counts((r for _, r in samples), V)
    if not (out / HEAD / "model.safetensors").is_file():
        n = cfg.draft.draft_vocab_size
        vocab = None if spec.model or n is None or n >= V else select_draft_vocab(
            counts, n, always=[t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None])
        head = load_head(spec.model) if spec.model else init_head(
            policy, cfg.draft.aux_hidden_state_layer_ids, seed=cfg.trainer.seed, draft_vocab=vocab)
        save_head(head, out / HEAD)
    head_ids = load_head(out / HEAD).draft_ids
    return head_ids, {"draft_vocab_size": V if head_ids is None else head_ids.numel(), "vocab_size": V,
                      "train_coverage": 1.0 if head_ids is None else coverage(counts, head_ids)}


def _record_best(head_dir: Path, best: dict, record: dict, peak_lr: float, steps: int) -> None:
    """The best head's held-out rates beside it (``acceptance.json``), where
    adaptive k starts, with the rate of its last step (online training
    continues at it)."""
    from rayspec.models.acceptance import write_acceptance

    write_acceptance(head_dir, best["after"]["acceptance_rate_per_pos"], **{
        **record, "train_steps": best["step"], "final_lr": lr_at(best["step"] - 1, peak_lr, steps)})


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
