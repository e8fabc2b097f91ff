"""Serve a finished run's policy with its EAGLE-3 head, OpenAI-compatible:
``python -m jobs.serve <run dir> [--host 127.0.0.1] [--port 8000] ...``.

Examples::

    python -m jobs.serve runs/default            # embedded cluster; Ctrl-C stops it
    curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "default", "messages": [{"role": "user", "content": "2+3?"}]}'
    ray job submit -- python -m jobs.serve $PWD/runs/default   # stays deployed on the cluster

On an embedded cluster the command serves until interrupted. Joining a
running cluster (``ray.address`` / RAY_ADDRESS, as under ``ray job submit``)
it deploys the app and returns; ``serve shutdown`` or ``serve.delete`` removes
it. Speculation shows in the printed speculative_config and in vLLM's
``ray_vllm_spec_decode_*`` counters on the Prometheus endpoint
(``ray.serve.llm``'s model card carries no engine config).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from rayspec.config import ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a jobs.grpo run directory (config.yaml, policy/, draft_head/)")
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP bind address (default loopback; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-id", default=None, help="OpenAI model name (default: run dir name)")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k to serve with (default: the run's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # before the imports below (vLLM, Ray Serve LLM: tens of seconds), the mistake a user makes most
    config = Path(args.run_dir) / "config.yaml"
    if not config.is_file():
        print(f"error: {args.run_dir}: no such run directory" if not Path(args.run_dir).is_dir() else
              f"error: {config}: missing (not a jobs.grpo run directory?)", file=sys.stderr)
        return 2
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")

    from rayspec.tools.endpoint import APP_NAME, RunDirError, build_app, llm_config

    try:
        llm = llm_config(args.run_dir, args.model_id, args.num_replicas, args.num_speculative_tokens)
    except (RunDirError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from rayspec.config import load_config
    from rayspec.driver import init_ray

    cfg = load_config(os.path.join(args.run_dir, "config.yaml"))
    embedded = cfg.ray.address is None and not os.environ.get("RAY_ADDRESS")
    init_ray(cfg)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app([llm]), name=APP_NAME, route_prefix="/")
    if not serve.status().proxies:
        serve.delete(APP_NAME)
        print("error: Ray Serve already runs on this cluster without an HTTP proxy (a jobs.grpo "
              "run in progress?), so --host/--port cannot apply; `serve shutdown` or wait for "
              "the run to end", file=sys.stderr)
        return 2
    spec = llm.engine_kwargs.get("speculative_config")
    model_id = llm.model_loading_config.model_id
    print(f"serving '{model_id}' at http://{args.host}:{args.port}/v1 "
          f"(speculative_config={spec})", flush=True)
    if not embedded:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
