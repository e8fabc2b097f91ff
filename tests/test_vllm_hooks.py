"""rayspec's touch points in vLLM (``rayspec.vllm``): every one
holds in the installed vLLM, a release is refused only where one fails (and
then by name), the hooks fail loudly, naming the vLLM version, when what
they reach for is missing (another release, or CUDA's V2 model runner),
instead of going inert; and the refit finds the draft model on both of
vLLM 0.32's model runners."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.nn as nn

from rayspec.rollout import adaptive
from rayspec.vllm import TOUCH_POINTS, TouchPoint, VllmInternalsError, check_vllm, require_vllm
from rayspec.vllm.touchpoints import API_CALLS
from rayspec.vllm import cpu_fixes as vllm_patches
from rayspec.vllm import spec_schedule
from rayspec.vllm.worker_ext import RefitExtension, _retie_embeddings


def test_every_touch_point_holds_in_the_installed_vllm():
    """Each vLLM internal rayspec patches, wraps, calls or reads, checked
    against the installed release (printed: run with -s to see the list)."""
    import vllm

    results = check_vllm(cpu=True)
    assert {tp for tp, _ in results} == {*TOUCH_POINTS, *API_CALLS} and len(TOUCH_POINTS) >= 30
    print(f"\nvLLM {vllm.__version__}: {len(results)} touch points")
    for tp, why in results:
        print(f"  {'ok  ' if why is None else 'FAIL'} {tp.use:<8} {tp.platform:<3} {tp.symbol}  ({tp.hook})")
    assert [why for _, why in results if why is not None] == []
    require_vllm()


def test_a_release_is_accepted_by_its_touch_points_not_its_number(monkeypatch, tmp_path):
    """Another version number with every touch point in its source is
    accepted; a source tree (another release, here the installed one's
    files with one function renamed) that lacks one is refused, naming it."""
    import importlib.util
    import shutil

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    require_vllm()  # another number, every touch point there: accepted
    installed = Path(importlib.util.find_spec("vllm").origin).parents[1]
    for module in {tp.symbol.partition(":")[0] for tp in (*TOUCH_POINTS, *API_CALLS)}:
        base = Path(*module.split("."))
        src = next(p for p in (installed / base.with_suffix(".py"), installed / base / "__init__.py") if p.is_file())
        (tmp_path / src.relative_to(installed)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / src.relative_to(installed))
    require_vllm(root=tmp_path)  # the touch points' own files are enough
    from jobs.check_vllm import main as check_vllm_job

    assert check_vllm_job(["--source", str(tmp_path)]) == 0
    utils = tmp_path / "vllm/v1/spec_decode/dynamic/utils.py"
    utils.write_text(utils.read_text().replace("def build_dynamic_sd_schedule_lookup(", "def renamed("))
    assert check_vllm_job(["--source", str(tmp_path)]) == 1
    with pytest.raises(VllmInternalsError, match=r"(?s)vLLM 0\.34\.0 is installed.*\n  - vllm\.v1\.spec_decode\.dynamic"
                                                 r"\.utils:build_dynamic_sd_schedule_lookup is missing \(needed by "
                                                 r"adaptive k\).*read against vLLM 0\.32\.0 and 0\.33\.0"):
        require_vllm(root=tmp_path)


def test_checking_the_touch_points_loads_nothing_of_vllm():
    """The check reads sources: vLLM's C++ extension (and its second OpenMP
    runtime, which made an engine started later in the process 2x slower)
    stays out of the checking process. LD_PRELOAD is left out of its
    environment: vLLM's CPU platform sets it to torch's libgomp in a process
    that has started an engine (as this test process may have)."""
    import os
    import subprocess
    import sys

    code = ("from rayspec.vllm.touchpoints import check_vllm; import sys; r = check_vllm(cpu=True); "
            "assert not [w for _, w in r if w]; maps = open('/proc/self/maps').read(); "
            "bad = [l for l in maps.splitlines() if '_C.abi3' in l or 'libgomp' in l]; assert not bad, bad; "
            "assert not [m for m in sys.modules if m.startswith('vllm.')], [m for m in sys.modules if 'vllm.' in m]")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


class _Scheduler:
    def __init__(self):
        self.lookup: list | None = None


def _api(update_info, *, version=None):
    return update_info, version


class _Info:
    backend: str


class _Later(_Scheduler):
    pass


def test_the_names_rayspec_passes_are_checked_in_the_definition():
    """An interface entry's parameter names (a function's, a base class's
    method's) and a class's fields are looked up in the source: a rename
    behind an unchanged symbol is named."""
    here, repo = "tests.test_vllm_hooks", Path(__file__).resolve().parents[1]
    assert TouchPoint(f"{here}:_api", "api", "t", "w", params=("update_info", "version")).check(repo) is None
    assert TouchPoint(f"{here}:_api", "api", "t", "w", params=("update_infos", "version")).check(repo) == \
        f"{here}:_api has no update_infos"
    assert TouchPoint(f"{here}:_Info", "api", "t", "w", params=("backend",)).check(repo) is None
    assert TouchPoint(f"{here}:_Info", "api", "t", "w", params=("engine",)).check(repo) == f"{here}:_Info has no engine"
    assert TouchPoint(f"{here}:_Later.__init__", "api", "t", "w", params=("self",)).check(repo) is None  # a base's


def test_an_instance_attribute_is_checked_in_the_class_source():
    here, repo = "tests.test_vllm_hooks", Path(__file__).resolve().parents[1]
    assert TouchPoint(f"{here}:_Scheduler.lookup", "read", "t", "w", instance=True).check(repo) is None
    assert TouchPoint(f"{here}:_Later.lookup", "read", "t", "w", instance=True).check(repo) is None  # a base's
    assert TouchPoint(f"{here}:_Scheduler.gone", "read", "t", "w", instance=True).check(repo) == \
        f"{here}:_Scheduler no longer sets self.gone"
    assert TouchPoint(f"{here}:_Gone.lookup", "read", "t", "w", instance=True).check(repo) == f"{here}:_Gone is missing"
    assert TouchPoint(f"{here}:_Later.__init__", "read", "t", "w").check(repo) is None
    assert TouchPoint("tests.nosuch:x", "read", "t", "w").check(repo) == "tests.nosuch is missing"


class _Worker(RefitExtension):
    def __init__(self, runner):
        self.model_runner, self.vllm_config = runner, None


class _V2Runner:
    """vLLM 0.32's V2 runner as the refit sees it: ``speculator``, no ``drafter``."""

    def __init__(self):
        self.target, self.draft = nn.Linear(2, 2), nn.Linear(2, 2)
        self.speculator = SimpleNamespace(model=self.draft)

    def get_model(self):
        return self.target

    def get_draft_model(self):
        return self.draft


def test_draft_refit_reloads_the_v2_runners_draft_model(monkeypatch):
    reloaded = []
    from rayspec.vllm import worker_ext

    monkeypatch.setattr(worker_ext, "_reload", lambda config, model, verifier, weights, skip=(): reloaded.append(model))
    runner = _V2Runner()
    _Worker(runner).rayspec_load("draft", "unused.safetensors")
    assert reloaded == [runner.draft]


def test_weight_sums_digest_the_verifier_or_the_draft():
    runner = _V2Runner()
    sums = _Worker(runner).rayspec_weight_sums("draft")
    assert sums == {n: float(p.sum()) for n, p in runner.draft.named_parameters()}
    assert _Worker(runner).rayspec_weight_sums()["weight"] == float(runner.target.weight.sum())


def test_draft_refit_without_get_draft_model_names_the_version():
    runner = SimpleNamespace(drafter=SimpleNamespace(model=nn.Linear(2, 2)), get_model=lambda: None)
    with pytest.raises(VllmInternalsError, match=r"rayspec refit: SimpleNamespace.get_draft_model is missing in vLLM \S+"):
        _Worker(runner).rayspec_load("draft", "unused.safetensors")


def test_refit_without_in_place_reload_names_the_version(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload.inplace", None)
    from rayspec.vllm import worker_ext

    with pytest.raises(VllmInternalsError, match="refit: vllm.model_executor.model_loader.reload.inplace:"
                                                 "reload_weights is missing"):
        worker_ext._reload(None, nn.Linear(2, 2), nn.Linear(2, 2), iter(()))


def test_retie_without_vllms_lm_head_api_names_the_version():
    model = nn.Module()
    model.config = SimpleNamespace(tie_word_embeddings=True)
    model.model = SimpleNamespace(embed_tokens=nn.Embedding(4, 2))
    model.lm_head = nn.Linear(2, 4)  # a plain Linear: no tie_weights / quant_method
    with pytest.raises(VllmInternalsError, match=r"rayspec refit: Linear\.tie_weights is missing"):
        _retie_embeddings(model)


def _v1_runner(sample_wrapped: bool, drafter):
    def _sample(self, logits, spec_decode_metadata):
        return None

    if sample_wrapped:
        _sample.rayspec_wrapped = True
    cls = type("GPUModelRunner", (), {"_sample": _sample})
    runner = cls()
    runner.drafter = drafter
    return runner


def _drafter(propose_wrapped: bool, base: str = "eagle"):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    def propose(self, num_speculative_tokens, *args, **kwargs):
        return None

    if propose_wrapped:
        propose.rayspec_wrapped = True
    # a subclass, so the real class keeps the plugin's wrapper; not __init__ed
    cls = (type("EagleProposer", (SpecDecodeBaseProposer,), {"propose": propose}) if base == "eagle" else
           type("SuffixDecodingProposer", (SuffixDecodingProposer,), {"propose": propose}))
    return object.__new__(cls)


@pytest.mark.parametrize("runner, match", [
    (_V2Runner(), r"has no `drafter` \(the V2 runner keeps a `speculator`.*VLLM_USE_V2_MODEL_RUNNER=0\)"),
    (_v1_runner(False, _drafter(True)), r"GPUModelRunner\._sample is not wrapped"),
    (_v1_runner(True, _drafter(False)), r"EagleProposer\.propose is not wrapped"),
    (_v1_runner(True, _drafter(False, "suffix")), r"SuffixDecodingProposer\.propose is not wrapped"),
])
def test_adaptive_hooks_missing_in_the_worker_name_the_version(runner, match):
    with pytest.raises(VllmInternalsError, match=rf"rayspec adaptive k: .*{match} in vLLM \S+ \(rayspec was read"):
        spec_schedule._check_worker_hooks(SimpleNamespace(model_runner=runner))


def test_adaptive_hooks_in_place_pass_the_check():
    spec_schedule._check_worker_hooks(SimpleNamespace(model_runner=_v1_runner(True, _drafter(True))))
    spec_schedule._check_worker_hooks(SimpleNamespace(model_runner=_v1_runner(True, _drafter(True, "suffix"))))
    # the n-gram drafter takes any k and has no forward to idle: only the sampler hook applies
    spec_schedule._check_worker_hooks(SimpleNamespace(model_runner=_v1_runner(True, object())))


def _suffix_proposer(k: int):
    """vLLM's suffix proposer over Arctic Inference's cache (not __init__ed:
    no VllmConfig), and ``step(k, token)``: one decode step of a request
    whose prompt repeats 5..10, sampling ``token``, drafting at k."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    proposer = object.__new__(SuffixDecodingProposer)
    proposer.__dict__.update(num_speculative_tokens=k, max_tree_depth=24, max_spec_factor=4.0, min_token_prob=0.1,
                             max_model_len=256, suffix_cache=SuffixDecodingCache(max_tree_depth=24,
                                                                                 max_cached_requests=0))
    tokens = np.zeros((1, 256), dtype=np.int32)  # vLLM's InputBatch.token_ids_cpu
    tokens[0, :18] = [5, 6, 7, 8, 9, 10] * 3
    batch = SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}, num_prompt_tokens=np.array([18]),
                            num_tokens_no_spec=np.array([18]), token_ids_cpu=tokens)

    def step(propose, k: int, token: int) -> list[list[int]]:
        tokens[0, batch.num_tokens_no_spec[0]] = token
        batch.num_tokens_no_spec[0] += 1
        return propose(proposer, k, batch, [[token]])

    return proposer, step


def test_suffix_proposer_drafts_at_the_scheduled_k():
    """vLLM 0.32's suffix proposer asserts the scheduled k is its configured
    one; wrapped, the scheduled k is each draft's budget, k = 0 still feeds
    the sampled tokens to the suffix tree, and the configured k is kept."""
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    spec_schedule.register()  # what vLLM's plugin loader does in every engine process (idempotent)
    propose = SuffixDecodingProposer.propose
    assert propose.rayspec_wrapped
    _, step = _suffix_proposer(k=5)
    with pytest.raises(AssertionError):  # unwrapped: the engine core dies at its first step with k != 5
        step(propose.__wrapped__, 2, 5)
    proposer, step = _suffix_proposer(k=5)
    assert step(propose, 0, 5) == [[]]
    assert proposer.suffix_cache.active_requests == {"r"}  # k = 0 started the request's tree
    assert step(propose, 2, 6) == [[7, 8]]  # the repeat drafts, cut at k = 2
    assert step(propose, 5, 7) == [[8, 9, 10, 5, 6]]
    assert proposer.num_speculative_tokens == 5


def test_plugin_on_a_vllm_without_its_targets_records_why(monkeypatch, caplog):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "_sample")
    monkeypatch.setattr(spec_schedule, "_register_error", None)
    spec_schedule.register()  # vLLM loads it into every engine: it must not raise there
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample is missing" in spec_schedule._register_error
    assert "rayspec adaptive k is unavailable" in caplog.text
    runner = _v1_runner(False, object())
    with pytest.raises(VllmInternalsError, match=r"_sample is not wrapped \(the rayspec_spec_schedule plugin: "
                                                 r"rayspec adaptive k: \S+GPUModelRunner._sample is missing"):
        spec_schedule._check_worker_hooks(SimpleNamespace(model_runner=runner))


def test_schedule_change_on_an_engine_core_without_the_utility_names_the_version():
    from rayspec.vllm.engines import OfflineEngine

    engine = object.__new__(OfflineEngine)  # over an in-process client whose core lacks the utility
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=object())))
    with pytest.raises(VllmInternalsError, match=rf"has no {spec_schedule.UTILITY}.*VLLM_PLUGINS"):
        spec_schedule.set_schedule(engine, adaptive.uniform(0, 4), True)


def test_cpu_sampler_fix_refuses_an_affected_vllm_without_its_targets(monkeypatch):
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(vllm_patches, "_applied", False)
    monkeypatch.setattr(vllm_patches, "needs_patch", lambda: True)
    monkeypatch.delattr(cpu_triton_utils, "_expand_kernel_impl")
    recovered = rejection_sampler.sample_recovered_tokens
    with pytest.raises(VllmInternalsError, match=r"CPU speculative-sampling fix: vllm\.utils\.cpu_triton_utils:"
                                                 r"_expand_kernel_impl is missing in vLLM \S+"):
        vllm_patches.register()
    assert rejection_sampler.sample_recovered_tokens is recovered  # nothing half-applied
