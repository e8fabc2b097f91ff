"""EAGLE-3 head: vLLM checkpoint format, feature capture, training signal,
and (slow) a real vLLM replica accepting more drafts after training."""

from __future__ import annotations

import json

import pytest
import torch

from rayspec.batch import RolloutBatch
from rayspec.draft import trainer as trainer_mod
from rayspec.config import ConfigError
from rayspec.draft.capture import capture_eagle3_features
from rayspec.draft.eagle3 import (default_aux_layer_ids, head_config, head_init_tensors, init_head, load_head,
                                  save_head, vllm_state_dict)
from rayspec.draft.loss import draft_top1, replay_drafting, verifier_normalizers
from rayspec.draft.trainer import DraftTrainer, TrainingCadence, online_lr, recorded_acceptance_length
from rayspec.models import load_policy, load_tokenizer
from rayspec.rollout.spec_stats import SpecStats
from rayspec.rollout.client import LocalReplicas, RolloutClient
from rayspec.sync import CollectiveSender
from tests.conftest import engine_kwargs


@pytest.fixture(scope="module")
def tiny_policy(tiny_llama_dir):
    return load_policy(tiny_llama_dir).eval()


def test_default_aux_layers_and_validation():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    with pytest.raises(ValueError, match="layers"):
        default_aux_layer_ids(4)
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids"):
        head_config({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128,
                     "intermediate_size": 256, "num_attention_heads": 2, "vocab_size": 10},
                    [1, 2, 99])
    with pytest.raises(ValueError, match="Llama-family"):
        head_config({"model_type": "gpt2"})


def test_a_head_initialises_from_the_few_policy_tensors_it_reads(tiny_policy, tiny_llama_dir, tmp_path):
    """The driver initialises a head from ``head_init_tensors`` alone (the
    rest of the policy on the meta device, holding no memory): the same head
    as from the whole policy, with a tied output layer read from the
    embedding and an untied one from its own tensor; a tensor the checkpoint
    lacks is named."""
    names = head_init_tensors(tiny_policy.config.num_hidden_layers)
    untied = tmp_path / "untied"
    tiny_policy.config.tie_word_embeddings = False
    try:
        with torch.no_grad():
            tiny_policy.lm_head.weight = torch.nn.Parameter(tiny_policy.lm_head.weight * 2)
        tiny_policy.save_pretrained(untied)
    finally:
        tiny_policy.config.tie_word_embeddings = True
        tiny_policy.lm_head.weight = tiny_policy.model.embed_tokens.weight
    for model_dir in (tiny_llama_dir, untied):
        part = load_policy(model_dir, only=names)
        loaded = {n for n, p in part.state_dict().items() if not p.is_meta}
        assert loaded == set(names), model_dir
        want = init_head(load_policy(model_dir), seed=3).state_dict()
        got = init_head(part, seed=3).state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items()), model_dir
    assert not torch.equal(init_head(load_policy(untied)).lm_head.weight, init_head(tiny_policy).lm_head.weight)
    with pytest.raises(ConfigError, match="model.layers.99.mlp.up_proj.weight"):
        load_policy(tiny_llama_dir, only=["model.layers.99.mlp.up_proj.weight"])


def test_checkpoint_is_vllm_eagle3_format_and_roundtrips(tiny_policy, tmp_path):
    head = init_head(tiny_policy)
    out = save_head(head, tmp_path / "head")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    names = set(vllm_state_dict(head))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "norm.weight", "lm_head.weight"} <= names
    assert "embed_tokens.weight" not in names  # shared with the verifier in vLLM
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * cfg["hidden_size"]
    again = load_head(out)
    for k, v in vllm_state_dict(head).items():
        assert torch.equal(vllm_state_dict(again)[k], v), k
    # overwriting keeps a complete checkpoint in place
    save_head(again, out)
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".head-*"))


def test_both_vllm_model_runners_read_the_aux_layers_the_trainer_captures(tiny_policy, tmp_path):
    """vLLM 0.32's V1 runner (CPU, and CUDA with adaptive k) and V2 runner
    (CUDA's default for EAGLE) each read a head's auxiliary layer ids with
    their own config reader: both return the layers the DraftTrainer
    captures, for a fresh head and for a published one that names its
    layers only where V1 looks."""
    from transformers import LlamaConfig
    from types import SimpleNamespace
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from rayspec.draft.eagle3 import aux_layer_ids

    def runners(cfg: dict) -> tuple:
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=LlamaConfig(**cfg)))
        return (GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)),
                get_eagle3_aux_layers_from_config(spec))

    fresh = json.loads((save_head(init_head(tiny_policy, [1, 2, 5]), tmp_path / "fresh") / "config.json").read_text())
    assert runners(fresh) == ((1, 2, 5), (1, 2, 5))
    assert aux_layer_ids(load_head(tmp_path / "fresh").cfg, None) == [1, 2, 5]
    head = init_head(tiny_policy)
    v1_only = {**head.cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}}
    v1_only.pop("eagle_aux_hidden_state_layer_ids")
    assert runners(v1_only) == ((2, 3, 4), None)  # what a V1-only key does on V2: the model's default layers
    head.cfg = v1_only
    saved = json.loads((save_head(head, tmp_path / "published") / "config.json").read_text())
    assert runners(saved) == ((2, 3, 4), (2, 3, 4)) and aux_layer_ids(saved, None) == [2, 3, 4]


def test_capture_matches_hidden_states(tiny_policy):
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad(), capture_eagle3_features(tiny_policy, [1, 3, 4]) as f:
        out = tiny_policy(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states  # hs[i] is the input of layer i; hs[-1] is post-norm
    assert torch.allclose(f["aux_hidden"], torch.cat([hs[1], hs[3], hs[4]], -1))
    assert torch.allclose(f["final_hidden"], hs[-1])
    assert not f["aux_hidden"].requires_grad


def _features(policy, batch: RolloutBatch, pad_id: int, chunk: int = 4, aux_ids=(1, 3, 4)) -> list[dict]:
    feats = []
    for a in range(0, len(batch), chunk):
        part = RolloutBatch(batch.prompt_ids[a:a + chunk], batch.response_ids[a:a + chunk],
                            batch.rollout_logprobs[a:a + chunk], batch.group[a:a + chunk])
        t = part.to_padded(pad_id)
        with torch.no_grad(), capture_eagle3_features(policy, list(aux_ids)) as f:
            policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
        feats.append(_feature_dict(policy, t["input_ids"], f, t["response_mask"]))
    return feats


def _feature_dict(policy, input_ids, captured, loss_mask, temperatures=(1.0,)) -> dict:
    """Features as a Train rank ships them (``policy_update``): bf16 hidden
    states and the verifier's normalisers."""
    return {"input_ids": input_ids, "aux_hidden": captured["aux_hidden"].bfloat16(),
            "final_hidden": captured["final_hidden"].bfloat16(), "loss_mask": loss_mask,
            **verifier_normalizers(captured["final_hidden"], loss_mask, policy.lm_head.weight, temperatures)}


def _verifier(policy, rows=None):
    """What rank 0 sends the DraftTrainer (``verifier_output_weights``)."""
    out = policy.lm_head.weight.detach().bfloat16()
    return {"embed": policy.model.embed_tokens.weight.detach().bfloat16(),
            "lm_head_rows": out if rows is None else out[rows]}



def test_replay_drafting_follows_the_drafts_until_one_misses():
    """vLLM's verify steps on a sampled response: drafting starts after the
    prefill's token, accepts the leading drafts equal to the sampled tokens,
    emits one more and drafts again after it; drafts are checked up to the
    response's last token only (padding follows)."""
    from rayspec.draft.loss import replay_drafting

    # prompt of 3 tokens (0..2), response of 7 (3..9), then padding
    ids = torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 0, 0]])
    mask = torch.zeros(1, 11)
    mask[0, 2:9] = 1
    drafts = torch.full((1, 12, 3), -1)
    drafts[0, 2] = torch.tensor([11, 12, 99])  # from t = 2 (after token 10): 2 accepted
    drafts[0, 5] = torch.tensor([14, 15, 16])  # from t = 5 (after 13): all 3
    drafts[0, 9] = torch.tensor([0, 0, 0])  # from t = 9: past the response, the padding matches nothing
    assert replay_drafting(drafts, ids, mask, 3) == (2, [2, 2, 1])
    # k = 2: t = 2 accepts 11, 12 and emits 13; t = 5 accepts 14, 15 and emits 16: done
    assert replay_drafting(drafts, ids, mask, 2) == (2, [2, 2])
    # drafting stops after max_new_tokens; the last drafts are checked beyond it
    assert replay_drafting(drafts, ids, mask, 3, max_new_tokens=5) == (2, [2, 2, 1])
    assert replay_drafting(drafts, ids, mask, 3, max_new_tokens=4) == (1, [1, 1, 0])
    # a response ending at 15: the draft of 16 from t = 5 matches a token outside it
    mask[0, 8] = 0
    assert replay_drafting(drafts, ids, mask, 3) == (2, [2, 2, 0])


def test_acceptance_by_share_buckets_drafts_by_the_sequences_still_in_flight():
    """A draft made after p generated tokens falls in bucket j where the
    sequences longer than p are N / 2^(j+1) < running <= N / 2^j; thin
    buckets are left out; the buckets' drafts add up to the replay's."""
    from rayspec.draft.loss import acceptance_by_share, drafting_counts

    # 4 sequences: two of 3 tokens, two of 12; drafts at (generated, accepted)
    chains = [(3, [(1, 1)]), (3, [(1, 0)]),
              (12, [(1, 2), (4, 0), (5, 1), (7, 0), (8, 0), (9, 0), (10, 0)]),
              (12, [(1, 2), (4, 1), (6, 0), (7, 0), (8, 0), (9, 0), (10, 0)])]
    # p < 3: all 4 in flight (bucket 0, share 1); from p = 3 on 2 of 4 (bucket 1, share 1/2)
    assert acceptance_by_share(chains, 2, min_drafts=1) == [
        (1.0, 4, [3 / 4, 2 / 4]), (0.5, 12, [2 / 12, 0.0])]
    assert sum(n for _, n, _ in acceptance_by_share(chains, 2, min_drafts=1)) == drafting_counts(chains, 2)[0] == 16
    assert acceptance_by_share(chains, 2, min_drafts=5) == [(0.5, 12, [2 / 12, 0.0])]
    # responses too short to draft from still count among the N that started
    assert acceptance_by_share(chains + [(0, []), (1, []), (1, []), (0, [])], 2, min_drafts=1) == [
        (0.5, 4, [3 / 4, 2 / 4]), (0.25, 12, [2 / 12, 0.0])]


def test_acceptance_length_se_clusters_drafts():
    """The ratio estimator's standard error over clusters: (1 + accepted)
    summed per sequence (or per GRPO group) against its drafts; sequences
    without drafts do not count, and one cluster alone gives no estimate
    (0.0)."""
    from rayspec.draft.loss import acceptance_length_se, drafting_clusters

    # tokens per sequence 3, 6, 1 over drafts 2, 2, 1: length 2.0, residuals
    # -1, 2, -1: variance 3 / 2 * 6 / 5^2 = 0.36
    chains = [(9, [(1, 0), (2, 1)]), (9, [(1, 2), (4, 2)]), (3, [(1, 0)]), (1, [])]
    assert acceptance_length_se(chains) == pytest.approx(0.6)
    assert acceptance_length_se(chains[:1]) == acceptance_length_se([]) == 0.0
    # equal sequences: no spread between them, whatever their drafts' spread
    assert acceptance_length_se([(9, [(1, 0), (2, 2)])] * 4) == 0.0
    # clustered by prompt (GRPO group): tokens 9 and 3 over drafts 4 and 2,
    # length 2.0, residuals 1 and -1: variance 2 / 1 * 2 / 6^2
    grouped = [chains[0], chains[1], chains[2], (3, [(1, 1)])]
    assert acceptance_length_se(grouped, [7, 7, 9, 9]) == pytest.approx(1 / 3)
    assert acceptance_length_se(grouped) == pytest.approx((4 / 3 * 6 / 36) ** 0.5)
    assert acceptance_length_se(grouped, [7, 7, 7, 7]) == 0.0  # one cluster: unknown
    assert drafting_clusters(grouped, [7, 7, 9, 9]) == 2 and drafting_clusters(chains) == 3  # (1, []) drafted nothing
    with pytest.raises(ValueError, match="3 ids for 4 sequences"):
        acceptance_length_se(grouped, [7, 7, 9])


def test_draft_trainer_clusters_the_estimate_by_grpo_group(tiny_policy, tmp_path, monkeypatch):
    """The estimate's standard error takes the features' ``group`` ids (the
    policy update sends each micro-batch's) as its clusters, in the step's
    sequence order; a chunk without them counts each sequence alone."""

    save_head(init_head(tiny_policy), tmp_path / "head")
    g = torch.Generator().manual_seed(4)
    batch = RolloutBatch([torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)],
                         [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(4)],
                         [[0.0] * 8] * 4, [5, 5, 6, 6])
    chunks = _features(tiny_policy, batch, 0, chunk=2)
    seen = []
    monkeypatch.setattr(trainer_mod, "acceptance_length_se",
                        lambda chains, clusters: seen.append((len(chains), clusters)) or 0.25)
    t = DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=1, num_speculative_tokens=2,
                     draft_sample_method="greedy")
    t.submit_features([{**chunks[0], "group": torch.tensor([5, 5])}, {**chunks[1], "group": torch.tensor([6, 6])}])
    m = t.train(_verifier(tiny_policy), 2)
    assert m["draft_acceptance_se"] == 0.25 and m["draft_acceptance_clusters"] == 2
    assert m["draft_feature_bytes"] == sum(v.nbytes for c in chunks for v in c.values()) + 4 * 8  # + the groups
    t.submit_features(chunks)
    t.train(_verifier(tiny_policy), 2)
    assert seen == [(4, [5, 5, 6, 6]), (4, [-1, -2, -3, -4])]


def test_draft_trainer_learns_verifier_argmax(tiny_policy, tiny_llama_dir, tmp_path, monkeypatch):
    save_head(init_head(tiny_policy), tmp_path / "head")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)]
    with torch.no_grad():
        seqs = tiny_policy.generate(torch.tensor(prompts), max_new_tokens=12, do_sample=False)
    batch = RolloutBatch(prompts, [s[6:].tolist() for s in seqs], [[0.0] * 12] * 4, [0, 1, 2, 3])
    trainer = DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=2, num_threads=2, num_speculative_tokens=3)
    with pytest.raises(RuntimeError, match="no features"):
        trainer.train(_verifier(tiny_policy), 1)
    trims = []
    monkeypatch.setattr(trainer_mod, "trim_host_heap", lambda: trims.append(trainer.version))
    trainer.submit_features(_features(tiny_policy, batch, 0))
    first = trainer.train(_verifier(tiny_policy), 1)
    trainer.submit_features(_features(tiny_policy, batch, 0))
    last = trainer.train(_verifier(tiny_policy), 40)
    assert trims == [1, 2]  # after each call's training, the actor idles with its heap trimmed
    assert last["draft_loss"] < first["draft_loss"]
    assert last["draft_top1_per_step"][0] > first["draft_top1_per_step"][0] + 0.2
    # the estimate replays the head each call began with: the untrained one,
    # then the one trained a step on these very (greedy) sequences
    est0, est1 = first["draft_acceptance_estimate"], last["draft_acceptance_estimate"]
    assert len(est0) == len(est1) == 3 and all(0 <= r <= 1 for r in est0 + est1)
    assert est1[0] > est0[0] and est1[0] >= est1[1] >= est1[2]
    assert last["draft_version"] == 2
    assert last["draft_acceptance_se"] > 0  # 4 sequences that drafted
    # every chunk of the step is replayed, also those left for later steps' replay
    trained = load_head(trainer.save(str(tmp_path / "trained")))
    feats = _features(tiny_policy, batch, 0, chunk=2)
    again = DraftTrainer(str(tmp_path / "trained"), lr=1e-3, ttt_steps=2, num_threads=2, num_speculative_tokens=3)
    again.submit_features(feats)
    again_m = again.train(_verifier(tiny_policy), 1)
    est = again_m["draft_acceptance_estimate"]
    embed = tiny_policy.model.embed_tokens.weight.detach().bfloat16().float()
    counts = [replay_drafting(draft_top1(trained, f["input_ids"], f["aux_hidden"], embed, 3),
                              f["input_ids"], f["loss_mask"], 3) for f in feats]
    drafts = sum(n for n, _ in counts)
    assert est == pytest.approx([sum(a[j] for _, a in counts) / drafts for j in range(3)]) and est[0] > 0.5
    # by share of the step in flight: 4 sequences of 12 tokens, all in flight throughout
    assert again_m["draft_acceptance_by_share"] == [[1.0, drafts, pytest.approx(est)]]
    # replicas sampling their drafts: at temperature 0 they are the greedy ones;
    # at 1 the replay draws acceptances (test_sampled_drafts_replay_predicts_replica_acceptance)
    for temperature in (0.0, 1.0):
        sampled = DraftTrainer(str(tmp_path / "trained"), lr=1e-3, ttt_steps=2, num_threads=2,
                               num_speculative_tokens=3, draft_sample_method="probabilistic", temperature=temperature)
        sampled.submit_features(feats)
        m = sampled.train(_verifier(tiny_policy), 1)
        # the step trains as the greedy replay's does (at T = 1 on the replay's verifier targets)
        assert m["draft_loss"] == pytest.approx(again_m["draft_loss"], rel=1e-5)
        if temperature == 0.0:
            assert m["draft_acceptance_estimate"] == pytest.approx(est)
        else:
            rates = m["draft_acceptance_estimate"]
            assert len(rates) == 3 and all(0 <= r <= 1 for r in rates) and rates != pytest.approx(est)
            [(share, _, by_share)] = m["draft_acceptance_by_share"]
            assert share == 1.0 and by_share == pytest.approx(rates)


def test_draft_trainer_trains_on_features_as_they_arrive(tiny_policy, tmp_path):
    """train() starts before the policy update has made the features: it
    waits for the expected chunks, uses each one as it comes, keeps the
    output layer equal to the verifier's, and times out on a missing one."""
    import threading
    import time

    save_head(init_head(tiny_policy), tmp_path / "head")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)]
    batch = RolloutBatch(prompts, [torch.randint(0, 1000, (8,), generator=g).tolist()] * 4,
                         [[0.0] * 8] * 4, [0, 1, 2, 3])
    chunks = _features(tiny_policy, batch, 0, chunk=2)
    trainer = DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=2, num_threads=1)
    verifier = _verifier(tiny_policy)
    verifier["lm_head_rows"] = verifier["lm_head_rows"] * 0.5  # the verifier's output layer moved
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=trainer.train(verifier, 3, expect=2)))
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive()  # waiting for the first chunk
    for c in chunks:
        trainer.submit_features([c])
    worker.join(timeout=120)
    assert out["r"]["draft_version"] == 1 and len(out["r"]["draft_top1_per_step"]) == 2
    assert torch.equal(trainer.head.lm_head.weight, verifier["lm_head_rows"].float())
    with pytest.raises(RuntimeError, match="no features arrived within 0 s"):
        trainer.train(verifier, 1, expect=1, timeout_s=0.1)


def test_a_reduced_vocab_draft_trainer_takes_only_its_rows_of_the_output_layer(tiny_policy, tmp_path):
    """Rank 0 sends the rows of ``draft_ids()`` (``verifier_output_weights``),
    which become the head's output layer, or, with tied embeddings, only the
    embedding they are taken from; the whole layer is refused, naming both
    shapes."""
    ids = torch.tensor([900, 3, 42, 7, 1000, 2])
    save_head(init_head(tiny_policy, draft_vocab=ids), tmp_path / "head")
    trainer = DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=1, num_threads=1)
    rows = trainer.draft_ids()
    assert rows.device.type == "cpu" and rows.tolist() == sorted(ids.tolist())
    batch = RolloutBatch([[5, 6, 7]] * 2, [[8, 9, 10, 11]] * 2, [[0.0] * 4] * 2, [0, 0])
    trainer.submit_features(_features(tiny_policy, batch, 0, chunk=2))
    V, H = tiny_policy.config.vocab_size, tiny_policy.config.hidden_size
    with pytest.raises(ValueError, match=rf"lm_head_rows is \({V}, {H}\), this head's output layer \(6, {H}\)"):
        trainer.train(_verifier(tiny_policy), 1)
    verifier = _verifier(tiny_policy, rows)
    assert trainer.train(verifier, 1)["draft_version"] == 1
    assert torch.equal(trainer.head.lm_head.weight, verifier["lm_head_rows"].float())
    trainer.submit_features(_features(tiny_policy, batch, 0, chunk=2))
    tied = {"embed": verifier["embed"] * 0.5}  # tiny_policy ties them
    assert trainer.train(tied, 1)["draft_version"] == 2
    assert torch.equal(trainer.head.lm_head.weight, tied["embed"][rows].float())


def test_draft_trainer_state_roundtrips_through_checkpoint_files(tiny_policy, tmp_path):
    """get_state -> safetensors/JSON -> set_state on a fresh trainer: the next
    step (which replays the buffer) trains exactly as the original does; a
    train() call still waiting from before the restore is abandoned."""
    import threading
    import time

    from rayspec.draft.state import load_draft_state, save_draft_state

    save_head(init_head(tiny_policy), tmp_path / "head")
    g = torch.Generator().manual_seed(2)
    batches = [RolloutBatch([torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)],
                            [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(4)],
                            [[0.0] * 8] * 4, [0, 1, 2, 3]) for _ in range(3)]
    verifier = _verifier(tiny_policy)

    def trainer():
        return DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=2, num_threads=1,
                            buffer_steps=2, seed=3)

    original = trainer()
    for b in batches[:2]:
        original.submit_features(_features(tiny_policy, b, 0, chunk=2))
        original.train(verifier, 3, expect=2)
    save_draft_state(original.get_state(), tmp_path)
    restored = trainer()
    stale = {}

    def wait_for_features():  # a call from a failed attempt, waiting for features that never come
        try:
            restored.train(verifier, 1, expect=1, timeout_s=60)
        except RuntimeError as e:
            stale["error"] = str(e)

    waiting = threading.Thread(target=wait_for_features)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive()
    assert restored.set_state(*load_draft_state(tmp_path)) == 2
    waiting.join(timeout=10)
    assert "abandoned" in stale["error"]
    outs = []
    for t in (original, restored):
        t.submit_features(_features(tiny_policy, batches[2], 0, chunk=2))
        outs.append(t.train(verifier, 6, expect=2))  # 2 new chunks, then 4 replayed
    assert outs[0]["draft_loss"] == outs[1]["draft_loss"]
    assert outs[0]["draft_version"] == outs[1]["draft_version"] == 3
    for (k, a), b in zip(original.head.state_dict().items(), restored.head.state_dict().values()):
        assert torch.equal(a, b), k
    # a checkpoint from before features carried the normalisers: its replay chunks are dropped,
    # the rest restored, and the next step trains on its new chunks alone
    tensors, meta = original.get_state()
    old = trainer()
    assert old.set_state({k: v for k, v in tensors.items() if ".target_" not in k}, meta) == 3
    assert [len(step) for step in old._buffer] == [0, 0]
    old.submit_features(_features(tiny_policy, batches[0], 0, chunk=2))
    assert old.train(verifier, 3, expect=2)["draft_version"] == 4


def test_draft_trainer_reset_starts_over_as_a_new_one(tiny_policy, tmp_path):
    """``reset`` (Train workers restarted before the first checkpoint) puts
    the trainer back where a new one starts: the next steps train exactly as
    a new trainer's first steps (head, AdamW moments, replay buffer, RNG),
    and a ``train`` call still waiting from the failed attempt is abandoned."""
    import threading
    import time

    save_head(init_head(tiny_policy), tmp_path / "head")
    g = torch.Generator().manual_seed(5)
    batches = [RolloutBatch([torch.randint(0, 1000, (6,), generator=g).tolist() for _ in range(4)],
                            [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(4)],
                            [[0.0] * 8] * 4, [0, 0, 1, 1]) for _ in range(2)]
    verifier = _verifier(tiny_policy)

    def trainer():
        return DraftTrainer(str(tmp_path / "head"), lr=1e-2, ttt_steps=2, num_threads=1,
                            buffer_steps=2, seed=3)

    def run(t):
        outs = []
        for b in batches:
            t.submit_features(_features(tiny_policy, b, 0, chunk=2))
            outs.append(t.train(verifier, 3, expect=2))  # the second step replays the first's chunks
        return outs

    used = trainer()
    first = run(used)
    assert first[-1]["draft_version"] == 2
    stale = {}

    def wait_for_features():
        try:
            used.train(verifier, 1, expect=1, timeout_s=60)
        except RuntimeError as e:
            stale["error"] = str(e)

    waiting = threading.Thread(target=wait_for_features)
    waiting.start()
    time.sleep(0.3)
    assert used.reset() == 2 and used.version == 0
    waiting.join(timeout=10)
    assert "abandoned" in stale["error"]
    again, fresh = run(used), run(trainer())
    assert [o["draft_loss"] for o in again] == [o["draft_loss"] for o in fresh] == \
        [o["draft_loss"] for o in first]
    assert [o["draft_version"] for o in again] == [1, 2]
    assert used.reset() == 2 and used.reset() == 0


def _public_eagle3_head(policy, token_ids: torch.Tensor, out) -> None:
    """Write a reduced-vocabulary head for ``policy`` in the layout of the
    published EAGLE-3 heads (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): the
    reference code's config keys (no ``eagle_config``: vLLM's default aux
    layers), fp16 ``pytorch_model.bin`` with ``d2t`` / ``t2d`` as it builds
    them (d2t = draft-to-target offsets, t2d = bool mask)."""
    head = init_head(policy, seed=5, draft_vocab=token_ids)
    c = policy.config
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id, "hidden_act": "silu", "hidden_size": c.hidden_size,
        "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "pad_token_id": 0,
        "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.vocab_size,
        "draft_vocab_size": len(token_ids)}))
    ids = token_ids.sort().values
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    sd = {k: v.half() for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    torch.save({"d2t": ids - torch.arange(len(ids)), "t2d": t2d, **sd}, out / "pytorch_model.bin")


def test_online_lr_continues_a_warm_heads_rate(tmp_path):
    """draft.lr null: a fresh head learns at 1e-3; a given (trained) head
    continues at its warm start's final rate, or at 1e-4 without a record;
    a set draft.lr wins; a bad record names its file."""
    from rayspec.models.acceptance import write_acceptance

    assert online_lr(None, tmp_path, trained=False)[0] == 1e-3
    assert online_lr(None, tmp_path, trained=True)[0] == pytest.approx(1e-4)
    write_acceptance(tmp_path, [0.46, 0.23], final_lr=1.5e-4)
    lr, why = online_lr(None, tmp_path, trained=True)
    assert lr == 1.5e-4 and "final_lr" in why
    assert online_lr(None, tmp_path, trained=False)[0] == 1e-3  # the run's own head, not the record's
    assert online_lr(5e-4, tmp_path, trained=True) == (5e-4, "draft.lr")
    for bad in (0, -1e-4, "1e-4", True):
        write_acceptance(tmp_path, [0.46], final_lr=bad)
        with pytest.raises(ValueError, match=f"{tmp_path}/acceptance.json: final_lr must be a number > 0"):
            online_lr(None, tmp_path, trained=True)


def test_training_cadence_trains_while_drafted_with_or_learning():
    """The head trains every step while its rollouts draft (in at least
    min_drafted_share of their tokens) or its replayed acceptance length
    still rises by min_gain; idle and no longer learning, every
    idle_every-th step; idle_every 0 trains every step."""
    cadence = TrainingCadence(idle_every=3, min_gain=0.02, min_drafted_share=0.1)
    assert cadence.due(0.0)  # no estimate yet: learning
    cadence.trained([0.30, 0.10])
    assert cadence.due(0.0)  # one estimate: nothing to compare, learning
    cadence.trained([0.35, 0.12])  # +0.07: still learning
    assert cadence.due(0.0)
    cadence.trained([0.36, 0.12])  # +0.01: no longer
    assert [cadence.due(0.0) for _ in range(6)] == [False, False, True, False, False, True]
    assert cadence.due(0.3) and cadence.idle_steps == 0  # a rollout that drafted resets the count
    # a tail of a few sequences drafting (5% of the tokens) is idle
    assert [cadence.due(0.05) for _ in range(3)] == [False, False, True]
    cadence.trained([0.45, 0.2])  # the idle step's training moved it: learning again
    assert cadence.due(0.0)
    cadence.trained([])  # no estimate (k unknown to the DraftTrainer): counts as learning
    assert cadence.due(0.0)
    always = TrainingCadence(idle_every=0, min_gain=0.02)
    always.trained([0.3]), always.trained([0.3])
    assert all(always.due(0.0) for _ in range(5))
    # min_drafted_share 0: any draft counts
    anydraft = TrainingCadence(idle_every=3, min_gain=0.02, min_drafted_share=0.0)
    anydraft.trained([0.3]), anydraft.trained([0.3])
    assert [anydraft.due(0.01), anydraft.due(0.0), anydraft.due(0.01)] == [True, False, True]


def test_training_cadence_of_a_warm_head_starts_idle(tmp_path):
    """A head with a recorded acceptance length (its warm start's) is not
    learning until an estimate rises min_gain above the record: idle, it
    trains at the idle_every-th step, not at the first two."""
    from rayspec.models.acceptance import write_acceptance

    write_acceptance(tmp_path, [0.5, 0.25], draft_sample_method="probabilistic")
    assert recorded_acceptance_length(tmp_path, "greedy", 3) is None  # another method's rates
    prior = recorded_acceptance_length(tmp_path, "probabilistic", 3)
    assert prior == pytest.approx(1.875)  # 1 + 0.5 + 0.25 + 0.125 (geometric a = 0.5)
    assert recorded_acceptance_length(tmp_path, "probabilistic", 1) == pytest.approx(1.5)
    cadence = TrainingCadence(idle_every=3, min_gain=0.02, min_drafted_share=0.1, prior=prior)
    assert [cadence.due(0.0) for _ in range(3)] == [False, False, True]
    cadence.trained([0.49, 0.26, 0.13])  # +0.005 over the record: still not learning
    assert not cadence.due(0.0)
    assert cadence.due(0.2)  # drafted: trains
    cadence.trained([0.55, 0.3, 0.15])  # +0.13: learning
    assert cadence.due(0.0)
    # a rise within twice the standard error of the difference is noise
    cadence.trained([0.6, 0.3, 0.15], se=0.04)  # +0.05 against 2 * hypot(0.04, 0) = 0.08
    assert not cadence.due(0.0)
    cadence.trained([0.71, 0.3, 0.15], se=0.03)  # +0.11 against 2 * hypot(0.03, 0.04) = 0.10
    assert cadence.due(0.0)


def test_training_cadence_takes_few_clusters_into_account():
    """With few GRPO groups the standard error is itself uncertain: a rise
    must exceed Student's t quantile (df: clusters - 1, the fewer of the two
    estimates') in standard errors, not 2 (Cameron and Miller 2015)."""
    from rayspec.draft.trainer import learning_threshold

    assert learning_threshold(0) == 2.0
    assert learning_threshold(3) == pytest.approx(3.307, abs=1e-3)
    assert 2.0 < learning_threshold(100) < 2.05
    # the GSM8K case: a warm head recorded at 1.80, step 4's estimate 1.935 +- 0.048 over 4 groups
    for clusters, learning in ((4, False), (0, True), (200, True)):
        cadence = TrainingCadence(idle_every=4, min_gain=0.02, prior=1.8)
        cadence.trained([0.5, 0.285, 0.15], se=0.048, clusters=clusters)
        assert cadence.learning is learning, clusters
    cadence = TrainingCadence(idle_every=4, min_gain=0.02)
    cadence.trained([0.5], se=0.01, clusters=200)
    cadence.trained([0.55], se=0.01, clusters=3)  # +0.05: 2 clusters' t (4.53) x 0.014 = 0.064
    assert not cadence.learning
    state = json.loads(json.dumps(cadence.state_dict()))
    resumed = TrainingCadence(idle_every=4, min_gain=0.02)
    resumed.load_state_dict(state)
    resumed.trained([0.6], se=0.01, clusters=200)  # +0.05 against the restored 3 clusters
    assert not resumed.learning


def test_training_cadence_resumes_from_its_state():
    """A checkpoint's cadence decides a resumed run's steps as the
    uninterrupted run's; a fresh one would train at once (learning)."""
    cadence = TrainingCadence(idle_every=3, min_gain=0.02)
    cadence.trained([0.30]), cadence.trained([0.30])
    assert not cadence.due(0.0)
    state = json.loads(json.dumps(cadence.state_dict()))
    resumed = TrainingCadence(idle_every=3, min_gain=0.02)
    resumed.load_state_dict(state)
    assert [resumed.due(0.0) for _ in range(4)] == [cadence.due(0.0) for _ in range(4)] \
        == [False, True, False, False]
    resumed.trained([0.40])
    assert resumed.due(0.0)  # +0.1 against the restored estimate: learning
    resumed.trained([0.40], se=0.05)
    again = TrainingCadence(idle_every=3, min_gain=0.02)
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    again.trained([0.52], se=0.0)  # +0.12 against 2 * 0.05 of the restored estimate
    assert again.learning
    again.trained([0.6], se=0.05)  # +0.08 against 2 * 0.05: noise
    assert not again.learning


def test_training_cadence_backs_off_while_the_head_is_idle():
    """Idle and not learning, the head trains at idle steps spaced
    idle_every, then twice as far each time, up to max_idle_every; a
    drafted rollout or a rise of the estimate brings it back to every step,
    and a resumed run keeps the spacing."""
    cadence = TrainingCadence(idle_every=2, min_gain=0.02, min_drafted_share=0.1, prior=1.5, max_idle_every=8)
    trained_at = []
    for step in range(1, 31):
        if cadence.due(0.0):
            trained_at.append(step)
            cadence.trained([0.5])  # the recorded length: not learning
    assert trained_at == [2, 6, 14, 22, 30]  # spacing 2, 4, 8, then capped at 8
    assert cadence.due(0.3) and cadence.spacing == 2  # drafted: every step, and the backoff starts over
    cadence.trained([0.5])
    assert [cadence.due(0.0) for _ in range(6)] == [False, True, False, False, False, True]
    cadence.trained([0.6])  # +0.1: learning
    assert cadence.due(0.0) and cadence.spacing == 2
    resumed = TrainingCadence(idle_every=2, min_gain=0.02, max_idle_every=8)
    cadence.trained([0.6]), cadence.due(0.0), cadence.due(0.0)  # not learning; an idle step trains: spacing 4
    resumed.load_state_dict(json.loads(json.dumps(cadence.state_dict())))
    assert [resumed.due(0.0) for _ in range(4)] == [cadence.due(0.0) for _ in range(4)] == [False, False, False, True]


def test_drafted_share_counts_the_tokens_of_steps_that_carried_a_draft():
    # 10 drafted steps emitted 10 + 6 accepted tokens of 64
    assert SpecStats(num_drafts=10, num_accepted_tokens=6, output_tokens=64).drafted_share == 0.25
    assert SpecStats(output_tokens=64).drafted_share == 0.0 and SpecStats().drafted_share == 0.0


def test_verifier_targets_from_the_draft_rows_and_the_train_ranks_normalisers_are_the_whole_softmax():
    """The Train rank takes the log-normaliser and the argmax over all V
    tokens a block of rows at a time (``verifier_normalizers``); from them
    and the draft vocabulary's rows alone the DraftTrainer's targets are the
    softmax over the whole bf16 output layer at each temperature, restricted
    to the draft tokens and not renormalised, with the whole argmax. A
    temperature the features lack is refused, naming those they carry."""
    from rayspec.draft.loss import verifier_targets

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 16), torch.randn(37, 16)
    loss_mask = torch.tensor([[0., 1, 1, 0], [1, 1, 0, 0]])
    ids = torch.tensor([0, 3, 5, 36])
    f = {"final_hidden": hidden.bfloat16(), "loss_mask": loss_mask,
         **verifier_normalizers(hidden, loss_mask, weight, (1.0, 0.7), rows=8)}
    assert f["target_lse"].shape == (2, 5, 2) and f["target_top"].dtype == torch.int64
    logits = hidden.bfloat16().float() @ weight.bfloat16().float().T  # [2, 5, 37]
    where = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]]).bool()
    for temperature in (1.0, 0.7):
        position, p, top = verifier_targets(f, weight.bfloat16()[ids], torch.float32, temperature, rows=3)
        whole = torch.softmax(logits[where] / temperature, -1)
        assert position.tolist() == [1, 2, 0, 1] and p.dtype == torch.float32 and p.shape == (4, 4)
        assert torch.allclose(p, whole[:, ids], rtol=1e-5, atol=1e-7)
        assert torch.equal(top, logits[where].argmax(-1))
    all_rows = verifier_targets(f, weight.bfloat16(), torch.float32)[1]
    assert torch.allclose(all_rows.sum(-1), torch.ones(4))  # every token's share: the whole distribution
    with pytest.raises(ValueError, match=r"normalisers at temperatures \[1.0, 0.699.*\], not at 0.5"):
        verifier_targets(f, weight.bfloat16()[ids], torch.float32, 0.5)


def test_draft_vocabulary_by_frequency():
    from rayspec.draft.vocab import coverage, select_draft_vocab, token_counts

    counts = token_counts([[5, 5, 5, 2, 2, 9], [9, 9, 7], []], 12)
    assert counts.tolist() == [0, 0, 2, 0, 0, 3, 0, 1, 0, 3, 0, 0]
    assert select_draft_vocab(counts, 3).tolist() == [2, 5, 9]  # most frequent, in id order
    assert select_draft_vocab(counts, 3, always=[11]).tolist() == [5, 9, 11]  # 5 and 9 tie: both beat 2
    assert select_draft_vocab(counts, 6).tolist() == [0, 1, 2, 5, 7, 9]  # unseen tokens by lowest id
    assert coverage(counts, torch.tensor([5, 9])) == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="draft.draft_vocab_size=13"):
        select_draft_vocab(counts, 13)
    with pytest.raises(ValueError, match=r"outside \[0, 12\)"):
        token_counts([[3, 12]], 12)


def test_reduced_vocab_head_roundtrips_and_drafts_in_policy_ids(tiny_policy, tmp_path):
    """d2t / t2d as vLLM and the published heads store them, the output layer
    is the policy's rows, and the loss reports agreement in policy token ids."""
    from rayspec.draft.loss import eagle3_loss

    ids = torch.tensor([900, 3, 42, 7, 1000, 2])
    head = init_head(tiny_policy, draft_vocab=ids)
    assert head.cfg["draft_vocab_size"] == 6 and head.cfg["vocab_size"] == tiny_policy.config.vocab_size
    assert head.draft_ids.tolist() == [2, 3, 7, 42, 900, 1000]
    assert head.d2t.tolist() == [2, 2, 5, 39, 896, 995] and int(head.t2d.sum()) == 6 and head.t2d[42]
    assert torch.equal(head.lm_head.weight, tiny_policy.lm_head.weight[head.draft_ids])
    sd = vllm_state_dict(head)
    assert sd["d2t"].dtype == torch.int64 and "t2d" not in sd and sd["fc.weight"].dtype == torch.bfloat16
    out = save_head(head, tmp_path / "head")
    again = load_head(out)
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
    # a sequence of draft-vocabulary tokens: agreement counts drafts mapped back to policy ids
    seq = torch.tensor([[3, 42, 7, 900, 2, 3, 42, 1000]])
    with torch.no_grad(), capture_eagle3_features(tiny_policy, [1, 3, 4]) as f:
        tiny_policy(input_ids=seq)
    # the verifier's argmax of the shipped (bf16) hidden states and output layer
    logits = f["final_hidden"].bfloat16().float() @ tiny_policy.lm_head.weight.bfloat16().float().T
    target = logits[0, 1:-1].argmax(-1)
    feats = _feature_dict(tiny_policy, seq, f, torch.ones(1, 7))
    loss, agree = eagle3_loss(again, feats, tiny_policy.model.embed_tokens.weight,
                              again.draft_rows(tiny_policy.lm_head.weight.bfloat16()), 1)
    with torch.no_grad():
        normed, _, _ = again.step(torch.nn.functional.embedding(seq[:, 1:], tiny_policy.model.embed_tokens.weight),
                               again.fc(f["aux_hidden"][:, :-1]), torch.arange(1, 8)[None])
    drafted = again.draft_ids[again.lm_head(normed[0, :-1]).argmax(-1)]
    assert agree[0] == pytest.approx((drafted == target).float().mean().item())
    assert torch.isfinite(loss)


def test_tv_term_is_the_rejection_probability_of_sampled_drafts(tiny_policy):
    """tv_weight adds w * (1 - sum_v min(p, q)) per draft step: the rejection
    probability that ``draft_overlap`` (checked against a replica in
    test_sampled_drafts_replay_predicts_replica_acceptance) gives, with q zero
    outside a reduced draft vocabulary, and it has a gradient."""
    from rayspec.draft.loss import _shift, draft_overlap, eagle3_loss, target_mask

    torch.manual_seed(0)
    head = init_head(tiny_policy, draft_vocab=torch.arange(0, 256, 2))
    seq = torch.randint(0, 256, (2, 12))
    loss_mask = torch.ones(2, 11)
    loss_mask[:, :3] = 0  # a prompt
    loss_mask[1, 9:] = 0  # padding
    with torch.no_grad(), capture_eagle3_features(tiny_policy, [1, 3, 4]) as f:
        tiny_policy(input_ids=seq)
    args = (head, _feature_dict(tiny_policy, seq, f, loss_mask), tiny_policy.model.embed_tokens.weight,
            head.draft_rows(tiny_policy.lm_head.weight), 3)
    with torch.no_grad():
        ce, _ = eagle3_loss(*args)
        overlap = draft_overlap(*args)
    valid = [_shift(target_mask(loss_mask), 1 + j).bool() for j in range(3)]
    tv = sum(1 - overlap[..., j][valid[j]].mean() for j in range(3)) / 3
    assert 0.5 < tv < 1  # an untrained head: most drafts rejected, and mass outside the draft vocabulary
    both, _ = eagle3_loss(*args, tv_weight=2.0)
    assert both.item() == pytest.approx(ce.item() + 2.0 * tv.item(), rel=1e-5)
    both.backward()
    ce_only, _ = eagle3_loss(*args)
    grad_both = head.fc.weight.grad.clone()
    head.zero_grad()
    ce_only.backward()
    assert not torch.allclose(grad_both, head.fc.weight.grad)


def test_head_checkpoints_with_bad_vocab_maps_are_refused(tiny_policy, tmp_path):
    out = save_head(init_head(tiny_policy), tmp_path / "head")
    cfg = json.loads((out / "config.json").read_text())
    cfg["draft_vocab_size"] = 1000
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_vocab_size=1000 .* needs a d2t tensor of shape \\[1000\\]"):
        load_head(out)
    pub = tmp_path / "public"
    _public_eagle3_head(tiny_policy, torch.arange(0, 64), pub)
    sd = torch.load(pub / "pytorch_model.bin", weights_only=True)
    sd["d2t"][5] = 10 ** 6  # maps past the vocabulary
    torch.save(sd, pub / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: d2t: .*must lie in"):
        load_head(pub)


def test_published_head_layout_loads_and_the_run_copy_names_its_aux_layers(tiny_policy, tiny_llama_dir, tmp_path):
    """A head in the published layout (config without eagle_config,
    pytorch_model.bin with d2t / t2d) passes the input checks and becomes the
    run's head as safetensors with vLLM's default aux layers written out."""
    from rayspec.config import load_config
    from rayspec.preflight import check_draft_matches_policy
    from rayspec.driver import prepare_draft

    pub = tmp_path / "public"
    ids = torch.randperm(tiny_policy.config.vocab_size, generator=torch.Generator().manual_seed(0))[:512]
    _public_eagle3_head(tiny_policy, ids, pub)
    head = load_head(pub)
    assert head.draft_ids.tolist() == ids.sort().values.tolist()
    assert torch.equal(head.lm_head.weight, tiny_policy.lm_head.weight[head.draft_ids].half().float())
    policy_cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    check_draft_matches_policy(policy_cfg, pub, "eagle3")
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "rollout.speculative_config.method=eagle3",
                             f"rollout.speculative_config.model={pub}"])
    head_dir, aux = prepare_draft(cfg, str(tiny_llama_dir), tmp_path / "run")
    assert aux == [2, 4, 5]  # vLLM's (2, L/2, L-3) for the 8-layer policy
    run_cfg = json.loads((tmp_path / "run" / "draft_head" / "config.json").read_text())
    assert run_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert torch.equal(load_head(head_dir).d2t, head.d2t)


def test_new_run_head_drafts_from_the_prompts_most_frequent_tokens(tiny_llama_dir, tmp_path):
    """A run without a head starts one whose draft vocabulary is the
    draft.draft_vocab_size most frequent tokens of its training prompts."""
    from rayspec.config import load_config
    from rayspec.data import arithmetic_problems, prompt_ids
    from rayspec.draft.vocab import coverage, token_counts
    from rayspec.driver import prepare_draft

    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "draft.draft_vocab_size=300"])
    head_dir, aux = prepare_draft(cfg, str(tiny_llama_dir), tmp_path)
    head = load_head(head_dir)
    tok = load_tokenizer(tiny_llama_dir)
    assert aux == [1, 3, 4] and head.draft_ids.numel() == 300 and head.t2d[tok.eos_token_id]
    prompts = [prompt_ids(tok, p) for p in arithmetic_problems(1000, 0)]
    counts = token_counts(prompts, tok.vocab_size)
    assert coverage(counts, head.draft_ids) == 1.0 or coverage(counts, head.draft_ids) > coverage(
        counts, torch.arange(300))  # the frequent tokens, not the first ids


@pytest.mark.slow
def test_trained_head_raises_replica_acceptance(tiny_policy, tiny_llama_dir, tmp_path, in_process_engine_core):
    """A published-layout head with a reduced draft vocabulary (the policy's
    most frequent response tokens) loads into a vLLM replica from
    ``pytorch_model.bin``; the DraftTrainer's head, refit into the running
    replica in place, is accepted more often than the untrained head on the
    same prompts, and greedy output is unchanged."""
    from rayspec.draft.eagle3 import aux_layer_ids
    from rayspec.draft.vocab import coverage, select_draft_vocab, token_counts
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env

    tok = load_tokenizer(tiny_llama_dir)
    prompts = [tok.encode(f"The number {i} is") for i in range(8)]
    with torch.no_grad():  # greedy, 4 tokens past the 32 served: what the last drafts are checked against
        longer = [tiny_policy.generate(torch.tensor([p]), max_new_tokens=36, do_sample=False,
                                       eos_token_id=None)[0].tolist() for p in prompts]
    seqs = [s[len(p):len(p) + 32] for p, s in zip(prompts, longer)]
    counts = token_counts(seqs, tiny_policy.config.vocab_size)
    vocab = select_draft_vocab(counts, 256)
    assert coverage(counts, vocab) == 1.0  # 8 x 32 response tokens
    _public_eagle3_head(tiny_policy, vocab, tmp_path / "head")
    eng = SpecVLLMEngine(str(tiny_llama_dir), {"method": "eagle3", "num_speculative_tokens": 3,
                                              "model": str(tmp_path / "head")},
                         dtype="float32", engine_kwargs=engine_kwargs(), env=cpu_engine_env(1, "all"))
    before_batch, before = eng.generate(prompts, n=1, temperature=0.0, max_tokens=32)
    assert before_batch.response_ids == seqs
    trainer = DraftTrainer(str(tmp_path / "head"), lr=1e-3, ttt_steps=3, num_threads=2)
    aux = aux_layer_ids(trainer.head.cfg, tiny_policy.config.num_hidden_layers)
    trainer.submit_features(_features(tiny_policy, before_batch, tok.pad_token_id, aux_ids=aux))
    trainer.train(_verifier(tiny_policy, trainer.draft_ids()), 80)
    # the trained head through the collective transport (gloo; this engine's worker
    # is rank 1 in this process), then the same head through the object store
    transport = CollectiveSender(RolloutClient(LocalReplicas([eng]), 1), "gloo", packed_buffer_size_bytes=1 << 20, timeout_s=120)
    assert transport.send("draft", trainer.vllm_weights(), 1).results() == [1]
    after_batch, after = eng.generate(prompts, n=1, temperature=0.0, max_tokens=32)
    transport.close()
    eng.receive_refit("draft", trainer.vllm_weights(), version=2)
    again_batch, again = eng.generate(prompts, n=1, temperature=0.0, max_tokens=32)
    # the drafter loses its own weights (as a wake that dropped them would): the next rollout
    # finds it and loads the newest draft its refits carry again before generating
    eng.llm.collective_rpc(_lose_draft_weights)
    _, repaired = eng.generate(prompts, n=1, temperature=0.0, max_tokens=32,
                               refits={"draft": (2, trainer.vllm_weights())})
    versions = eng.versions()
    eng.shutdown()
    assert [s.draft_stale_repairs for s in (before, after, again, repaired)] == [0, 0, 0, 1]
    assert (repaired.num_drafts, repaired.num_accepted_tokens) == (again.num_drafts, again.num_accepted_tokens)
    print(f"acceptance length untrained {before.acceptance_length:.2f} -> trained {after.acceptance_length:.2f} "
          f"(collective), {again.acceptance_length:.2f} (object store)")
    # Position by position, the head's own teacher-forced top-1 (the TTT
    # unroll it is trained with) is what the replica drafted: replaying each
    # greedy sequence through vLLM's verify steps predicts its acceptance counts.
    # (rayspec.draft.loss.replay_drafting, the DraftTrainer's acceptance estimate)
    served = load_head(tmp_path / "head")
    served.load_state_dict({**served.state_dict(), **{k: v.float() for k, v in trainer.vllm_weights().items()}})
    drafts, accepted = 0, [0, 0, 0]
    for p, full in zip(prompts, longer):
        ids = torch.tensor([full])
        with torch.no_grad(), capture_eagle3_features(tiny_policy, aux) as f:
            tiny_policy(input_ids=ids)
        top1 = draft_top1(served, ids, f["aux_hidden"], tiny_policy.model.embed_tokens.weight, 3)
        mask = torch.zeros(1, len(full) - 1)
        mask[0, len(p) - 1:] = 1  # 36 greedy tokens: the served 32 and 4 the last drafts are checked against
        n, acc = replay_drafting(top1, ids, mask, 3, max_new_tokens=32)
        drafts, accepted = drafts + n, [a + b for a, b in zip(accepted, acc)]
    assert (drafts, accepted) == (after.num_drafts, after.accepted_per_pos)
    assert after_batch.response_ids == before_batch.response_ids  # speculation never changes greedy output
    assert after.acceptance_length > before.acceptance_length + 0.3
    assert (again.num_drafts, again.num_accepted_tokens) == (after.num_drafts, after.num_accepted_tokens)
    assert versions["draft"] == 2


def _lose_draft_weights(worker) -> None:
    """In a vLLM worker: zero the EAGLE-3 head's norms (its linear layers
    are packed copies on the CPU, ``cpu_fixes``; the norms are the tensors
    it computes with)."""
    for name, p in worker.model_runner.get_draft_model().named_parameters():
        if "norm" in name:
            p.data.zero_()


def _replayed_rates(head, policy, batch: RolloutBatch, k: int, temperature: float, draws: int = 40):
    """(drafts, accepted per position) of ``draws`` replays of sampled drafts
    on ``batch`` (loss.draft_overlap, loss.sampled_hits), in sum."""
    from rayspec.draft.loss import draft_overlap, drafting_counts, replay_chains, sampled_hits

    t = batch.to_padded(0)
    with torch.no_grad(), capture_eagle3_features(policy, [1, 3, 4]) as f:
        policy(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
    feats = _feature_dict(policy, t["input_ids"], f, t["response_mask"], (temperature,))
    overlap = draft_overlap(head, feats, policy.model.embed_tokens.weight, head.draft_rows(policy.lm_head.weight),
                            k, temperature)
    g = torch.Generator().manual_seed(0)
    drafts, accepted = 0, [0] * k
    for _ in range(draws):
        n, acc = drafting_counts(replay_chains(sampled_hits(overlap, g), t["response_mask"], k), k)
        drafts, accepted = drafts + n, [a + b for a, b in zip(accepted, acc)]
    return drafts, accepted


@pytest.mark.slow
def test_sampled_drafts_replay_predicts_replica_acceptance(tmp_path, in_process_engine_core):
    """``draft_sample_method: probabilistic``: vLLM accepts a draft sampled
    from the head's q with probability sum_v min(p, q) (``loss.draft_overlap``),
    so the DraftTrainer's replay of sampled drafts predicts a replica's
    acceptance per position, for an untrained head and a trained one, on a
    Markov-chain policy (exact, peaked next-token distributions); the trained
    head's sampled drafts are accepted above the greedy drafts' ceiling
    E[max_v p(v)]."""
    from rayspec.models import make_markov_llama
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env
    from rayspec.tools.lossless import markov_logits

    k, temp, n_tokens = 3, 1.0, 96
    policy_dir = make_markov_llama(tmp_path / "policy", markov_logits(32, 6))
    policy = load_policy(policy_dir).float().eval()
    head = init_head(policy, [1, 3, 4])
    save_head(head, tmp_path / "head")
    eng = SpecVLLMEngine(str(policy_dir), {"method": "eagle3", "num_speculative_tokens": k,
                                           "model": str(tmp_path / "head"), "draft_sample_method": "probabilistic"},
                         dtype="float32", engine_kwargs=engine_kwargs(skip_tokenizer_init=True, max_num_seqs=64),
                         env=cpu_engine_env(1, "all"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 31, (8,), generator=g).tolist() for _ in range(16)]
    try:
        measured = {}
        batch, stats = eng.generate(prompts, n=4, temperature=temp, max_tokens=n_tokens, seed=1)
        measured["untrained"] = (head, batch, stats)
        trainer = DraftTrainer(str(tmp_path / "head"), lr=3e-3, ttt_steps=k, num_threads=2)
        trainer.submit_features(_features(policy, batch, 0, chunk=16, aux_ids=[1, 3, 4]))
        trainer.train(_verifier(policy), 40)
        trained = load_head(tmp_path / "head")
        trained.load_state_dict({**trained.state_dict(), **{n: v.float() for n, v in trainer.vllm_weights().items()}})
        eng.receive_refit("draft", trainer.vllm_weights(), version=2)
        batch, stats = eng.generate(prompts, n=4, temperature=temp, max_tokens=n_tokens, seed=2)
        measured["trained"] = (trained, batch, stats)
    finally:
        eng.shutdown()
    rates = {}
    for name, (h, batch, stats) in measured.items():
        drafts, accepted = _replayed_rates(h.eval(), policy, batch, k, temp)
        rates[name] = ([a / drafts for a in accepted], [a / stats.num_drafts for a in stats.accepted_per_pos])
        print(name, "replayed", [f"{r:.3f}" for r in rates[name][0]], "measured",
              [f"{r:.3f}" for r in rates[name][1]], "drafts", stats.num_drafts)
        # binomial noise of ~1500 drafts (~0.013) plus the teacher forcing's bias past position 0
        assert rates[name][0] == pytest.approx(rates[name][1], abs=0.05), name
    with torch.no_grad():
        t = measured["trained"][1].to_padded(0)
        probs = torch.softmax(policy(input_ids=t["input_ids"]).logits[:, :-1] / temp, -1)
        ceiling = probs.max(-1).values[t["response_mask"].bool()].mean().item()
    print(f"greedy ceiling E[max p] {ceiling:.3f}")
    assert rates["trained"][1][0] > ceiling + 0.1 > rates["untrained"][1][0] + 0.1
