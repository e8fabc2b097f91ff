"""In-domain warm start of the EAGLE-3 head: training resumes exactly, the
corpus is checked row by row, and the job raises held-out acceptance."""

from __future__ import annotations

import json

import pytest
import torch

from rayspec.draft.eagle3 import init_head, load_head, save_head
from rayspec.draft.trainer import online_lr
from rayspec.draft.warmstart import (HEAD, corpus_prompt_span, lr_at, missing_prompts, read_corpus, split_prompts,
                                     train_head, trained_prompt_overlap, write_corpus)
from rayspec.models import load_policy
from rayspec.models.acceptance import read_acceptance, write_acceptance


def _samples(n: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(5, 400, (6,), generator=g).tolist(),
             torch.randint(5, 400, (10,), generator=g).tolist()) for _ in range(n)]


def test_training_resumes_where_it_stopped(tiny_llama_dir, tmp_path):
    """4 steps in one run == 2 steps, stop, 2 more: the head and AdamW state
    come back from the directory (safetensors + JSON, no pickle)."""
    policy = load_policy(tiny_llama_dir).eval()
    samples = _samples(12)
    for d in ("once", "twice"):
        save_head(init_head(policy), tmp_path / d / HEAD)
    train_head(policy, samples, tmp_path / "once", 4, 1e-3, 2, pad_id=0, micro_batch=4, save_every=2)
    first = train_head(policy, samples, tmp_path / "twice", 2, 1e-3, 2, pad_id=0, micro_batch=4, save_every=2)
    assert first["steps"] == 2
    again = train_head(policy, samples, tmp_path / "twice", 4, 1e-3, 2, pad_id=0, micro_batch=4, save_every=2)
    assert again["steps"] == 4
    assert json.loads((tmp_path / "twice" / "trainer_state.json").read_text())["step"] == 4
    a, b = load_head(tmp_path / "once" / HEAD), load_head(tmp_path / "twice" / HEAD)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.fc.weight, init_head(policy).fc.weight.to(torch.bfloat16).float())  # trained
    # the output layer stays the verifier's (vLLM shares it)
    assert torch.equal(a.lm_head.weight, policy.lm_head.weight.to(torch.bfloat16).float())


def test_features_past_the_cache_budget_are_recomputed_alike(tiny_llama_dir, tmp_path, monkeypatch):
    """With no room for features every step recomputes its micro-batch's, and
    the head is the same as with all of them cached."""
    import rayspec.draft.warmstart as ws

    policy = load_policy(tiny_llama_dir).eval()
    samples = _samples(12)  # 3 micro-batches, so 7 steps come round to each again
    made, compute = [], ws.features
    monkeypatch.setattr(ws, "features", lambda *a: made.append(1) or compute(*a))
    for d, budget in (("cached", None), ("recomputed", 0)):
        save_head(init_head(policy), tmp_path / d / HEAD)
        made.clear()
        train_head(policy, samples, tmp_path / d, 7, 1e-3, 2, pad_id=0, micro_batch=4,
                   save_every=7, feature_cache_bytes=budget)
        assert len(made) == (3 if budget is None else 7), d
    a, b = load_head(tmp_path / "cached" / HEAD), load_head(tmp_path / "recomputed" / HEAD)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_bad_corpus_row_names_file_and_line(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text('{"prompt_ids": [1], "response_ids": [2]}\n{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2"):
        read_corpus(f)


def test_split_prompts_is_disjoint_and_checks_size():
    train, held = split_prompts(range(10), 6, 3)
    assert train == [3, 4, 5, 6, 7, 8] and held == [0, 1, 2]
    # more training prompts keep the held-out ones
    assert split_prompts(range(10), 7, 3) == ([3, 4, 5, 6, 7, 8, 9], held)
    with pytest.raises(ValueError, match="need 8 \\+ 3 prompts, the dataset has 10"):
        split_prompts(range(10), 8, 3)


def test_a_corpus_grows_by_the_prompts_it_lacks_and_never_holds_heldout_ones(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus([([1, 2], [5]), ([1, 2], [6]), ([3], [7])], corpus)
    samples = read_corpus(corpus)
    assert samples == [([1, 2], [5]), ([1, 2], [6]), ([3], [7])]
    assert missing_prompts([[1, 2], [3], [4, 4]], samples, heldout=[[9]]) == [[4, 4]]
    assert missing_prompts([[1, 2], [3]], samples, heldout=[[9]]) == []
    # a corpus made with another split holds a held-out prompt: refused, not scored on training data
    with pytest.raises(ValueError, match="1 of the 2 held-out prompts are in the corpus"):
        missing_prompts([[4, 4]], samples, heldout=[[3], [9]])
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


def test_the_corpus_prompt_span_is_recorded_and_overlaps_are_found(tmp_path):
    samples = [([3], [7]), ([1, 2], [5]), ([8], [1])]  # [8] is not the dataset's
    dataset = [[9], [1, 2], [4], [3], [6]]
    assert corpus_prompt_span(dataset, samples) == [1, 4]
    assert corpus_prompt_span(dataset, [([8], [1])]) is None
    head = tmp_path / "head"
    head.mkdir()
    assert trained_prompt_overlap(head, "gsm8k", range(10)) == []  # no record: nothing to show
    write_acceptance(head, [0.5], data="gsm8k", train_prompts=[1, 4])
    assert trained_prompt_overlap(head, "gsm8k", [0, 5, 3, 1, 3]) == [1, 3]
    assert trained_prompt_overlap(head, "gsm8k", [0, 4, 9]) == []
    assert trained_prompt_overlap(head, "math", [1, 2]) == []  # trained on another dataset
    (head / "acceptance.json").write_text("{")
    with pytest.raises(ValueError, match="acceptance.json: not an acceptance record"):
        trained_prompt_overlap(head, "gsm8k", [1])


@pytest.mark.slow
def test_warmstart_job_raises_heldout_acceptance_stops_early_and_resumes(tiny_llama_dir, gsm8k_dir, tmp_path,
                                                                          in_process_engine_core):
    from jobs.warmstart_draft import main

    out = tmp_path / "warm"
    # 64 x 4 samples and 8 held-out prompts x 4: fewer gave a held-out gain
    # (about 0.02) within the sampling noise of 2 held-out prompts
    common = ["--out", str(out), "--train-prompts", "64", "--heldout-prompts", "8", "--samples", "4",
              "--heldout-samples", "4", "--save-every", "50", f"model.path={tiny_llama_dir}",
              "model.dtype=float32", "data.name=gsm8k", f"data.path={gsm8k_dir}", "draft.lr=3e-3",
              "draft.draft_vocab_size=2048", "grpo.max_new_tokens=32", "rollout.engine_kwargs.max_num_seqs=32"]
    assert main(common + ["--steps", "100", "--eval-every", "50"]) == 0
    res = json.loads((out / "result.json").read_text())
    corpus = (out / "corpus.jsonl").read_text()
    assert len(read_corpus(out / "corpus.jsonl")) == 256
    assert [h["step"] for h in res["history"]] == [50, 100] and res["train"]["steps"] == 100
    assert 0 < res["history"][0]["train_tokens"] < res["history"][1]["train_tokens"]
    assert all(h["greedy_acceptance_length"] >= 1.0 for h in res["history"])
    assert (out / "acceptance.png").stat().st_size > 0
    # the draft vocabulary: the responses' 2048 most frequent tokens
    vocab = res["draft_vocab"]
    assert vocab["draft_vocab_size"] == 2048 and 0.5 < vocab["train_coverage"] <= 1.0
    assert 0 < vocab["heldout_coverage"] <= 1.0
    # the preset samples drafts from the head: the fresh head's are accepted only
    # where its q happens to overlap p (1.001 here); 100 steps on a random tiny
    # policy teach it a little (the standard error over ~1000 held-out tokens is ~0.01)
    assert res["before"]["acceptance_length"] < 1.01
    assert res["after"]["acceptance_length"] > 1.03, res
    assert res["after"] == res["best"]["after"] and res["best"]["step"] in (50, 100)
    head = load_head(out / HEAD)
    assert head.cfg["architectures"] == ["LlamaForCausalLMEagle3"] and head.draft_ids.numel() == 2048
    # the "after" rates are recorded beside the head, for adaptive speculation,
    # as rates of sampled drafts: not for an engine that drafts greedily
    assert read_acceptance(out / HEAD, "probabilistic") == res["after"]["acceptance_rate_per_pos"]
    assert read_acceptance(out / HEAD) is None
    record = json.loads((out / HEAD / "acceptance.json").read_text())
    assert record["train_prompts"] == [8, 72] and record["data"] == "gsm8k"  # what benches must stay out of
    # best_head/ has its own record, written when it became the best: an
    # interrupted warm start's draft_head/ is the last training step's head, without one
    assert json.loads((out / "best_head" / "acceptance.json").read_text()) == record
    # online training continues at the rate of the best head's last step (3e-3
    # peak, cosine over 100 steps), not at a fresh head's
    assert record["final_lr"] == pytest.approx(lr_at(res["best"]["step"] - 1, 3e-3, 100))
    assert online_lr(None, out / HEAD, trained=True)[0] == record["final_lr"] < 3e-3
    # resume: same corpus, training continues; one evaluation without a gain of 10 stops it
    stop = common + ["--steps", "200", "--eval-every", "10", "--patience", "1", "--min-delta", "10"]
    assert main(stop) == 0
    assert (out / "corpus.jsonl").read_text() == corpus
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 110
    resumed = json.loads((out / "result.json").read_text())
    assert resumed["before"] == res["before"] and [h["step"] for h in resumed["history"]] == [50, 100, 110]
    assert "did not improve by 10.0 in 1 evaluations" in resumed["stopped"]
    assert resumed["best"] == res["best"]  # the head handed on is still the best one
    best = load_head(out / "best_head")
    for (k, a), b in zip(load_head(out / HEAD).state_dict().items(), best.state_dict().values()):
        assert torch.equal(a, b), k
    # a stopped run stays stopped; a larger --train-prompts grows its corpus by the new prompts' samples
    grown = [a if a != "64" else "66" for a in stop]
    assert main(grown) == 0
    assert json.loads((out / "result.json").read_text()) == resumed
    samples = read_corpus(out / "corpus.jsonl")
    assert len(samples) == 264 and (out / "corpus.jsonl").read_text().startswith(corpus)
    assert len({tuple(p) for p, _ in samples}) == 66
    assert json.loads((out / HEAD / "acceptance.json").read_text())["train_prompts"] == [8, 74]
    # another held-out split is refused before anything is written
    assert main(grown + ["--heldout-prompts", "4"]) == 2
    assert json.loads((out / "result.json").read_text()) == resumed and len(read_corpus(out / "corpus.jsonl")) == 264
    assert read_acceptance(out / HEAD, "probabilistic") == resumed["after"]["acceptance_rate_per_pos"]
