"""Reward functions in TRL's form: the built-ins, one's own by reference
(file or module), their signature checked against the dataset's columns,
and the Ray actors that score a batch, with errors and timeouts named by
function and sample."""

from __future__ import annotations

import os

import pytest

from rayspec.config import load_config
from rayspec.data import Problem
from rayspec.reward.builtins import format_reward, last_number, math_verify
from rayspec.reward.functions import RewardFunctionError, check_signature, resolve
from rayspec.reward.pool import RewardError, RewardPool

USER_REWARDS = '''
import time

def length_penalty(prompts, completions, completion_ids, **kwargs):
    return [-0.01 * len(ids) for ids in completion_ids]

def by_level(completions, level, **kwargs):
    """Applies to level-2 rows only (None elsewhere)."""
    return [1.0 if level_ == 2 else None for level_ in level]

def picky(completions, **kwargs):
    out = []
    for c in completions:
        if "boom" in c:
            raise ValueError("cannot score this")
        if "hang" in c:
            time.sleep(60)
        out.append(1.0)
    return out

def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def wordy(completions, **kwargs):
    return ["yes" for _ in completions]

def needs_solution(completions, solution):
    return [0.0 for _ in completions]

def positional(completions, /, **kwargs):
    return [0.0 for _ in completions]

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_last_number_math_verify_and_format_builtins():
    completions = ["So 3 + 4 = 7.\n#### 7", "The answer is $\\frac{1}{2}$", "I think 8", "no idea",
                   "answer: 7", "\\boxed{7}", "3 + 4 = ?"]
    answers = ["7", "0.5", "7", "7", "7", "7", "7"]
    assert last_number(None, completions, None, answers) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    # 1/2 = 0.5 symbolically; math_verify reads a stated answer (boxed, or after an anchor), not "#### 7",
    # and never credits an expression that merely equals the answer ("3 + 4 = ?", the question restated)
    assert math_verify(None, completions, None, answers) == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    # a whole GSM8K solution counts by its "#### N" line; an unparsable reference does not apply
    assert math_verify(None, ["\\boxed{72}"], None, ["48/2 = 24 clips... 48+24 = 72\n#### 72"]) == [1.0]
    assert math_verify(None, ["72"], None, ["no answer here"]) == [None]
    assert last_number(None, ["72"], None, ["none"]) == [None]
    # conversational completions are message lists (TRL)
    assert last_number(None, [[{"role": "assistant", "content": "#### 7"}]], None, ["7"]) == [1.0]
    fmt = format_reward(r"<think>.*</think>\s*<answer>.*</answer>$")
    assert fmt(None, ["<think>a\nb</think> <answer>7</answer>", "<answer>7</answer>"], None) == [1.0, 0.0]


def test_functions_resolve_from_files_modules_and_builtins(rewards_file):
    fn = resolve(f"{rewards_file}:length_penalty", "k")
    assert fn(None, ["a"], [[1, 2, 3]]) == pytest.approx([-0.03])
    assert resolve("rayspec.reward.builtins:last_number", "k") is last_number
    assert resolve("last_number", "k") is last_number
    for spec, fragment in [(f"{rewards_file.parent}/none.py:f", "no file"),
                           ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                           (f"{rewards_file}:missing", "has no 'missing'"),
                           (f"{rewards_file}:NOT_A_FUNCTION", "is a int, not a function")]:
        with pytest.raises(RewardFunctionError, match=f"^reward.functions\\[0\\]: .*{fragment}"):
            resolve(spec, "reward.functions[0]")
    broken = rewards_file.parent / "broken.py"
    broken.write_text("import no_such_package_xyz\n")
    with pytest.raises(RewardFunctionError, match="importing .*broken.py raised ModuleNotFoundError"):
        resolve(f"{broken}:f", "k")


def test_signatures_are_checked_against_the_dataset_columns(rewards_file):
    columns = {"answer", "level"}
    for name in ("length_penalty", "by_level", "picky"):
        check_signature(resolve(f"{rewards_file}:{name}", "k"), "k", columns)
    check_signature(last_number, "k", columns)
    with pytest.raises(RewardFunctionError, match=r"'solution' is neither .*\(the columns are \['answer', 'level'\]"):
        check_signature(resolve(f"{rewards_file}:needs_solution", "k"), "k", columns)
    with pytest.raises(RewardFunctionError, match="'answer' is neither"):
        check_signature(last_number, "k", {"solution"})  # last_number reads the answer column
    with pytest.raises(RewardFunctionError, match="'completions' is positional-only"):
        check_signature(resolve(f"{rewards_file}:positional", "k"), "k", columns)


def _problems(levels):
    return [Problem(f"q{i}", {"answer": "7", "level": lv}, "test", i) for i, lv in enumerate(levels)]


def _pool(functions, **kw):
    overrides = [f"reward.functions=[{','.join(functions)}]", *[f"reward.{k}={v}" for k, v in kw.items()]]
    return RewardPool(load_config(None, overrides).reward, {"answer", "level"})


def test_the_pool_sums_weighted_scores_and_averages_each_function_where_it_applies(ray_session, rewards_file):
    pool = _pool([f"{rewards_file}:by_level", "last_number", f"{rewards_file}:length_penalty"],
                 weights="[0.5,1.0,1.0]", num_workers=2)
    try:
        result = pool.score(_problems([1, 2, 2, 1, 2]), ["#### 7", "#### 7", "8", "7", "x"],
                            [[1], [1, 2], [1], [1, 2, 3, 4], []])
    finally:
        pool.close()
    assert result.per_function["by_level"] == 1.0  # over the three level-2 rows only
    assert result.per_function["last_number"] == pytest.approx(3 / 5)
    assert result.per_function["length_penalty"] == pytest.approx(-0.01 * 8 / 5)
    assert result.rewards == pytest.approx([1 - 0.01, 0.5 + 1 - 0.02, 0.5 - 0.01, 1 - 0.04, 0.5])
    assert result.errors == 0


def _env(score):
    """An environment as the replica sends it back (pickled: the reward workers receive it too)."""
    from types import SimpleNamespace

    def get_reward():
        if score == "boom":
            raise OSError("sandbox gone")
        return score
    return SimpleNamespace(get_reward=get_reward)


def test_an_environments_get_reward_is_a_reward_of_weight_one(ray_session, rewards_file):
    """TRL's rule: an environment class with get_reward() adds its value,
    weight 1, under the class name; the functions get ``environments``."""
    pool = RewardPool(load_config(None, [f"reward.functions=[{rewards_file}:by_level]"]).reward, {"answer", "level"},
                      environments=True, environment_reward="Ledger")
    try:
        result = pool.score(_problems([2, 2, 1]), ["a", "b", "c"], [[1]] * 3,
                            environments=[_env(0.5), None, _env(2)])
        assert result.values["Ledger"] == [0.5, None, 2.0] and result.rewards == [1.5, 1.0, 2.0]
        assert result.per_function["Ledger"] == 1.25
        with pytest.raises(RewardError, match="Ledger.get_reward raised OSError: sandbox gone on sample 1"):
            pool.score(_problems([1, 1]), ["a", "b"], [[1]] * 2, environments=[_env(1), _env("boom")])
        with pytest.raises(RewardError, match="Ledger.get_reward returned nan on sample 0"):
            pool.score(_problems([1]), ["a"], [[1]], environments=[_env(float("nan"))])
    finally:
        pool.close()


def test_a_failing_sample_is_named_or_zeroed_and_the_others_keep_their_scores(ray_session, rewards_file):
    texts = ["#### 7", "boom", "#### 7", "hang"]
    pool = _pool([f"{rewards_file}:picky", "last_number"], timeout_s=2, num_workers=2)
    try:
        with pytest.raises(RewardError, match=r"picky raised ValueError: cannot score this on sample 1 of the batch "
                                              r"\(row 1 of test; prompt 'q1'; completion 'boom'\)"):
            pool.score(_problems([1] * 4), texts, [[1]] * 4)
    finally:
        pool.close()
    pool = _pool([f"{rewards_file}:picky", "last_number"], timeout_s=2, num_workers=2, on_error="zero")
    try:
        result = pool.score(_problems([1] * 4), texts, [[1]] * 4)
        assert result.errors == 2  # "boom" raised, "hang" timed out
        assert result.rewards == [2.0, 0.0, 2.0, 0.0] and result.per_function["picky"] == 0.5
        assert pool.score(_problems([1]), ["#### 7"], [[1]]).rewards == [2.0]  # the hung worker was replaced
    finally:
        pool.close()
    pool = _pool([f"{rewards_file}:picky"], timeout_s=2)
    try:
        with pytest.raises(RewardError, match=r"picky timed out after .* s \(reward.timeout_s\) on sample 0"):
            pool.score(_problems([1]), ["hang"], [[1]])
    finally:
        pool.close()


@pytest.mark.parametrize("name, fragment", [("short", "returned 1 values for 2 samples"),
                                            ("wordy", r"returned 'yes' \(str\) at position 0")])
def test_a_function_returning_the_wrong_length_or_type_is_named(ray_session, rewards_file, name, fragment):
    pool = _pool([f"{rewards_file}:{name}"])
    try:
        with pytest.raises(RewardError, match=f"reward function .*:{name} {fragment}"):
            pool.score(_problems([1, 1]), ["a", "b"], [[1], [1]])
    finally:
        pool.close()


def test_reward_config_refuses_bad_lists():
    from rayspec.config import ConfigError

    for overrides, fragment in [(["reward.functions=[]"], "needs at least one function"),
                                (["reward.functions=[last_number,last_number]"], "two functions named"),
                                (["reward.functions=[my_reward]"], "expected path/to/file.py:name"),
                                (["reward.functions=[format]", "reward.format_pattern=("], "not a regular expression"),
                                (["reward.on_error=skip"], "expected one of ['raise', 'zero']"),
                                (["reward.timeout_s=0"], "must be > 0")]:
        with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
            load_config(None, overrides)


def test_relative_files_are_made_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["reward.functions=[rewards/mine.py:fn,pkg.mod:other,last_number]", "data.name=files",
                             "data.path=data/*.jsonl", "data.eval_path=~/test.jsonl"])
    assert cfg.reward.functions == [f"{tmp_path}/rewards/mine.py:fn", "pkg.mod:other", "last_number"]
    assert cfg.reward.names == ["fn", "other", "last_number"]
    assert (cfg.data.path, cfg.data.eval_path) == (f"{tmp_path}/data/*.jsonl", os.path.expanduser("~/test.jsonl"))
    assert load_config(None, ["data.name=gsm8k"]).data.path == "openai/gsm8k"  # a hub id stays one


def test_the_readme_example_task_loads_and_scores(tmp_path):
    """examples/own_task: its data and reward functions pass the checks a run makes
    before the first rollout, and score as their docstrings say."""
    import subprocess
    import sys

    from rayspec.data import load_problems
    from rayspec.preflight import check_reward_functions

    subprocess.run([sys.executable, "examples/own_task/make_data.py", str(tmp_path)], check=True)
    cfg = load_config(None, ["data.name=files", f"data.path={tmp_path}/train.jsonl",
                             f"data.eval_path={tmp_path}/test.jsonl", "data.system_prompt=Be brief.",
                             "reward.functions=[math_verify,examples/own_task/rewards.py:boxed_once,"
                             "examples/own_task/rewards.py:products_only]", "reward.weights=[1.0,0.2,0.5]"])
    problems = load_problems(cfg.data)
    assert len(problems) == 400 and set(problems[0].columns) == {"answer", "op"}
    check_reward_functions(cfg.reward, set(problems[0].columns))
    boxed, products = (resolve(f, "k") for f in cfg.reward.functions[1:])
    completions = [[{"role": "assistant", "content": t}] for t in ("\\boxed{16}", "16", "\\boxed{6} \\boxed{60}")]
    assert boxed(completions=completions) == [1.0, 0.0, 0.0]
    assert products(completions=completions, answer=["16", "16", "60"], op=["+", "*", "*"]) == [None, 1.0, 1.0]
