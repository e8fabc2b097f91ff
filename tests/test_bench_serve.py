"""jobs.bench_serve's client against a stand-in OpenAI server (the real
server's figures are in docs/benchmarks.md): what it times, counts and
checks, including answers that are not in the OpenAI error shape."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobs.bench_serve import Client, bad_inputs, disconnect, load, percentile


class StandIn(BaseHTTPRequestHandler):
    """Chat completions as vLLM's OpenAI server answers them, for model "m";
    ``n`` above 64 comes back 500 with a bare string (not the OpenAI shape)."""

    def log_message(self, *args):
        pass

    def _send(self, status: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            req = json.loads(raw)
        except ValueError:
            return self._send(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
        if req["model"] != "m":
            return self._send(404, {"error": {"message": "no such model", "type": "NotFoundError", "code": 404}})
        if req["max_tokens"] < 1 or len(req["messages"][0]["content"]) > 1000:
            return self._send(400, {"error": {"message": "bad request", "type": "BadRequestError", "code": 400}})
        if req.get("n", 1) > 64:
            return self._send(500, "Internal Server Error")
        if not req.get("stream"):
            return self._send(200, {"choices": [{"message": {"content": "42"}}],
                                    "usage": {"completion_tokens": req["max_tokens"]}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_load_counts_and_times_both_kinds(server):
    res = load(Client(server, "m"), requests=10, concurrency=3, max_tokens=5, duration_s=60)
    s = res["summary"]
    assert (s["chat"]["requests"], s["stream"]["requests"], s["all"]["errors"]) == (5, 5, 0)
    assert s["chat"]["tokens"] == s["stream"]["tokens"] == 25
    assert 0 < s["stream"]["first_chunk_p50_s"] <= s["stream"]["p50_s"] <= s["stream"]["p99_s"]
    wrong = load(Client(server, "other"), requests=4, concurrency=2, max_tokens=5, duration_s=60)
    assert wrong["summary"]["all"]["errors"] == 4
    assert {r["error"]["type"] for r in wrong["requests"]} == {"NotFoundError"}


def test_bad_inputs_need_a_4xx_in_the_openai_shape_and_a_server_still_serving(server):
    rows = {r["case"]: r for r in bad_inputs(Client(server, "m"), max_model_len=64)}
    assert set(rows) == {"malformed JSON", "over-long prompt", "max_tokens 0", "max_tokens -1", "n 100000",
                         "unknown model"}
    for case in ("malformed JSON", "over-long prompt", "max_tokens 0", "unknown model"):
        assert rows[case]["refused"] and rows[case]["openai_error_shape"] and rows[case]["serving_after"], case
    # a 500 with a bare string: neither refused nor in the shape
    assert (rows["n 100000"]["status"], rows["n 100000"]["refused"], rows["n 100000"]["openai_error_shape"]) == \
        (500, False, False)


def test_disconnect_and_percentiles(server):
    d = disconnect(Client(server, "m"), logs=None)
    assert d["chunks_read"] == 1 and d["serving_after"] and d["cancelled"] is None
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile(list(range(101)), 99) == 99
