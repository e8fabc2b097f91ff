"""The notebooks run end to end (nbclient, a fresh kernel each) and fail on
any cell error: the quickstart trains a few steps of the default model with
speculation (bf16 vLLM rollouts, fp32 DeepSpeed training), the benchmark
notebook draws its plots from that run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayspec.metrics import read_metrics
from tests.conftest import STEP_RECORD_KEYS

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _execute(name: str, env_run_dir: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RAYSPEC_RUN_DIR", str(env_run_dir))  # the kernel inherits it
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def _outputs(nb, output_type: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == output_type]


def _text(nb) -> str:
    return "".join(o.get("text", "") for o in _outputs(nb, "stream"))


@pytest.mark.slow
def test_quickstart_then_benchmark_plots(tmp_path, monkeypatch, smollm2_dir):
    run_dir = tmp_path / "quickstart"
    nb = _execute("quickstart.ipynb", run_dir, monkeypatch)
    text = _text(nb)
    assert "step 2: acceptance length" in text
    assert '"response":' in text and '"reward":' in text  # one rollout shown
    images = [o for o in _outputs(nb, "display_data") if "image/png" in o.data]
    assert images, "curves.png not displayed"
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert STEP_RECORD_KEYS <= r.keys()
        assert r["rollout_tokens"] > 0
        # the preset adapts k: where the replica's schedule is 0 everywhere, nothing drafts
        (replica,) = r["replicas"].values()
        if all(k == 0 for _, _, k in replica["k_schedule"]):
            assert r["num_drafts"] == 0
        assert 1.0 <= r["acceptance_length"] <= 4.0
        assert 0.0 <= r["reward_mean"] <= 1.0
        # the preset serves float32: vLLM samples from the trainer's own weights
        assert r["token_mult_prob_error"] < 1e-3
        assert r["kl"] >= 0.0  # the preset's KL term: drift from the initial policy
    # held-out evaluations of the initial and the final policy
    evals = [e for r in recs for e in r.get("evals", [])]
    assert [e["policy_version"] for e in evals] == [0, 2]
    assert evals[0]["greedy_changed"] == 0.0 and 0.0 <= evals[1]["greedy_changed"] <= 1.0
    assert "held-out after 2 steps: reward greedy" in text

    nb = _execute("benchmark_plots.ipynb", run_dir, monkeypatch)
    assert len([o for o in _outputs(nb, "display_data") if "image/png" in o.data]) == 2
    assert (run_dir / "plots" / "rl.png").is_file() and (run_dir / "plots" / "rollout.png").is_file()
    assert "median" in _text(nb)
