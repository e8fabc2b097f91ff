"""GRPO with speculative rollouts: ``python -m jobs.grpo [preset.yaml] [key=value ...]``.

Prints one line per step and writes ``<trainer.run_dir>/metrics.jsonl``.
``resume=<run dir>`` continues a run with its saved ``config.yaml`` (plus any
overrides) from its latest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from jobs.cli import DEFAULT_PRESET, config_help, split_args
from rayspec.config import ConfigError, load_config

USAGE = """usage: python -m jobs.grpo [PRESET.yaml] [KEY=VALUE ...] [resume=RUN_DIR]

GRPO post-training with speculative rollouts on Ray (vLLM replicas on Ray
Serve, DeepSpeed ZeRO policy updates in Ray Train, online EAGLE-3 draft
training). Without arguments: the offline default preset (SmolLM2-135M on a
built-in arithmetic task, 15 steps, 10-20 minutes on 2 CPU cores).

examples:
  python -m jobs.grpo trainer.steps=3 trainer.run_dir=runs/try
  python -m jobs.grpo jobs/configs/gsm8k.yaml data.path=openai/gsm8k rollout.speculative_config.num_speculative_tokens=2
  python -m jobs.grpo resume=runs/try trainer.steps=6        # continue from the last checkpoint
  ray job submit --working-dir . -- python -m jobs.grpo trainer.steps=3
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        print(config_help())
        return 0
    resume = [a.split("=", 1)[1] for a in argv if a.startswith("resume=")]
    argv = [a for a in argv if not a.startswith("resume=")]
    try:
        preset, overrides = split_args(argv)
        if resume:
            preset, overrides = resume_args(resume, preset, overrides)
        cfg = load_config(preset, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s: %(message)s")
    if cfg.ray.address is None and not os.environ.get("RAY_ADDRESS") and "ray" not in sys.modules:
        # a new local cluster: Ray 2.60 protects it with a token (~/.ray/auth_token) and, unless
        # RAY_AUTH_MODE says so, warns that it did, which was the first line a newcomer read. Said
        # before Ray loads, as it reads the mode once per process (set later, this process would
        # keep "disabled" while the cluster it starts wants the token): the same protection, no warning.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from rayspec.vllm import VllmInternalsError
    from rayspec.driver import run
    from rayspec.scheduler import ClusterFitError
    from rayspec.train.ranks import RunAborted

    try:
        run_dir = run(cfg, resume=bool(resume))
    except (ConfigError, ClusterFitError, VllmInternalsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:  # a bad input met during the run: what was written before it stays
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1
    print(f"done: {run_dir / 'metrics.jsonl'}")
    return 0


def resume_args(resume: list[str], preset: Path, overrides: list[str]) -> tuple[Path, list[str]]:
    """(preset, overrides) that continue the run in ``resume[0]``: its saved
    config.yaml, the given overrides, and its own run_dir.

    Raises:
        ConfigError: several resume=, a preset beside it, or no config.yaml.
    """
    if len(resume) > 1:
        raise ConfigError(f"resume= given {len(resume)} times")
    if preset != DEFAULT_PRESET:
        raise ConfigError(f"resume={resume[0]} continues a run with its own config.yaml; "
                          f"give key=value overrides, not the preset {preset}")
    run_dir = Path(resume[0]).expanduser().resolve()
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume={resume[0]}: {saved} not found (not a rayspec run directory?)")
    return saved, [*overrides, f"trainer.run_dir={run_dir}"]


if __name__ == "__main__":
    sys.exit(main())
