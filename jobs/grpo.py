"""GRPO with speculative rollouts: ``python -m jobs.grpo [preset.yaml] [key=value ...]``.

Examples::

    python -m jobs.grpo                                   # offline default
    python -m jobs.grpo data.name=gsm8k data.path=../shared/data/gsm8k trainer.steps=3
    ray job submit --working-dir . -- python -m jobs.grpo trainer.steps=3

Prints one line per step and writes ``<trainer.run_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from rayspec.config import ConfigError, load_config

DEFAULT_PRESET = Path(__file__).parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    preset = DEFAULT_PRESET
    if argv and argv[0].endswith((".yaml", ".yml")):
        preset = Path(argv.pop(0))
    try:
        cfg = load_config(preset, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s: %(message)s")
    from rayspec.scheduler import ClusterFitError, run

    try:
        run_dir = run(cfg)
    except (ConfigError, ClusterFitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: {run_dir / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
