"""Project a run's memory per device and per phase, before anything starts.

    python -m jobs.project_memory [preset.yaml] [key=value ...] --model <hf dir | preset>
        --hardware <h100 | h200 | gb200> --gpus N [--nodes M] [--prompt-tokens T] [--out plan.json]
    python -m jobs.project_memory [preset.yaml] [key=value ...] --model <hf dir | preset>
        --hardware cpu [--host-gib G] [--nodes M] [--prompt-tokens T] [--out plan.json]

Prints, per kind of device (colocate: the GPU that also holds the
DraftTrainer and the others; split: rollout and train GPUs) and per phase
of the RL step (rollout, policy update, draft training, refit), the bytes
of every term: the replica's weights, activations and KV cache, the Train
rank's model states by ZeRO stage and offload (DeepSpeed's estimators'
accounting), its activations with or without checkpointing, its logits,
torch's cache, DeepSpeed's buckets, the DraftTrainer, the weight-sync
bucket; then one node's host memory. ``--hardware cpu`` plans CPU roles
(default preset ``jobs/configs/default.yaml``): one node's host memory
(``--host-gib``, default this machine's) per phase, with the replicas' KV
space, the Train workers, the DraftTrainer, the object store and a refit's
extra memory by transport, from measured footprints.
``rayspec/memory_plan.py`` gives each term's source.

Exit status: 0 when the plan fits; 1 when it does not, naming each device
and phase that overflows and the knobs (config overrides) that would make
it fit; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobs.cli import split_args
from rayspec import memory_plan
from rayspec.config import ConfigError, load_config
from rayspec.model_shape import PRESETS, ModelShape

GPU_PRESET = Path(__file__).resolve().parent / "configs" / "gpu.yaml"
CPU_PRESET = Path(__file__).resolve().parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.project_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="*", help="a preset (default jobs/configs/gpu.yaml), then key=value overrides")
    ap.add_argument("--model", required=True, help=f"a Hugging Face model directory or one of {', '.join(PRESETS)}")
    ap.add_argument("--hardware", required=True, choices=[*sorted(memory_plan.DEVICE_BYTES), "cpu"])
    ap.add_argument("--gpus", type=int, help="GPUs per node (GPU hardware)")
    ap.add_argument("--host-gib", type=float, help="--hardware cpu: a node's memory (default: this machine's)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=memory_plan.PROMPT_TOKENS, help="a prompt's length in tokens")
    ap.add_argument("--out", help="write the plan as JSON here")
    args = ap.parse_intermixed_args(argv)  # presets, overrides and options in any order
    cpu = args.hardware == "cpu"
    if not cpu and args.gpus is None:
        ap.error(f"--hardware {args.hardware} needs --gpus")
    kw = {"prompt_tokens": args.prompt_tokens}
    if cpu:
        import psutil

        kw["host_bytes"] = args.host_gib * memory_plan.GIB if args.host_gib else psutil.virtual_memory().total
    try:
        preset, overrides = split_args(args.config, default_preset=CPU_PRESET if cpu else GPU_PRESET)
        cfg = load_config(str(preset), overrides)
        shape = ModelShape.from_hf_config(args.model)
        result = memory_plan.cpu_plan(cfg, shape, nodes=args.nodes, **kw) if cpu else \
            memory_plan.plan(cfg, shape, args.hardware, args.gpus, args.nodes, **kw)
    except (ConfigError, ValueError) as e:
        print(f"project_memory: {e}", file=sys.stderr)
        return 2
    print(result.table())
    problems = result.problems()
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_dict(), indent=1))
    if not problems:
        print("fits")
        return 0
    print("does not fit:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
    found = memory_plan.fixes(str(preset), overrides, shape, args.hardware, args.gpus, args.nodes, **kw)
    print("would fit with: " + ("; ".join(found) if found else "none of the knobs tried alone "
                                "(more GPUs or nodes, a smaller model)"), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
