"""Load and bad input against the OpenAI-compatible server of a finished
run (``jobs.serve``): ``python -m jobs.bench_serve <run dir> [--requests 48]
[--concurrency 8] [--max-tokens 32] [--out runs/bench_serve/serve.json]``.

Starts ``python -m jobs.serve <run dir> --port P`` as a user would (or uses
``--url`` of one already serving), then:

1. **Load**: ``--requests`` chat completions from ``--concurrency``
   clients, alternating streaming and non-streaming, bounded by
   ``--duration-s``. Prints latency p50 / p99 per kind (streaming: also
   the time to the first chunk), tokens/s and the errors.
2. **Bad input**: malformed JSON, a prompt longer than the model's
   context, ``max_tokens`` 0 and -1, ``n`` far above the engine's
   ``max_num_seqs``, an unknown model. Each must be refused with an HTTP
   4xx in the OpenAI error shape ({"error": {"message", "type", ...}}),
   and a valid request must succeed right after it.
3. **Disconnect**: a streaming request with a large ``max_tokens`` is
   dropped after its first chunk; its server replica must cancel it
   (Serve's "CANCELLED" line in the Ray session's logs) and the server go on.

Writes the JSON (``--out``) and a latency plot beside it. Uses only the
standard library's HTTP client (threads), so what is timed is the server.
"""

from __future__ import annotations

import argparse
import json
import http.client
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

PROMPTS = ["What is 17 + 25?", "Name a prime number larger than 50.", "What is 9 times 8?",
           "Write the number twelve in digits.", "Is 91 a prime number? Answer yes or no."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a finished jobs.grpo run directory (what jobs.serve serves)")
    ap.add_argument("--url", help="a server already serving the run (default: start jobs.serve)")
    ap.add_argument("--port", type=int, default=8011, help="port of the jobs.serve this starts")
    ap.add_argument("--requests", type=int, default=48, help="requests of the load phase")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each load request")
    ap.add_argument("--duration-s", type=float, default=600.0, help="the load phase stops after this")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="one request's timeout")
    ap.add_argument("--out", default="runs/bench_serve/serve.json", help="JSON output (a plot beside it)")
    return ap.parse_args(argv)


class Client:
    """Chat completions against ``url`` (``/v1/...``) with ``http.client``.

    Args:
        url: the server's base URL (http://host:port).
        model: the OpenAI model name it serves.
        timeout_s: a request's socket timeout (seconds).
    """

    def __init__(self, url: str, model: str, timeout_s: float = 300.0):
        u = urlparse(url)
        self.host, self.port, self.model, self.timeout_s = u.hostname, u.port or 80, model, timeout_s

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def post(self, path: str, body: bytes | str | dict) -> tuple[int, dict | None, float]:
        """(HTTP status, parsed JSON body or None, seconds)."""
        data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        t0 = time.perf_counter()
        conn = self._conn()
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        return resp.status, parsed, time.perf_counter() - t0

    def chat(self, prompt: str, max_tokens: int, **extra) -> dict:
        """One non-streaming chat completion: {status, latency_s, tokens, error}."""
        status, body, dt = self.post("/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 1.0, **extra})
        tokens = ((body or {}).get("usage") or {}).get("completion_tokens", 0) if status == 200 else 0
        return {"status": status, "latency_s": dt, "tokens": tokens,
                "error": None if status == 200 else _error_of(body)}

    def stream(self, prompt: str, max_tokens: int, stop_after_first: bool = False) -> dict:
        """One streaming chat completion (server-sent events): {status,
        latency_s, first_chunk_s, tokens (chunks with content), error}.
        ``stop_after_first``: close the connection after the first chunk
        (a client that goes away)."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "temperature": 1.0, "stream": True}).encode()
        t0 = time.perf_counter()
        conn = self._conn()
        first, chunks, status, error = None, 0, 0, None
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            status = resp.status
            if status != 200:
                error = _error_of(_json_or_none(resp.read()))
            else:
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    event = _json_or_none(payload) or {}
                    if "error" in event:
                        error = _error_of(event)
                        break
                    delta = (event.get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("content"):
                        chunks += 1
                        first = first if first is not None else time.perf_counter() - t0
                        if stop_after_first:
                            break
        finally:
            conn.close()
        return {"status": status, "latency_s": time.perf_counter() - t0, "first_chunk_s": first,
                "tokens": chunks, "error": error}


def _json_or_none(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error_of(body) -> dict:
    """The OpenAI error object of a response body, or what came instead."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]
    return {"message": f"not the OpenAI error shape: {str(body)[:200]}", "type": None}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between the
    closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def load(client: Client, requests: int, concurrency: int, max_tokens: int, duration_s: float) -> dict:
    """``requests`` requests from ``concurrency`` threads, alternating
    streaming and non-streaming, none started after ``duration_s``.
    Returns {"requests": [...], "summary": {kind: {...}}, "wall_s"}."""
    results: list[dict] = []
    lock, next_i = threading.Lock(), [0]
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= requests or time.perf_counter() - t0 > duration_s:
                    return
                next_i[0] += 1
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                r = client.stream(prompt, max_tokens) if i % 2 else client.chat(prompt, max_tokens)
            except OSError as e:  # connection refused or reset, a timeout
                r = {"status": 0, "latency_s": None, "tokens": 0, "error": {"message": repr(e), "type": "client"}}
            r["kind"] = "stream" if i % 2 else "chat"
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    summary = {}
    for kind in ("chat", "stream"):
        rs = [r for r in results if r["kind"] == kind]
        ok = [r for r in rs if r["status"] == 200 and r["error"] is None]
        lat = [r["latency_s"] for r in ok]
        first = [r["first_chunk_s"] for r in ok if r.get("first_chunk_s") is not None]
        summary[kind] = {"requests": len(rs), "errors": len(rs) - len(ok),
                         "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
                         "first_chunk_p50_s": percentile(first, 50), "first_chunk_p99_s": percentile(first, 99),
                         "tokens": sum(r["tokens"] for r in ok)}
    summary["all"] = {"requests": len(results), "errors": sum(s["errors"] for s in summary.values()),
                      "tokens_per_s": sum(r["tokens"] for r in results) / wall if wall > 0 else 0.0}
    return {"requests": results, "summary": summary, "wall_s": wall}


def bad_inputs(client: Client, max_model_len: int) -> list[dict]:
    """Each bad request, what came back, and whether a valid request
    succeeded right after it."""
    msg = [{"role": "user", "content": PROMPTS[0]}]
    long_prompt = "one two three four five six seven eight nine ten " * (max_model_len // 5 + 10)
    cases = [
        ("malformed JSON", b'{"model": "%s", "messages": [' % client.model.encode()),
        ("over-long prompt", {"model": client.model, "messages": [{"role": "user", "content": long_prompt}],
                              "max_tokens": 8}),
        ("max_tokens 0", {"model": client.model, "messages": msg, "max_tokens": 0}),
        ("max_tokens -1", {"model": client.model, "messages": msg, "max_tokens": -1}),
        ("n 100000", {"model": client.model, "messages": msg, "max_tokens": 4, "n": 100000}),
        ("unknown model", {"model": "no-such-model", "messages": msg, "max_tokens": 4}),
    ]
    rows = []
    for name, body in cases:
        try:
            status, parsed, dt = client.post("/v1/chat/completions", body)
            error = _error_of(parsed)
        except OSError as e:
            status, dt, error = 0, None, {"message": repr(e), "type": "client"}
        after = client.chat(PROMPTS[1], 4)
        rows.append({"case": name, "status": status, "seconds": dt,
                     "openai_error_shape": isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
                     and "message" in parsed["error"] and "type" in parsed["error"] if status else False,
                     "error_type": error.get("type"), "message": str(error.get("message"))[:160],
                     "refused": 400 <= status < 500, "serving_after": after["status"] == 200})
    return rows


def _cancelled(logs: Path | None) -> int | None:
    """Calls Serve replicas logged as cancelled ("CALL chat CANCELLED":
    Serve cancels a request whose client went away, which stops its vLLM
    generation), in the Ray session's logs (the LLM server's go to its
    worker's stderr); None without logs."""
    if logs is None or not logs.is_dir():
        return None
    files = [*logs.glob("worker-*.err"), *logs.glob("serve/*.log")]
    return sum(f.read_text(errors="replace").count(" CANCELLED ") for f in files)


def disconnect(client: Client, logs: Path | None) -> dict:
    """Drop a streaming request after its first chunk; then whether its
    server replica cancelled it (``_cancelled``: the Ray session's logs
    under ``logs``) and a valid request succeeds."""
    before = _cancelled(logs)
    r = client.stream(PROMPTS[2], max_tokens=512, stop_after_first=True)
    time.sleep(3.0)  # the cancellation reaches the replica asynchronously
    after_count = _cancelled(logs)
    after = client.chat(PROMPTS[1], 4)
    return {"first_chunk_s": r["first_chunk_s"], "chunks_read": r["tokens"],
            "cancelled": None if before is None else after_count > before, "serving_after": after["status"] == 200}


def _serve(run_dir: str, port: int, timeout_s: float = 900.0) -> tuple[subprocess.Popen, str]:
    """Start ``jobs.serve`` and wait for its "serving ..." line; returns
    (the process, the model id)."""
    proc = subprocess.Popen([sys.executable, "-m", "jobs.serve", run_dir, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    for line in proc.stdout:
        print("  serve |", line.rstrip()[:200], flush=True)
        if line.startswith("serving '"):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drained, or the server blocks
            return proc, line.split("'")[1]
        if time.time() - t0 > timeout_s:
            break
    proc.kill()
    raise RuntimeError(f"jobs.serve {run_dir} did not start serving (exit {proc.poll()})")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in ("chat", "stream"):
        lat = sorted(r["latency_s"] for r in result["load"]["requests"]
                     if r["kind"] == kind and r["status"] == 200 and r["error"] is None)
        if lat:
            ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=kind)
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{result['model']}: {result['load']['summary']['all']['requests']} requests, "
                 f"{result['concurrency']} clients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if not (Path(ns.run_dir) / "config.yaml").is_file():
        print(f"error: {ns.run_dir}: not a jobs.grpo run directory (no config.yaml)", file=sys.stderr)
        return 2
    if ns.requests < 1 or ns.concurrency < 1 or ns.max_tokens < 1:
        print("error: --requests, --concurrency and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(ns.run_dir) / "config.yaml")
    max_model_len = int(cfg.rollout.engine_kwargs.get("max_model_len") or 4096)
    proc = None
    if ns.url:
        url, model = ns.url, Path(ns.run_dir).resolve().name
    else:
        proc, model = _serve(ns.run_dir, ns.port)
        url = f"http://127.0.0.1:{ns.port}"
    try:
        client = Client(url, model, ns.timeout_s)
        print(f"load: {ns.requests} requests, {ns.concurrency} clients, max_tokens {ns.max_tokens}", flush=True)
        result = {"model": model, "url": url, "concurrency": ns.concurrency, "max_tokens": ns.max_tokens,
                  "load": load(client, ns.requests, ns.concurrency, ns.max_tokens, ns.duration_s)}
        result["bad_input"] = bad_inputs(client, max_model_len)
        logs = Path("/tmp/ray/session_latest/logs") if proc is not None else None
        result["disconnect"] = disconnect(client, logs)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    s = result["load"]["summary"]
    print(f"\n{'kind':<8}{'requests':>9}{'errors':>7}{'p50 s':>8}{'p99 s':>8}{'first p50':>10}{'first p99':>10}")
    for kind in ("chat", "stream"):
        k = s[kind]
        fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        print(f"{kind:<8}{k['requests']:>9}{k['errors']:>7}{fmt(k['p50_s']):>8}{fmt(k['p99_s']):>8}"
              f"{fmt(k['first_chunk_p50_s']):>10}{fmt(k['first_chunk_p99_s']):>10}")
    print(f"all: {s['all']['requests']} requests, {s['all']['errors']} errors, {s['all']['tokens_per_s']:.1f} tokens/s "
          f"over {result['load']['wall_s']:.0f} s")
    print(f"\n{'bad input':<18}{'HTTP':>5}  {'OpenAI shape':<13}{'type':<24}{'serving after':<14}message")
    for r in result["bad_input"]:
        print(f"{r['case']:<18}{r['status']:>5}  {str(r['openai_error_shape']):<13}{str(r['error_type']):<24}"
              f"{str(r['serving_after']):<14}{r['message'][:70]}")
    d = result["disconnect"]
    print(f"\ndisconnect after the first chunk: cancelled {d['cancelled']}, serving after {d['serving_after']}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")
    ok = s["all"]["errors"] == 0 and all(r["refused"] and r["serving_after"] for r in result["bad_input"]) \
        and d["serving_after"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
