"""jobs.gpu_smoke on a machine without a GPU: it imports, parses its
arguments, and exits with status 2 saying no GPU was found (what it checks
needs a GPU: docs/gpu.md, "Check a node first"). With a driver that
``nvidia-smi`` reports (a fake one on PATH) it reads the driver first: one
too old for CUDA 13 is that line's FAIL, not "no GPU"."""

from __future__ import annotations

import json
import os

import pytest

from jobs import gpu_smoke


def fake_driver(tmp_path, monkeypatch, version: str) -> None:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("LD_LIBRARY_PATH", "")


def test_arguments_parse_and_unknown_checks_are_refused(tmp_path):
    args = gpu_smoke.parse_args(["--only", "refit,versions", "--out", str(tmp_path / "r.json")])
    assert args.only == ["refit", "versions"] and args.out == str(tmp_path / "r.json")
    assert gpu_smoke.parse_args([]).only == list(gpu_smoke.CHECKS)
    with pytest.raises(SystemExit) as e:
        gpu_smoke.parse_args(["--only", "refit,bogus"])
    assert e.value.code == 2


def test_without_a_gpu_it_exits_2_and_says_so(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--work-dir", str(tmp_path / "work")]) == 2
    assert "gpu_smoke: no GPU found" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "work").exists()  # nothing started, nothing written


def test_a_driver_older_than_r580_is_named_not_reported_as_no_gpu(tmp_path, monkeypatch, capsys):
    fake_driver(tmp_path, monkeypatch, "550.54.15")
    out = tmp_path / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--work-dir", str(tmp_path / "work")]) == 1
    printed = capsys.readouterr().out
    assert "FAIL  driver" in printed and "550.54.15 is too old" in printed and "580" in printed
    driver, compilers = json.loads(out.read_text())["checks"]  # nothing else runs on a driver CUDA 13 cannot use
    assert driver["name"] == "driver" and not driver["ok"] and compilers["name"] == "compilers"
    assert not (tmp_path / "work").exists()


def test_a_new_driver_without_cuda_torch_fails_on_the_cuda_line(tmp_path, monkeypatch, capsys):
    fake_driver(tmp_path, monkeypatch, "580.82.07")
    out = tmp_path / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--work-dir", str(tmp_path / "work")]) == 1
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["driver"]["ok"] and checks["compilers"]["ok"]  # this machine has gcc, g++ and Python.h
    assert not checks["cuda"]["ok"] and "+cpu" in checks["cuda"]["detail"]
    assert "PASS  driver" in capsys.readouterr().out


def test_memory_line_sets_measured_peaks_against_the_plan(tiny_llama_dir, monkeypatch):
    import torch

    from rayspec.config import load_config

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2**30}))
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "train.num_workers=1", "rollout.num_gpus_per_replica=0.6",
                             "train.num_gpus_per_worker=0.3", "draft.num_gpus=0.1"])
    report = gpu_smoke.Report()
    gib = 2**30
    gpu_smoke.check_memory(report, cfg, tiny_llama_dir, {"rollout": 30 * gib, "policy": 4 * gib, "gather": gib})
    (line,) = report.checks
    assert line["ok"] and [r[0] for r in line["rows"]] == ["rollout", "policy update"]  # gather: inside sync
    planned = dict((p, plan) for p, _, plan in line["rows"])
    assert 0.45 * 80 * gib < planned["rollout"] < 0.5 * 80 * gib  # vLLM's region, and the contexts
    gpu_smoke.check_memory(report, cfg, tiny_llama_dir, {"rollout": 45 * gib})
    assert not report.checks[-1]["ok"] and "rollout 45.0 GiB" in report.checks[-1]["detail"]


def test_without_nvidia_smi_a_gpu_that_cuda_initialises_passes_the_driver_line(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi there on this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")
    monkeypatch.setattr(gpu_smoke, "_setup", lambda report, setup, work, cache_dir: report.add("setup", False, "stop"))
    out = tmp_path / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--work-dir", str(tmp_path / "work"), "--only", "refit"]) == 1
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["driver"]["ok"] and "nvidia-smi not found" in checks["driver"]["detail"]
    assert "Fake GPU" in checks["driver"]["detail"] and not checks["setup"]["ok"]
