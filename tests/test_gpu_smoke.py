"""jobs.gpu_smoke on a machine without a GPU: it imports, parses its
arguments, and exits with status 2 saying no GPU was found (what it checks
needs a GPU: docs/gpu.md, "Check a node first")."""

from __future__ import annotations

import pytest

from jobs import gpu_smoke


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


def test_memory_peak_reads_the_samples_of_a_phase():
    trace = gpu_smoke.MemoryTrace()
    trace.samples = [(1.0, 5), (2.0, 9), (3.0, 7), (4.0, 2)]
    assert trace.peak([[1.5, 3.5]]) == 9 and trace.peak([[3.9, 4.1]]) == 7  # 7 in use as it began
    assert trace.peak([[2.5, 2.6]]) == 9  # shorter than the sampling period
    assert trace.peak([[0.0, 0.5]]) == 0
