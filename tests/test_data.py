"""Prompt sources and the math reward, on real GSM8K rows (shared/data/gsm8k)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from rayspec.data import (SYSTEM_PROMPT, Problem, PromptSource, arithmetic_problems, heldout_split, load_gsm8k,
                          load_problems)
from rayspec.reward.builtins import extract_final_number, last_number

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_reward(response: str, answer: str) -> float | None:
    """The built-in last_number reward of one sample."""
    return last_number(None, [response], None, [answer])[0]


def question(p: Problem) -> str:
    """The task's question: the user message before its answer-format instruction."""
    return p.text.split("\n")[0]


@pytest.fixture(scope="module")
def gsm8k_train(gsm8k_dir) -> list[Problem]:
    return load_gsm8k(str(gsm8k_dir), "train")


@pytest.fixture(scope="module")
def gsm8k_rows(gsm8k_dir) -> list[dict]:
    with open(gsm8k_dir / "train.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(50))]


def test_gsm8k_loads_numeric_answers(gsm8k_train, gsm8k_dir):
    assert len(gsm8k_train) > 7000
    assert all(NUMBER.fullmatch(p.columns["answer"]) for p in gsm8k_train)
    assert [p.index for p in gsm8k_train[:3]] == [0, 1, 2]
    first = gsm8k_train[0]
    assert first.source == "gsm8k" and question(first).startswith("Natalia sold clips")
    assert first.columns["answer"] == "72"
    # A jsonl file works as well as its directory.
    assert load_gsm8k(str(gsm8k_dir / "train.jsonl"))[:50] == gsm8k_train[:50]


def test_reference_solutions_earn_full_reward(gsm8k_train, gsm8k_rows):
    for row, problem in zip(gsm8k_rows, gsm8k_train):
        assert math_reward(row["answer"], problem.columns["answer"]) == 1.0, row["answer"]
        # The same text, with "####" dropped, still ends in the right number.
        assert math_reward(row["answer"].replace("####", "So the answer is"), problem.columns["answer"]) == 1.0


def test_wrong_number_earns_zero(gsm8k_train, gsm8k_rows):
    for row, problem in zip(gsm8k_rows[:10], gsm8k_train):
        wrong = str(int(problem.columns["answer"]) + 1)
        assert math_reward(row["answer"].rsplit("####", 1)[0] + f"#### {wrong}", problem.columns["answer"]) == 0.0


@pytest.mark.parametrize("text, expected", [
    ("#### 1,000", "1000"),
    ("The total is $1,000.", "1000"),
    ("#### $1,000.", "1000"),
    ("so we get \\boxed{42}.", "42"),
    ("\\boxed{\\$18 \\text{ dollars}}", "18"),
    ("#### 72.0", "72"),
    ("#### 0.50", "0.5"),
    ("#### -3", "-3"),
    ("It drops to -12 degrees.", "-12"),
    ("#### +5", "5"),
    ("10-3 = 7", "7"),
    ("pick 3,4,5", "5"),
    ("#### 7\nThen another problem: 99", "7"),  # "####" wins over later numbers
    ("\\boxed{3} but 5 at the end", "3"),       # so does \boxed
    ("5 apples\n#### unknown", "5"),             # a "####" without a number falls back
    ("no number here", None),
    ("", None),
])
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_last_number_normalises_both_sides():
    assert math_reward("#### 72.0", "72") == 1.0
    assert math_reward("#### 72", "72.00") == 1.0
    assert math_reward("The answer is $1,000.", "1000") == 1.0
    assert math_reward("#### -3", "-3") == 1.0
    assert math_reward("#### 3", "-3") == 0.0
    assert math_reward("I do not know.", "0") == 0.0
    assert math_reward("#### 3", "no reference number") is None  # does not apply


@pytest.mark.parametrize("lines, lineno, why", [
    (['{"question": "q", "answer": "a #### 1"}', '{"question": "q", "answer": '], 2, "invalid JSON"),
    (['{"question": "q", "answer": "a #### 1"}', "", '{"question": "q"}'], 3, "answer"),
    (['{"question": "q", "answer": "no marker"}'], 1, "####"),
    (['{"question": "q", "answer": "#### lots"}'], 1, "not a number"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, lines, lineno, why):
    bad = tmp_path / "train.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:{lineno}: .*{why}"):
        load_gsm8k(str(tmp_path), "train")


def test_missing_local_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_gsm8k(str(tmp_path), "test")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_gsm8k(str(tmp_path / "nowhere"))


def test_hub_id_without_datasets_names_the_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="openai/gsm8k"):
        load_gsm8k("openai/gsm8k")


# One solver per template: each recomputes the answer from the question text.
SOLVERS = [
    (r"\w+ has (\d+) \w+ and buys (\d+) more, then gives away (\d+)\.", lambda a, b, c: a + b - c),
    (r"\w+ buys (\d+) bags with (\d+) \w+ in each bag and already had (\d+)", lambda k, a, b: k * a + b),
    (r"\w+ has (\d+) shelves with (\d+) \w+ on each shelf\. \w+ gives away (\d+) \w+ and then buys (\d+)",
     lambda k, a, c, b: k * a - c + b),
    (r"\w+ collects (\d+) \w+ on Monday and (\d+) \w+ on Tuesday\. On Wednesday \w+ collects (\d+) times",
     lambda a, b, k: a + b + k * a),
    (r"\w+ starts with (\d+) \w+, loses (\d+) of them, then loses (\d+) more", lambda t, b, c: t - b - c),
]


def solve(question: str) -> int:
    for pattern, f in SOLVERS:
        m = re.match(pattern, question)
        if m:
            return f(*map(int, m.groups()))
    raise AssertionError(f"no template matches {question!r}")


def test_arithmetic_answers_are_correct():
    problems = [p for seed in range(5) for p in arithmetic_problems(200, seed)]
    used = set()
    for p in problems:
        assert p.source == "arithmetic"
        assert int(p.columns["answer"]) == solve(question(p)) >= 0, p
        assert math_reward(f"#### {p.columns['answer']}", p.columns["answer"]) == 1.0
        used.add(next(i for i, (pat, _) in enumerate(SOLVERS) if re.match(pat, question(p))))
    assert used == set(range(len(SOLVERS)))
    small = [p for p in arithmetic_problems(100, 0, max_operand=10) if " starts with " not in question(p)]
    assert small and all(int(n) <= 10 for p in small for n in re.findall(r"\d+", question(p)))


def test_arithmetic_hand_checked_seed_0():
    p = arithmetic_problems(8, seed=0)
    assert [x.index for x in p] == list(range(8))
    # 18 + 34 + 9 * 18 = 214
    assert question(p[0]).startswith("Nora collects 18 apples on Monday and 34 apples on Tuesday. "
                                    "On Wednesday Nora collects 9 times as many")
    assert p[0].columns["answer"] == "214"
    # 66 - 50 - 8 = 8
    assert question(p[2]).startswith("Lee starts with 66 stickers, loses 50 of them, then loses 8 more.")
    assert p[2].columns["answer"] == "8"
    # 3 * 45 - 31 + 23 = 127
    assert question(p[4]).startswith("Ana has 3 shelves with 45 pencils on each shelf. "
                                    "Ana gives away 31 pencils and then buys 23 more.")
    assert p[4].columns["answer"] == "127"
    # 6 * 5 + 37 = 67
    assert question(p[6]).startswith("Omar buys 6 bags with 5 books in each bag and already had 37")
    assert p[6].columns["answer"] == "67"
    # 27 + 47 - 43 = 31
    assert question(p[7]).startswith("Ana has 27 pencils and buys 47 more, then gives away 43.")
    assert p[7].columns["answer"] == "31"


def test_arithmetic_deterministic_per_seed():
    assert arithmetic_problems(100, seed=3) == arithmetic_problems(100, seed=3)
    assert arithmetic_problems(100, seed=3) != arithmetic_problems(100, seed=4)
    assert arithmetic_problems(0, seed=3) == []
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_problems(5, seed=0, max_operand=1)


def test_the_prompt_asks_for_the_gsm8k_final_line():
    p = arithmetic_problems(1, seed=0)[0]
    assert p.prompt[0] == {"role": "system", "content": SYSTEM_PROMPT} and p.prompt[1]["role"] == "user"
    assert p.text.startswith(question(p)) and "step by step" in p.text and "#### <number>" in p.text
    assert arithmetic_problems(1, seed=0, system_prompt=None)[0].prompt == p.prompt[1:]


def test_prompt_source_covers_each_problem_once_per_epoch():
    problems = arithmetic_problems(23, seed=1)
    src = PromptSource(problems, batch_size=5, seed=7)
    drawn = [p.index for _ in range(23) for p in src.next_batch()]  # 5 epochs of 23
    epochs = [drawn[i:i + 23] for i in range(0, len(drawn), 23)]
    assert all(sorted(e) == list(range(23)) for e in epochs)
    assert epochs[0] != epochs[1], "each epoch reshuffles"
    assert epochs[0] != list(range(23)), "the first epoch is shuffled too"
    assert src.state_dict() == {"epoch": 4, "position": 23}
    assert [p.index for p in PromptSource(problems, 5, seed=7).next_batch()] == epochs[0][:5]


def test_prompt_source_resumes_from_state_dict():
    problems = arithmetic_problems(11, seed=2)
    src = PromptSource(problems, batch_size=4, seed=0)
    for _ in range(4):  # stops mid-epoch 1
        src.next_batch()
    state = json.loads(json.dumps(src.state_dict()))  # survives a checkpoint file
    resumed = PromptSource(problems, batch_size=4, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(10)] == [src.next_batch() for _ in range(10)]
    with pytest.raises(ValueError, match="cursor"):
        resumed.load_state_dict({"epoch": 0, "position": 12})


def test_prompt_source_rejects_bad_arguments():
    with pytest.raises(ValueError, match="no problems"):
        PromptSource([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSource(arithmetic_problems(3, seed=0), batch_size=0, seed=0)


def _data(**kw):
    from rayspec.config import load_config

    return load_config(None, [f"data.{k}={v}" for k, v in kw.items()]).data


def test_load_problems_dispatch(gsm8k_dir, gsm8k_train):
    assert len(load_problems(_data(seed=0))) == 1000
    assert load_problems(_data(num_problems=7, level=2)) == arithmetic_problems(7, 0, 10, 2)
    assert load_problems(_data(num_problems=7, level=1, max_operand=50)) == arithmetic_problems(7, 0, 50, 1)
    assert load_problems(_data(name="gsm8k", path=str(gsm8k_dir), num_problems=10)) == gsm8k_train[:10]
    with pytest.raises(ValueError, match=r"data\.name='math'.*arithmetic.*gsm8k.*files"):
        _data(name="math")


def test_heldout_split_keeps_every_held_out_question_out_of_training():
    problems = arithmetic_problems(1000, seed=0, max_operand=10, level=1)
    train, held = heldout_split(problems, 40)
    assert len(held) == len({question(p) for p in held}) == 40
    assert not {question(p) for p in held} & {question(p) for p in train}
    assert len(train) + sum(question(p) in {question(h) for h in held} for p in problems) == len(problems)
    # the held-out set is the source's last distinct questions, in source order
    tail = list(dict.fromkeys(question(p) for p in reversed(problems)))[:40]
    assert [question(p) for p in held] == tail[::-1]
    assert heldout_split(problems, 0) == (problems, [])
    # 9 * 9 sums and 45 differences: 126 distinct questions
    with pytest.raises(ValueError, match="126 distinct prompts"):
        heldout_split(problems, 126)


def test_level1_arithmetic_is_direct_and_correct():
    from rayspec.data.prompts import DIRECT_INSTRUCTION

    probs = load_problems(_data(num_problems=200, seed=3, level=1))
    assert probs == load_problems(_data(num_problems=200, seed=3, level=1))
    for p in probs:
        expr = question(p).removeprefix("What is ").removesuffix("?")
        a, op, b = expr.split()
        assert int(p.columns["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert p.text.endswith(DIRECT_INSTRUCTION)
    assert {question(p).split()[3] for p in probs} == {"+", "-"}
    with pytest.raises(ValueError, match="level"):
        arithmetic_problems(1, 0, level=3)
