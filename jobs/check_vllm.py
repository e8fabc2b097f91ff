"""Check rayspec's vLLM touch points against a vLLM release's sources.

    python -m jobs.check_vllm                     # the installed vLLM
    python -m jobs.check_vllm --source /tmp/vllm-0.33.0 --cuda

Every internal rayspec patches, wraps, calls or reads
(``rayspec.vllm.touchpoints``), and every call of vLLM's supported
weight-transfer interface with the parameter names rayspec passes
(``API_CALLS``), is looked up in the source tree
(``--source``: a directory holding ``vllm/``, e.g. a release's wheel
unzipped with ``unzip -q vllm-*.whl 'vllm/*' -d DIR``; default: the installed
vLLM), without importing it. Prints one line per touch point and exits 1
where one fails: the release then refuses to run rayspec's engines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.check_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, help="a directory holding vllm/ (default: the installed vLLM)")
    ap.add_argument("--cuda", action="store_true", help="leave out the touch points only the CPU platform has")
    args = ap.parse_args(argv)
    if args.source is not None and not (args.source / "vllm").is_dir():
        ap.error(f"--source {args.source}: no vllm/ directory there")
    from rayspec.vllm import check_vllm

    results = check_vllm(cpu=not args.cuda, root=args.source)
    for tp, why in results:
        print(f"{'ok  ' if why is None else 'FAIL'} {tp.use:<8} {tp.platform:<3} {tp.symbol}"
              + (f"  <- {why}" if why else f"  ({tp.hook})"))
    failed = sum(why is not None for _, why in results)
    api = sum(tp.use == "api" for tp, _ in results)
    print(f"{len(results) - failed} of {len(results)} hold in {args.source or 'the installed vLLM'}: "
          f"{len(results) - api} touch points of its internals, {api} calls of its supported interface "
          "with the names rayspec passes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
