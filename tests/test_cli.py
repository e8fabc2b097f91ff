"""The command line a newcomer meets: ``--help``, and every mistake probed
by trying the jobs as a new user would, refused with a clear error before
Ray (or anything heavy) starts (docs/bad-input.md lists them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from jobs import grpo
from jobs.cli import config_keys
from rayspec.config import RunConfig

REPO = Path(__file__).resolve().parents[1]


def test_grpo_help_prints_usage_presets_every_key_and_examples(capsys):
    assert grpo.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jobs.grpo")
    assert "default.yaml" in out and "gsm8k.yaml" in out and "gpu.yaml" in out
    assert "examples:" in out and "resume=" in out
    keys = config_keys()
    assert len(keys) > 80 and all(f"    {key} = " in out for key, _, _ in keys)
    # each key with its default and the first sentence of its dataclass doc
    assert "grpo.group_size = 4  # samples per prompt" in out
    assert "rollout.speculative_config.num_speculative_tokens = 3  # k, draft tokens proposed" in out
    documented = [key for key, _, doc in keys if doc]
    assert len(documented) == len(keys), [key for key, _, doc in keys if not doc]
    assert {key.split(".")[0] for key, _, _ in keys} == {f.name for f in RunConfig.__dataclass_fields__.values()}


@pytest.mark.parametrize("args, fragments", [
    (["trainer.steps"], ["'trainer.steps' is not a key=value override", "trainer.steps=<value>"]),
    (["rollout.speculative_config.method"], ["'rollout.speculative_config.method' is not a key=value override"]),
    (["trainer.steps=3", "jobs/configs/gsm8k.yaml"], ["the preset jobs/configs/gsm8k.yaml must come first",
                                                       "trainer.steps=3"]),
    (["nosuch.yaml"], ["preset nosuch.yaml: no such file", "jobs/configs/default.yaml"]),
    (["--steps", "3"], ["unknown option --steps", "--help"]),
    (["trainer.stpes=3"], ["invalid override 'trainer.stpes=3': key 'trainer.stpes'"]),
    (["train.deepspeed.optimizer.params.lr=-1e-5"], ["train.deepspeed.optimizer.params.lr=-1e-05: must be a number > 0",
                                                     "(override 'train.deepspeed.optimizer.params.lr=-1e-5')"]),
    (["grpo.max_new_tokens=4096"], ["grpo.max_new_tokens=4096: must leave room for the prompt in "
                                    "rollout.engine_kwargs.max_model_len (1024 tokens"]),
    (["rollout.speculative_config.num_speculative_tokens=64"],
     ["rollout.speculative_config.num_speculative_tokens=64", "at most"]),
])
def test_command_line_mistakes_are_named_before_anything_starts(args, fragments, capsys, tmp_path):
    assert grpo.main([*args, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(f in err for f in fragments), err
    assert "default.yaml" not in err or "preset" in err  # a command-line typo is not blamed on the preset
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_mtp_on_a_policy_without_mtp_layers_stops_before_ray(capsys, tmp_path):
    assert grpo.main(["rollout.speculative_config.method=mtp", "rollout.speculative_config.num_speculative_tokens=1",
                      f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "rollout.speculative_config.method='mtp'" in err and "no multi-token-prediction layers" in err, err
    assert "model_type 'llama'" in err
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_run_dir_that_cannot_be_written_is_refused_naming_the_key(where, capsys, tmp_path):
    """A file where the run directory goes, and a directory no one may
    create (under /proc, which refuses even root), before Ray starts."""
    (tmp_path / "file").write_text("not a directory")
    run_dir = tmp_path / "file" if where == "file" else Path("/proc/rayspec-test/run")
    assert grpo.main([f"trainer.run_dir={run_dir}", "trainer.steps=1"]) == 2
    assert f"trainer.run_dir={run_dir}: not a writable directory" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize("job", ["bench_pipeline", "bench_refit", "bench_rl", "bench_serve", "warmstart_draft", "serve",
                                 "project_speedup", "bench_rollout", "bench_step", "bench_step_costs", "check_lossless",
                                 "check_vllm"])
def test_every_jobs_help_describes_it_in_whole_sentences(job):
    out = subprocess.run([sys.executable, "-m", f"jobs.{job}", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    description = out.stdout.split("\n\n")[1]
    assert description.rstrip().endswith((".", ":", "``.", "``:")), description


def test_serve_names_a_missing_run_dir_at_once(tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jobs.serve", str(tmp_path / "nope")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"error: {tmp_path / 'nope'}: no such run directory" in out.stderr
    assert time.perf_counter() - t0 < 10


def test_bench_rl_runs_with_its_own_defaults():
    from jobs.bench_rl import choose_runs, runs

    assert choose_runs(None, runs(None), warm_head=False) == ["none", "online-adaptive"]
    assert choose_runs(None, runs("/head"), warm_head=True) == ["none", "frozen", "online"]
    with pytest.raises(ValueError, match=r"--runs: unknown \['frozen'\].*need --warm-head"):
        choose_runs("none,frozen", runs(None), warm_head=False)


def test_project_speedup_writes_under_runs_by_default():
    from jobs.project_speedup import parse_args

    assert Path(parse_args([]).out).parts[0] == "runs"


def test_jobs_take_presets_overrides_and_options_in_any_order(capsys):
    """``jobs.project_memory PRESET key=value --model ...`` and every other
    order give the same plan (argparse's ``parse_args`` refused an override
    after an option); every job with a list of overrides parses them so."""
    from jobs import project_memory

    preset, override = str(REPO / "jobs" / "configs" / "gpu.yaml"), "grpo.max_new_tokens=2048"
    options = ["--model", "qwen3-8b", "--hardware", "h100", "--gpus", "8"]
    plans = []
    for argv in ([preset, override, *options], [preset, *options[:2], override, *options[2:]],
                 [*options, preset, override]):
        assert project_memory.main(argv) == 0
        plans.append(capsys.readouterr().out)
    assert plans[0] == plans[1] == plans[2] and "2048 response" in plans[0]
    for job in (REPO / "jobs").glob("*.py"):
        src = job.read_text()
        if 'nargs="*"' in src:
            assert "parse_intermixed_args(argv)" in src and ".parse_args(argv)" not in src, job.name
