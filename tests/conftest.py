"""Shared fixtures: the bundled model, a tiny random Llama, one Ray session."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared"
CACHE_DIR = os.environ.get("RAYSPEC_CACHE_DIR", "~/.cache/rayspec")
# what every metrics.jsonl record holds (docs/configuration.md, "The step record")
STEP_RECORD_KEYS = {"step", "reward_mean", "acceptance_length", "acceptance_rate_per_pos",
                    "rollout_tokens_per_s", "time_rollout_s", "time_reward_s", "time_advantages_s",
                    "time_policy_s", "time_draft_s", "time_sync_s", "policy_version", "response_lens",
                    "prompt_len_mean", "sample",
                    "weight_sync_transport", "weight_sync_bytes", "time_sync_gather_s", "time_sync_transfer_s",
                    "time_sync_load_s", "rewards", "reward_errors"}


def start_ray() -> None:
    """The suite's one embedded Ray cluster (2 CPUs, 1 GiB object store), as
    ``jobs.grpo`` starts one, with every role's output streamed to the
    suite's (``logging.verbose``: a failure's log is in CI's); nothing if
    Ray is up."""
    import ray

    from rayspec.config import load_config
    from rayspec.driver import init_ray

    if not ray.is_initialized():
        init_ray(load_config(None, ["ray.num_cpus=2", f"ray.object_store_memory={1 << 30}", "logging.verbose=true"]))


def pytest_addoption(parser):
    """Where the ``gpu`` tests (tests/test_gpu_path.py) put what they build;
    ``jobs.gpu_smoke`` passes its ``--work-dir`` and ``--cache-dir`` here."""
    parser.addoption("--gpu-work-dir", default="/tmp/rayspec-gpu-smoke",
                     help="gpu tests: the test models and RL run directories")
    parser.addoption("--gpu-cache-dir", default=CACHE_DIR, help="gpu tests: the bundled model's cache (tokenizer)")


def pytest_collection_modifyitems(config, items):
    """The tests on the shared Ray session run last, one after the other (in
    their modules' order): the session starts once, and its daemons (GCS,
    raylet, dashboard: about 13% of a core while idle) never run beside the
    tests that do not need it.

    Without a CUDA device the ``gpu`` tests are skipped, before any of their
    fixtures (models, engines, Ray) is set up."""
    items.sort(key=lambda item: "ray_session" in getattr(item, "fixturenames", ()))
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason=f"needs a CUDA GPU; torch {torch.__version__} sees none "
                                    "(on a GPU node: python -m jobs.gpu_smoke, docs/gpu.md)")
            for item in gpu:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray session for every test that needs an embedded cluster (each
    start costs seconds); they run last (``pytest_collection_modifyitems``).
    A module that needs a cluster of its own runs before them and stops
    Ray when done."""
    start_ray()
    yield
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def s3_uri():
    """``s3_uri(prefix)``: a ``pyarrow.fs`` URI of an S3 bucket on a moto
    server (what Ray's own storage tests use), with its endpoint and fake
    credentials in the URI, so Ray's workers on this host reach it too. The
    server runs in a process of its own: moto's imports Flask, whose
    ``current_app`` proxy raises RuntimeError on ``hasattr``, and vLLM
    0.32's kernel dispatcher (``_rebind_kernels``) calls ``hasattr`` on every
    module attribute in ``sys.modules``, so an in-process engine started
    after it would fail."""
    import subprocess
    import time

    import pyarrow.fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
            time.sleep(0.2)
    base = f"s3://rayspec:secret@rayspec-test/{{}}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    pyarrow.fs.FileSystem.from_uri(base.format("") + "&allow_bucket_creation=true")[0].create_dir("rayspec-test")
    yield base.format
    server.kill()
    server.wait()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from rayspec.models import materialize_bundled_model

    return materialize_bundled_model(CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Random 8-layer Llama (hidden 128, head_dim 64) with SmolLM2's tokenizer."""
    from rayspec.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smollm2_dir)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    d = SHARED / "data" / "gsm8k"
    assert (d / "train.jsonl").is_file(), f"GSM8K copy missing at {d} (shared/ must sit beside the repo)"
    return d

# Overrides that run a replica's vLLM engine core in the replica's own
# process (vllm.LLM: AsyncLLM always starts one of its own): ~20 s less to
# start per replica here, and a seeded rollout repeats bit for bit, its
# logprobs included (docs/faults.md).
IN_PROCESS = ["rollout.engine_env.VLLM_ENABLE_V1_MULTIPROCESSING=0", "rollout.engine_cls=offline",
              "rollout.engine_kwargs.distributed_executor_backend=uni"]


@pytest.fixture
def in_process_engine_core(monkeypatch):
    """``SpecVLLMEngine``s built in the test run their vLLM engine core and
    worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as
    ``IN_PROCESS``): ~20 s less per engine start. For tests of what an engine
    does, not of its process layout (tests/test_vllm_patch.py reads a worker
    process's memory map, and the Ray tests run replicas as users do).

    Not once numba's llvmlite is loaded here (an in-process n-gram engine
    loads it): vLLM 0.32's kernel-override scan over ``sys.modules``
    (``triton_utils.dispatcher``) then fails at engine start on llvmlite's
    ``_lib_fn_wrapper`` (AttributeError: no attribute 'get'), so the engine
    starts in its own process instead."""
    if "llvmlite" not in sys.modules:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_kwargs(**kw):
    base = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 16, "seed": 0}
    base.update(kw)
    return base


# Planted bad checkpoints for tests/test_bad_input.py and tests/test_security.py.
MARKER = "rayspec-test-code-ran"  # a file that exists only if a checkpoint's code ran


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A fresh EAGLE-3 head (vLLM format) for the tiny Llama."""
    from rayspec.draft.eagle3 import init_head, save_head
    from rayspec.models import load_policy

    return save_head(init_head(load_policy(tiny_llama_dir)), tmp_path_factory.mktemp("head") / "head")


def copy_model_dir(src: Path, dst: Path, **config_changes) -> Path:
    """Copy an HF/head directory, updating keys of its config.json."""
    shutil.copytree(src, dst)
    if config_changes:
        cfg_file = dst / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config_changes}))
    return dst


class PicklePayload:
    """Pickles to a call that writes ``path``: what loading an untrusted pickle can do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def planted_policy(kind: str, tmp: Path, tiny: Path) -> Path:
    """A bad policy directory under ``tmp``: ``no-config``, ``not-causal-lm``,
    ``custom-code`` (auto_map code that writes MARKER on import) or
    ``pickle-weights`` (only a pytorch_model.bin that writes MARKER when unpickled)."""
    if kind == "no-config":
        d = tmp / "empty"
        d.mkdir()
        return d
    if kind == "not-causal-lm":
        return copy_model_dir(tiny, tmp / "bert", architectures=["BertModel"], model_type="bert")
    if kind == "custom-code":
        d = copy_model_dir(tiny, tmp / "custom", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
        (d / "modeling_x.py").write_text(f"open({str(tmp / MARKER)!r}, 'w').write('ran')\n")
        return d
    if kind == "pickle-weights":
        import torch

        d = copy_model_dir(tiny, tmp / "pickled")
        (d / "model.safetensors").unlink()
        torch.save({"evil": PicklePayload(tmp / MARKER)}, d / "pytorch_model.bin")
        return d
    raise ValueError(kind)


@pytest.fixture(scope="session")
def single_rank_group():
    """A one-process gloo group, as Ray Train sets up for each worker (one
    for the session: DeepSpeed keeps the group of its first engine)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():  # a Ray Train run in this process may have shut it down already
        dist.destroy_process_group()
