"""jobs.bench_agent: drafters in paired, order-alternating rounds on the
tool-use example, and the n-gram replay's copy count (over stand-in
engines; the real ones are the bench's to run)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from jobs import bench_agent as bench
from rayspec.batch import RolloutBatch
from rayspec.rollout.agent import NgramReplay, drafted_copies
from rayspec.rollout.spec_stats import SpecStats

TOOL = [7, 8, 9, 4, 5]  # a tool message's tokens: the number 4 5 inside


class _Engine:
    """A replica whose trajectories are: a call, the tool's tokens, an answer copying 4 5 from it."""

    def __init__(self, method: str, calls: list):
        self.method, self.calls = method, calls
        self.agent = SimpleNamespace(prompt_ids=lambda messages: [1, 2, 3])
        spec = None if method == "none" else SimpleNamespace(method=method, num_speculative_tokens=3,
                                                             prompt_lookup_min=2, prompt_lookup_max=4)
        self.llm = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec))

    def generate(self, prompt_ids, n=1, rows=None, **kw):
        self.calls.append((self.method, len(prompt_ids)))
        m = len(prompt_ids) * n
        response = [11, 12] + TOOL + [9, 4, 5, 2]
        mask = [1, 1] + [0] * len(TOOL) + [1, 1, 1, 1]
        counts = {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0,
                  "drafts_first_turn": 0, "accepted_first_turn": 0, "drafts_after_tool": 1,
                  "accepted_after_tool": 2}
        batch = RolloutBatch([[1, 2, 3]] * m, [response] * m, [[-0.1] * len(response)] * m,
                             [i // n for i in range(m)], loss_mask=[mask] * m, tool_counts=[counts] * m)
        return batch, SpecStats(num_drafts=m, num_accepted_tokens=2 * m, output_tokens=6 * m,
                                accepted_per_pos=[m, m, 0])

    def shutdown(self):
        self.calls.append((self.method, "shutdown"))


def test_ngram_replay_counts_drafts_copied_from_a_tool_message():
    # after the tool message, the model writes 9: the bigram (..., 9) matches "9 4 5" inside the tool's tokens
    got = drafted_copies([1, 2, 3], [11, 12] + TOOL + [9, 4, 5, 2], [1, 1] + [0] * 5 + [1, 1, 1, 1],
                         NgramReplay(3, 1, 2))
    assert got == {"drafts": 1, "accepted": 2, "accepted_from_tool": 2}
    # the same tokens written by the model itself: copied, but not from a tool output
    assert drafted_copies([1, 2, 3], [11, 12] + TOOL + [9, 4, 5, 2], [1] * 11,
                          NgramReplay(3, 1, 2))["accepted_from_tool"] == 0


def test_rounds_alternate_their_order_and_report_acceptance_by_turn(tmp_path, monkeypatch, capsys, smollm2_dir):
    calls = []
    monkeypatch.setattr(bench, "engine", lambda model_dir, method, *a: _Engine(method, calls))
    out = tmp_path / "agent.json"
    assert bench.main(["--rounds", "2", "--prompts", "2", "--group-size", "2", "--methods", "none,ngram,eagle3",
                       "--model", str(smollm2_dir), "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "eagle3 left out: no --head" in text.err
    data = json.loads(out.read_text())
    assert [r["order"] for r in data["rounds"]] == [["none", "ngram"], ["ngram", "none"]]
    ngram = data["rounds"][0]["ngram"]
    # prompt_lookup_min 2: (5, 9) occurs nowhere before; then (9, 4) in the tool's tokens drafts 5 9 4, 5 accepted
    assert ngram["replay"] == {"drafts": 4, "accepted": 4, "accepted_from_tool": 4}
    assert ngram["acceptance_length_after_tool"] == 3.0 and ngram["acceptance_length_first_turn"] is None
    assert ngram["tool_calls"] == 4 and ngram["turns_mean"] == 2
    assert "accepted 4 (vLLM 8), copied from a tool output 4 (of 8 accepted after a tool message)" in text.out
    assert "ngram / none seconds: median" in text.out and out.with_suffix(".png").is_file()
    assert calls.count(("ngram", "shutdown")) == 1 and ("ngram", 2) in calls
