"""jobs.bench_request_units: shards against request units, in paired,
order-alternating rounds (over stand-in replicas; the real ones are the
bench's to run)."""

from __future__ import annotations

import json

from jobs import bench_request_units as bench
from rayspec.batch import RolloutBatch
from rayspec.rollout.client import LocalReplicas
from rayspec.rollout.spec_stats import SpecStats


class _Engine:
    """A replica whose samples are 3 tokens, logging each call's prompt count."""

    def __init__(self, kind: str, calls: list):
        self.kind, self.calls = kind, calls

    def generate(self, prompt_ids, n=1, group_offset=0, **kw):
        self.calls.append((self.kind, len(prompt_ids)))
        rows = [(p, group_offset + i) for i, p in enumerate(prompt_ids) for _ in range(n)]
        batch = RolloutBatch([p for p, _ in rows], [[1, 2, 3]] * len(rows), [[-0.1] * 3] * len(rows),
                             [g for _, g in rows])
        return batch, SpecStats(output_tokens=3 * len(rows))

    def shutdown(self):
        self.calls.append((self.kind, "shutdown"))


def test_rounds_alternate_their_order_and_send_shards_or_groups(gsm8k_dir, smollm2_dir, tmp_path, monkeypatch,
                                                                capsys):
    calls = []
    monkeypatch.setattr(bench, "replicas", lambda kind, *a: LocalReplicas([_Engine(kind, calls)] * 2))
    out = tmp_path / "units.json"
    assert bench.main(["--rounds", "2", "--prompts", "4", "--group-size", "2", "--data-path", str(gsm8k_dir),
                       "--model", str(smollm2_dir), "--out", str(out)]) == 0
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["order"] for r in rounds] == [["shards", "units"], ["units", "shards"]]
    assert all(r[k]["tokens"] == 4 * 2 * 3 for r in rounds for k in ("shards", "units"))
    # after the warm-up (one prompt each): a shard of 2 prompts per replica, or one call per prompt
    timed = [c for c in calls if c[1] != "shutdown"][2:]
    assert sorted(timed) == sorted([("shards", 2)] * 4 + [("units", 1)] * 8)
    assert calls.count(("shards", "shutdown")) == 2 and calls.count(("units", "shutdown")) == 2
    assert "units / shards: median" in capsys.readouterr().out and out.with_suffix(".png").is_file()


def test_too_few_prompts_for_the_rounds_is_refused(gsm8k_dir, capsys):
    assert bench.main(["--rounds", "4", "--first-prompt", "100000", "--data-path", str(gsm8k_dir)]) == 2
    assert "--first-prompt 100000" in capsys.readouterr().err
