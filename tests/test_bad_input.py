"""Bad models, drafts and datasets stop ``jobs.grpo`` before Ray starts or
anything is written, with exit status 2 and a message naming the key and the
file (docs/bad-input.md lists every bad input and the test that tries it).
Pickle checkpoints and custom modelling code are refused, not loaded: the
code they carry never runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from jobs import grpo
from rayspec.models.acceptance import write_acceptance
from tests.conftest import MARKER, copy_model_dir, planted_policy


@pytest.mark.parametrize("kind, fragments", [
    ("no-config", ["model.path=", "no config.json"]),
    ("not-causal-lm", ["model.path=", "architectures=['BertModel']", "not a causal LM"]),
    ("custom-code", ["model.path=", "auto_map", "trust_remote_code is off"]),
    ("pickle-weights", ["model.path=", "no *.safetensors weights", "pytorch_model.bin", "pickle"]),
])
def test_bad_policy_stops_the_run(kind, fragments, tmp_path, tiny_llama_dir, capsys):
    model = planted_policy(kind, tmp_path, tiny_llama_dir)
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={model}", f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert str(model) in err and all(f in err for f in fragments), err
    assert not run_dir.exists()
    assert not (tmp_path / MARKER).exists(), "a refused checkpoint's code ran"


@pytest.mark.parametrize("method, draft, fragments", [
    ("eagle3", "head-hidden", ["target_hidden_size=256", "policy's hidden_size=128"]),
    ("eagle3", "head-vocab", ["vocab_size=1000", "policy's vocab_size=49152"]),
    ("eagle3", "head-aux-layers", ["eagle_aux_hidden_state_layer_ids=[1, 3, 12]", "8-layer policy"]),
    ("eagle3", "no-head", ["expected an EAGLE-3 head"]),
    ("eagle3", "head-bad-acceptance", ["acceptance.json", "acceptance_rate_per_pos must be a list of rates in [0, 1]",
                                       "[0.3, 1.2]"]),
    ("eagle3", "head-bad-final-lr", ["acceptance.json", "final_lr must be a number > 0", "-0.001"]),
    ("draft_model", "other-vocab", ["vocab_size=32", "policy's vocab_size=49152"]),
    ("draft_model", "pickle-weights", ["no *.safetensors weights"]),
])
def test_draft_that_does_not_match_the_policy_stops_the_run(method, draft, fragments, tmp_path,
                                                           tiny_llama_dir, head_dir, capsys):
    from rayspec.models import make_markov_llama
    from rayspec.tools.lossless import markov_logits

    d = {"head-hidden": lambda: copy_model_dir(head_dir, tmp_path / "h", hidden_size=256, target_hidden_size=256),
         "head-vocab": lambda: copy_model_dir(head_dir, tmp_path / "h", vocab_size=1000),
         "head-aux-layers": lambda: copy_model_dir(head_dir, tmp_path / "h",  # the key vLLM's runners read first
                                          eagle_aux_hidden_state_layer_ids=[1, 3, 12]),
         "head-bad-acceptance": lambda: write_acceptance(copy_model_dir(head_dir, tmp_path / "h"), [0.3, 1.2]).parent,
         "head-bad-final-lr": lambda: write_acceptance(copy_model_dir(head_dir, tmp_path / "h"), [0.3],
                                                       final_lr=-1e-3).parent,
         "no-head": lambda: planted_policy("no-config", tmp_path, tiny_llama_dir),
         "other-vocab": lambda: make_markov_llama(tmp_path / "markov", markov_logits()),
         "pickle-weights": lambda: planted_policy("pickle-weights", tmp_path, tiny_llama_dir)}[draft]()
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={tiny_llama_dir}", f"rollout.speculative_config.method={method}",
                      f"rollout.speculative_config.model={d}", f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "rollout.speculative_config.model=" in err and all(f in err for f in fragments), err
    assert not run_dir.exists()
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("content, fragments", [
    (None, ["no file", "train.jsonl"]),
    ("", ["train.jsonl", "no GSM8K rows"]),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n', ["train.jsonl:2", "lacks key 'answer'"]),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "#### x"}\n',
     ["train.jsonl:2", "not a number"]),
], ids=["missing", "empty", "row-without-answer", "answer-not-a-number"])
def test_bad_dataset_stops_the_run(content, fragments, tmp_path, tiny_llama_dir, capsys):
    data = tmp_path / "gsm8k"
    data.mkdir()
    if content is not None:
        (data / "train.jsonl").write_text(content)
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={tiny_llama_dir}", "data.name=gsm8k", f"data.path={data}",
                      f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert f"data.path={data}" in err and all(f in err for f in fragments), err
    assert not run_dir.exists()


def test_a_hub_dataset_out_of_reach_stops_the_run(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """GSM8K from the hub (gpu.yaml's ``openai/gsm8k``) on a node without
    the hub: the datasets library's ConnectionError is the input check's."""
    import datasets.config
    import huggingface_hub.constants

    # as unreachable as no network, without its retries (read at import: the modules' own flags)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={tiny_llama_dir}", "data.name=gsm8k", "data.path=openai/gsm8k",
                      f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "data.path=openai/gsm8k" in err and "Couldn't reach 'openai/gsm8k'" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("rows, overrides, fragments", [
    ('{"prompt": "q", "answer": "1"}\n{"prompt": 5, "answer": "2"}\n', [], ["data.path=", "mine.jsonl"]),
    ('{"question": "q", "answer": "1"}\n', [], ["no column 'prompt' (data.prompt_key)", "['answer', 'question']"]),
    ('{"prompt": "q", "answer": "1"}\n', ["reward.functions=[{dir}/rewards.py:score]"],
     ["reward.functions[0]=", "rewards.py:score: no file"]),
    ('{"prompt": "q", "answer": "1"}\n', ["reward.functions=[{dir}/ok.py:by_solution]"],
     ["reward.functions[0]=", "parameter 'solution' is neither", "the columns are ['answer']"]),
    ('{"prompt": "q", "solution": "1"}\n', [], ["reward.functions[0]=last_number", "parameter 'answer'",
                                               "the columns are ['solution']"]),
], ids=["prompt-not-text", "no-prompt-column", "missing-reward-file", "reward-needs-unknown-column",
        "builtin-needs-answer"])
def test_bad_data_files_and_reward_functions_stop_the_run(rows, overrides, fragments, tmp_path, tiny_llama_dir,
                                                          capsys):
    (tmp_path / "mine.jsonl").write_text(rows)
    (tmp_path / "ok.py").write_text("def by_solution(completions, solution):\n    return [0.0] * len(completions)\n")
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={tiny_llama_dir}", "data.name=files", f"data.path={tmp_path / 'mine.jsonl'}",
                      "trainer.eval_every=0", f"trainer.run_dir={run_dir}",
                      *[o.format(dir=tmp_path) for o in overrides]]) == 2
    err = capsys.readouterr().err
    assert all(f in err for f in fragments), err
    assert not run_dir.exists()


def test_held_out_set_that_leaves_nothing_to_train_stops_the_run(tmp_path, tiny_llama_dir, capsys):
    """The default task has 126 distinct questions: holding them all out is refused before Ray starts."""
    run_dir = tmp_path / "run"
    assert grpo.main([f"model.path={tiny_llama_dir}", "data.eval_num_problems=126",
                      f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "data.eval_num_problems=126: 126 held-out problems leave nothing to train on" in err, err
    assert "126 distinct prompts" in err and not run_dir.exists()


def _planted_checkpoint(run_dir):
    ckpt = run_dir / "ray_train" / "train" / "checkpoint_2026-01-01_00-00-00.000000"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    return ckpt


@pytest.mark.parametrize("args, fragments", [
    (["resume={run}"], ["resume=", "config.yaml not found"]),
    (["resume={run}", "resume={run}"], ["resume= given 2 times"]),
    (["jobs/configs/gsm8k.yaml", "resume={run}"], ["own config.yaml", "gsm8k.yaml"]),
    (["resume={empty}"], ["no checkpoint under"]),
    (["trainer.run_dir={old}"], ["holds checkpoints of an earlier run", "resume="]),
], ids=["not-a-run-dir", "twice", "with-preset", "no-checkpoint", "new-run-over-old"])
def test_bad_resume_stops_the_run(args, fragments, tmp_path, tiny_llama_dir, capsys):
    """resume= errors, and a new run into a directory with checkpoints, stop
    before anything starts; the old run's files are untouched."""
    from omegaconf import OmegaConf

    from rayspec.config import load_config

    empty, old = tmp_path / "empty", tmp_path / "old"
    for d in (empty, old):
        d.mkdir()
        OmegaConf.save(OmegaConf.structured(load_config(None, [f"model.path={tiny_llama_dir}",
                                                               f"trainer.run_dir={d}"])), d / "config.yaml")
    ckpt = _planted_checkpoint(old)
    (old / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    argv = [a.format(run=tmp_path / "nothing", empty=empty, old=old) for a in args]
    assert grpo.main([*argv, f"model.path={tiny_llama_dir}"]) == 2
    err = capsys.readouterr().err
    assert all(f in err for f in fragments), err
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert ckpt.is_dir()


def test_checkpoint_that_cannot_be_staged_names_the_directory_and_free_space(tmp_path, monkeypatch):
    """A full staging disk (torch.save's "basic_ios::clear: iostream error")
    becomes an OSError naming the directory, what was staged and the space
    left, and the partial files are removed."""
    from rayspec.train.checkpoint import report_checkpoint

    import torch

    class FullDisk:
        module = torch.nn.Linear(1, 1)  # trainable: no frozen parameters to leave out

        def save_checkpoint(self, path, tag, exclude_frozen_parameters=False):  # DeepSpeed's signature
            (tmp_path / "stage").mkdir(exist_ok=True)
            Path(path, tag).mkdir(parents=True)
            Path(path, tag, "model_states.pt").write_bytes(b"\0" * 2**20)
            raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(OSError, match=r"rank 3: staging the checkpoint under .*rayspec-ckpt-.* failed after "
                                      r"0\.00 GiB with [0-9.]+ GiB free there \(TMPDIR.*iostream error") as e:
        report_checkpoint({}, FullDisk(), 3, None, None)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]  # the staged part is gone


def test_a_directory_written_atomically_is_the_old_one_or_the_new_one(tmp_path):
    """``write_dir_atomic`` (the policy, adapter, draft head and model copies):
    a write that fails leaves the old directory as it was and no temporary
    one beside it; one that completes replaces it whole; ``replace=False``
    keeps what another writer put there first."""
    from rayspec.files import write_dir_atomic

    out = tmp_path / "policy"
    with write_dir_atomic(out) as tmp:
        (tmp / "a.safetensors").write_text("old")
    with pytest.raises(RuntimeError), write_dir_atomic(out) as tmp:
        (tmp / "b.safetensors").write_text("half")
        raise RuntimeError("killed mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["policy"] and [p.name for p in out.iterdir()] == ["a.safetensors"]
    with write_dir_atomic(out) as tmp:
        (tmp / "b.safetensors").write_text("new")
    with write_dir_atomic(out, replace=False) as tmp:
        (tmp / "c.safetensors").write_text("late")
    assert [p.name for p in tmp_path.iterdir()] == ["policy"] and [p.name for p in out.iterdir()] == ["b.safetensors"]
