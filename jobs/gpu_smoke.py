"""GPU smoke test: does rayspec's GPU path work on this node? One GPU, a few minutes.

    python -m jobs.gpu_smoke [--out gpu_smoke.json] [--work-dir /tmp/rayspec-gpu-smoke]
        [--cache-dir ~/.cache/rayspec] [--only versions,refit,adaptive_k,suffix,rl_colocate,rl_split]

Run it after ``bash cluster/install_node.sh cuda``, on a node with at least
one NVIDIA GPU (about 20 GB of GPU memory is plenty). It first checks that
the node can run CUDA at all:

- ``driver``: the NVIDIA driver (``nvidia-smi``) is R580 or newer, or
  CUDA 13's forward-compatibility library is on ``LD_LIBRARY_PATH``
  (``rayspec.tools.node_check``). A driver too old stops here: CUDA torch
  would only say it sees no GPU. Without ``nvidia-smi`` (some containers),
  a GPU that CUDA initialises passes.
- ``compilers``: a C and C++20 compiler and ``Python.h``, which Triton needs
  to build its launcher when an engine starts.
- ``cuda`` (only when it fails): torch sees no GPU although the driver is
  new enough.

Then it runs the ``gpu`` tests of tests/test_gpu_path.py through pytest
(``--only`` names them by their marker's check; each test's docstring says
what it measures) and prints one line per line a test reports: ``PASS``,
``FAIL`` or ``SKIP``, the test's seconds, what was measured. Every line can
fail, and a test whose setup fails (the models, Ray) is that test's FAIL,
not the end of the run. The lines, their figures and the tracebacks of
failures go to the JSON file.

Exit status: 0 when no line fails, 1 when one does (a driver too old
included), 2 on a machine without an NVIDIA driver and GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the checks --only names: the gpu(check) markers of the tests, in their file's order
CHECKS = ("versions", "draft_targets", "refit", "adaptive_k", "suffix", "rl_colocate", "rl_split", "zero3")
TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_gpu_path.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The job's arguments, ``only`` as a list of ``CHECKS``; exits 2 on a name not among them."""
    ap = argparse.ArgumentParser(prog="python -m jobs.gpu_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_smoke.json", help="JSON file of the results")
    ap.add_argument("--work-dir", default="/tmp/rayspec-gpu-smoke", help="models and run directories go here")
    ap.add_argument("--cache-dir", default="~/.cache/rayspec", help="the bundled model's cache (tokenizer)")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    args = ap.parse_args(argv)
    args.only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(args.only) - set(CHECKS))
    if unknown or not args.only:
        ap.error(f"--only: unknown check(s) {unknown}; expected some of {list(CHECKS)}" if unknown
                 else f"--only: name at least one of {list(CHECKS)}")
    return args


class Table:
    """The run's lines, printed as they come, and the JSON at the end."""

    def __init__(self):
        self.checks: list[dict] = []

    def add(self, name: str, result: str, detail: str, wall_s: float | None = None, **figures) -> None:
        """One line: ``result`` is PASS, FAIL or SKIP, ``wall_s`` the seconds of what produced the line
        (a test: its setup, call and teardown; None on a test's further lines, which share its first
        line's), ``figures`` what the check measured, for the JSON."""
        self.checks.append({"name": name, "result": result, "ok": result == "PASS", "detail": detail,
                            "wall_s": wall_s, **figures})
        shown = "" if wall_s is None else f"{wall_s:.1f} s"
        print(f"{result}  {name:<17} {shown:>8}  {detail}", flush=True)

    def finish(self, out: str, t0: float) -> int:
        """Print the summary, write ``out``; the exit status: 1 when a line failed, else 0."""
        failed = [c["name"] for c in self.checks if c["result"] == "FAIL"]
        skipped = sum(c["result"] == "SKIP" for c in self.checks)
        ran = len(self.checks) - skipped
        print(f"{ran - len(failed)}/{ran} passed" + (f", {skipped} skipped" if skipped else "")
              + f" in {time.perf_counter() - t0:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
        Path(out).write_text(json.dumps({"checks": self.checks}, indent=1))
        return 1 if failed else 0


def _check(item: pytest.Item) -> str | None:
    """The check a test belongs to: its ``gpu`` marker's argument."""
    marker = item.get_closest_marker("gpu")
    return marker.args[0] if marker and marker.args else None


def _line_name(nodeid: str) -> str:
    """A test's own line (a skip, an exception): ``...::test_adaptive_k[async]`` -> ``adaptive k async``."""
    name = nodeid.rsplit("::", 1)[-1].removeprefix("test_")
    return name.replace("[", " ").rstrip("]").replace("_", " ")


def _first_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    """An error's one-line summary, ``Type: message``: a test's crash, or the last line of a collection
    error (where pytest puts the exception, after the import's traceback)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash:
        return crash.message.splitlines()[0]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1].removeprefix("E").strip() if lines else ""


class Collector:
    """A pytest plugin: keeps the tests of the checks ``--only`` names and turns each test's reports into
    the table's lines when the test ends: one per line it reported (a subtest, its detail and figures
    from the test's property of the same name), one for an exception outside them (setup, call or
    teardown), one for a skip."""

    def __init__(self, table: Table, only: list[str]):
        self.table, self.only = table, only
        self._lines: list[tuple[str, str, str, dict]] = []  # the running test's
        self._seconds = 0.0

    def pytest_collection_modifyitems(self, config, items):
        """Deselect the tests of the checks ``--only`` leaves out."""
        keep = [item for item in items if _check(item) in self.only]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep

    def pytest_collectreport(self, report):
        """A test file that does not import: the ``collect`` line's FAIL."""
        if report.failed:
            self.table.add("collect", "FAIL", _first_line(report), traceback=report.longreprtext)

    def pytest_runtest_logreport(self, report):
        """Gather the running test's lines and seconds; at its teardown, put them in the table."""
        if isinstance(report, pytest.SubtestReport):
            figures = dict(dict(report.user_properties).get(report.context.msg, {}))
            detail = figures.pop("detail", "")
            self._lines.append((report.context.msg, "PASS" if report.passed else "FAIL", detail, figures))
            return
        self._seconds += report.duration
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._lines.append((_line_name(report.nodeid), "SKIP", reason.removeprefix("Skipped: "), {}))
        elif report.failed:
            where = "" if report.when == "call" else f"{report.when}: "
            self._lines.append((_line_name(report.nodeid), "FAIL", where + _first_line(report),
                                {"traceback": report.longreprtext}))
        if report.when == "teardown":
            for i, (name, result, detail, figures) in enumerate(self._lines):
                self.table.add(name, result, detail, self._seconds if i == 0 else None, test=report.nodeid,
                               **figures)
            self._lines, self._seconds = [], 0.0


def run_tests(table: Table, args: argparse.Namespace) -> None:
    """The gpu tests of the checks ``args.only`` names, through pytest; their lines go to ``table``, and
    a run pytest itself cannot finish (a usage or internal error) is the ``pytest`` line's FAIL."""
    code = pytest.main([str(TESTS), "-m", "gpu", f"--gpu-work-dir={args.work_dir}",
                        f"--gpu-cache-dir={args.cache_dir}",
                        "-s",  # the engines' logs stream while they run, between the table's lines
                        "-p", "no:terminal",  # the table is the output: pytest's progress would interleave
                        "-p", "no:cacheprovider",  # nothing written into the checkout
                        # no time limit, as before pytest ran the checks: pytest-timeout's stack dump needs
                        # the terminal reporter, and fails the test with a bare AssertionError without it
                        "-p", "no:timeout"],
                       plugins=[Collector(table, args.only)])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        table.add("pytest", "FAIL", f"pytest exited with {pytest.ExitCode(code).name} ({TESTS})")


def main(argv: list[str] | None = None) -> int:
    """Check the node, run the gpu tests, print the table and write the JSON; returns the exit status."""
    args = parse_args(argv)
    from rayspec.tools import node_check

    table, t0 = Table(), time.perf_counter()
    try:
        driver = node_check.driver_version()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        table.add("driver", "FAIL", str(e), time.perf_counter() - t0)
        return table.finish(args.out, t0)
    import torch

    if driver is None and not torch.cuda.is_available():
        print("gpu_smoke: no GPU found (no NVIDIA driver: nvidia-smi not found, and torch.cuda.is_available() "
              f"is False, torch {torch.__version__}): run it on a GPU node after `bash cluster/install_node.sh cuda`",
              file=sys.stderr)
        return 2
    if driver is None:  # no nvidia-smi (some containers), yet CUDA initialises: the driver can load it
        table.add("driver", "PASS", f"nvidia-smi not found; torch {torch.__version__} initialises CUDA "
                  f"{torch.version.cuda} on {torch.cuda.get_device_name(0)}", time.perf_counter() - t0)
    else:
        ok, line = node_check.check_driver(driver)
        table.add("driver", "PASS" if ok else "FAIL", line, time.perf_counter() - t0)
    t1 = time.perf_counter()
    try:
        ok, line = node_check.check_compilers()
    except Exception as e:  # a compiler that hangs or cannot start: this line's FAIL, as any check's
        ok, line = False, f"{type(e).__name__}: {e}".splitlines()[0]
    table.add("compilers", "PASS" if ok else "FAIL", line, time.perf_counter() - t1)
    if table.checks[0]["result"] == "FAIL":
        return table.finish(args.out, t0)  # CUDA 13 cannot load: every other line would say only that
    if not torch.cuda.is_available():
        table.add("cuda", "FAIL", f"torch.cuda.is_available() is False with driver {driver}: torch "
                  f"{torch.__version__} (CUDA {torch.version.cuda}); `bash cluster/install_node.sh cuda` "
                  "checks the venv's torch")
        return table.finish(args.out, t0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    run_tests(table, args)
    return table.finish(args.out, t0)


if __name__ == "__main__":
    sys.exit(main())
