"""jobs.gpu_smoke on a machine without a GPU. Without a driver or GPU it
exits with status 2 saying so (what it checks needs a GPU: docs/gpu.md,
"Check a node first"). With a driver that ``nvidia-smi`` reports (a fake one
on PATH) it reads the driver first: one too old for CUDA 13 is that line's
FAIL, not "no GPU". Past those lines it runs the ``gpu`` tests of
tests/test_gpu_path.py through pytest: here every one is collected with its
check and skipped, and a stand-in test file (the real ``report`` fixture)
shows how the reports of a run become the table and the JSON."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from jobs import gpu_smoke
from tests.test_gpu_path import check_memory

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
    report = Recorder()
    gib = 2**30
    check_memory(report, cfg, tiny_llama_dir, {"rollout": 30 * gib, "policy": 4 * gib, "gather": gib})
    (line,) = report.checks
    assert line["ok"] and [r[0] for r in line["rows"]] == ["rollout", "policy update"]  # gather: inside sync
    planned = dict((p, plan) for p, _, plan in line["rows"])
    assert 0.45 * 80 * gib < planned["rollout"] < 0.5 * 80 * gib  # vLLM's region, and the contexts
    check_memory(report, cfg, tiny_llama_dir, {"rollout": 45 * gib})
    assert not report.checks[-1]["ok"] and "rollout 45.0 GiB" in report.checks[-1]["detail"]


class Recorder:
    """Stands in for the gpu tests' ``report`` outside pytest: its lines as dicts."""

    def __init__(self):
        self.checks: list[dict] = []

    def add(self, name: str, ok: bool, detail: str, **figures) -> None:
        self.checks.append({"name": name, "ok": ok, "detail": detail, **figures})


class Items:
    """A pytest plugin that keeps the tests a run collected."""

    def pytest_collection_finish(self, session):
        self.items = list(session.items)


def collected(*plugins) -> list:
    """The gpu tests the job's pytest run collects (``plugins`` beside it), without running them."""
    items = Items()
    code = pytest.main([str(gpu_smoke.TESTS), "--collect-only", "-m", "gpu", "-s", "-p", "no:terminal",
                        "-p", "no:cacheprovider"], plugins=[*plugins, items])
    assert code == pytest.ExitCode.OK
    return items.items


def test_every_gpu_test_has_a_check_and_every_check_its_tests():
    items = collected()
    checks = [gpu_smoke._check(item) for item in items]
    assert all(item.get_closest_marker("gpu") for item in items)
    assert list(dict.fromkeys(checks)) == list(gpu_smoke.CHECKS)  # --only's names, in the file's order
    assert [item.name for item in items if gpu_smoke._check(item) == "refit"] == [
        "test_refit", "test_cuda_ipc_refit", "test_nccl_refit"]


def test_only_selects_the_tests_of_the_checks_it_names():
    items = collected(gpu_smoke.Collector(gpu_smoke.Table(), ["zero3", "rl_split"]))
    assert [item.name for item in items] == ["test_rl_step[split]", "test_zero3_load"]


def test_without_a_gpu_every_test_is_skipped_before_it_builds_anything(tmp_path, capsys):
    table = gpu_smoke.Table()
    gpu_smoke.run_tests(table, gpu_smoke.parse_args(["--work-dir", str(tmp_path / "work")]))
    assert len(table.checks) == 11 and {c["result"] for c in table.checks} == {"SKIP"}
    assert all(c["detail"].startswith("needs a CUDA GPU") for c in table.checks)
    assert not (tmp_path / "work").exists()  # no fixture ran: no models, no Ray
    assert "SKIP  rl step colocate" in capsys.readouterr().out


STAND_IN = """
import pytest

from tests.test_gpu_path import report  # the fixture the gpu tests report through


@pytest.fixture
def broken():
    raise OSError("no space left on device")


@pytest.mark.gpu("versions")
def test_versions(report):
    report.add("versions", True, "vLLM 0.32.0", vllm="0.32.0")


@pytest.mark.gpu("refit")
def test_refit(report):
    report.add("policy refit", False, "token_mult_prob_error 2.00e-02", token_mult_prob_error=0.02)
    report.add("weight sync", True, "1.20 GB: 0.50 s", seconds=0.5)
    raise RuntimeError("engine died\\nwhile loading")


@pytest.mark.gpu("adaptive_k")
def test_adaptive_k(report):
    raise AssertionError("--only leaves this out")


@pytest.mark.gpu("suffix")
def test_suffix(report, broken):
    report.add("suffix", True, "never reached")


@pytest.mark.gpu("zero3")
def test_zero3_load(report):
    pytest.skip("one GPU")
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The job's pytest run pointed at ``STAND_IN`` on a node with a new driver and a GPU."""
    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "conftest.py").write_text(
        "from tests.conftest import pytest_addoption  # noqa: F401  the options the job passes\n")
    monkeypatch.setattr(gpu_smoke, "TESTS", tmp_path / "stand_in" / "test_stand_in.py")
    # each test's stand-in is a module of that name from another directory: pytest refuses a second one
    monkeypatch.delitem(sys.modules, "test_stand_in", raising=False)
    gpu_smoke.TESTS.write_text(textwrap.dedent(STAND_IN))
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return tmp_path


def test_the_table_and_json_are_the_lines_of_the_tests_reports(stand_in, monkeypatch, capsys):
    fake_driver(stand_in, monkeypatch, "580.82.07")
    out = stand_in / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--only", "versions,refit,suffix,zero3"]) == 1
    checks = json.loads(out.read_text())["checks"]
    assert [(c["name"], c["result"]) for c in checks] == [
        ("driver", "PASS"), ("compilers", "PASS"), ("versions", "PASS"), ("policy refit", "FAIL"),
        ("weight sync", "PASS"), ("refit", "FAIL"), ("suffix", "FAIL"), ("zero3 load", "SKIP")]
    named = {c["name"]: c for c in checks}
    assert named["versions"]["vllm"] == "0.32.0" and named["versions"]["wall_s"] >= 0
    assert named["policy refit"]["token_mult_prob_error"] == 0.02 and named["policy refit"]["wall_s"] >= 0
    assert named["weight sync"]["seconds"] == 0.5 and named["weight sync"]["wall_s"] is None  # the test's 2nd
    assert named["refit"]["detail"] == "RuntimeError: engine died" and "while loading" in named["refit"]["traceback"]
    assert named["suffix"]["detail"] == "setup: OSError: no space left on device"
    assert named["zero3 load"]["detail"] == "one GPU"
    assert named["refit"]["test"].endswith("test_stand_in.py::test_refit")
    printed = capsys.readouterr().out.splitlines()
    assert printed[2].startswith("PASS  versions") and printed[2].endswith(" s  vLLM 0.32.0")
    assert printed[-1].startswith("4/7 passed, 1 skipped in ") and printed[-1].endswith(
        "; failed: policy refit, refit, suffix")


def test_a_test_file_that_does_not_import_is_the_collect_lines_fail(stand_in, monkeypatch):
    gpu_smoke.TESTS.write_text("import rayspec.no_such_module\n")
    table = gpu_smoke.Table()
    gpu_smoke.run_tests(table, gpu_smoke.parse_args([]))
    assert [(c["name"], c["result"]) for c in table.checks] == [("collect", "FAIL"), ("pytest", "FAIL")]
    assert table.checks[0]["detail"] == "ModuleNotFoundError: No module named 'rayspec.no_such_module'"
    assert "INTERRUPTED" in table.checks[1]["detail"]  # no test ran


def test_without_nvidia_smi_a_gpu_that_cuda_initialises_passes_the_driver_line(stand_in, monkeypatch):
    import torch

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi there on this machine
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")
    out = stand_in / "r.json"
    assert gpu_smoke.main(["--out", str(out), "--only", "versions"]) == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["driver"]["ok"] and "nvidia-smi not found" in checks["driver"]["detail"]
    assert "Fake GPU" in checks["driver"]["detail"] and checks["versions"]["ok"]
