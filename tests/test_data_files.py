"""A dataset of one's own (``data.name=files``): every format and layout
``data.path`` takes, both prompt formats, and bad files named by file and row."""

from __future__ import annotations

import json

import pytest

from rayspec.config import ConfigError, load_config
from rayspec.data import DataFileError, load_files, load_problems, prompt_ids, train_and_heldout

ROWS = [{"prompt": "What is 2 + 2?", "answer": "4", "level": 1},
        {"prompt": "What is 3 * 3?", "answer": "9", "level": 2},
        {"prompt": "What is 10 - 7?", "answer": "3", "level": 1}]
CHAT = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(**kw):
    return load_config(None, ["data.name=files", *[f"data.{k}={v}" for k, v in kw.items()]]).data


def test_standard_prompts_from_jsonl_keep_every_other_column(tmp_path):
    problems = load_problems(_data(path=_jsonl(tmp_path / "train.jsonl", ROWS)))
    assert [p.prompt for p in problems] == [r["prompt"] for r in ROWS]
    assert [p.columns for p in problems] == [{"answer": r["answer"], "level": r["level"]} for r in ROWS]
    assert [p.index for p in problems] == [0, 1, 2] and problems[0].source == str(tmp_path / "train.jsonl")
    assert len(load_problems(_data(path=tmp_path / "train.jsonl", num_problems=2))) == 2


def test_glob_directory_parquet_csv_json_and_saved_datasets_read_alike(tmp_path):
    import datasets

    want = [(r["prompt"], r["answer"]) for r in ROWS]
    (tmp_path / "a").mkdir()
    _jsonl(tmp_path / "a" / "part-0.jsonl", ROWS[:2])
    _jsonl(tmp_path / "a" / "part-1.jsonl", ROWS[2:])
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.to_csv(str(tmp_path / "rows.csv"), index=False)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved"))
    for path, split in [(tmp_path / "a", None), (tmp_path / "a" / "part-*.jsonl", None),
                        (tmp_path / "rows.parquet", None), (tmp_path / "rows.json", None),
                        (tmp_path / "saved", None), (tmp_path / "saved", "train")]:
        problems = load_files(str(path), "prompt", split, None)
        assert [(p.prompt, p.columns["answer"]) for p in problems] == want, path
    csv = load_files(str(tmp_path / "rows.csv"), "prompt", None, None)
    assert [(p.prompt, str(p.columns["answer"])) for p in csv] == want  # csv types its columns: 4, not "4"
    assert [p.prompt for p in load_files(str(tmp_path / "saved"), "prompt", "test", None)] == [ROWS[0]["prompt"]]


def test_conversational_prompts_get_the_system_prompt_and_the_chat_template(tmp_path, smollm2_dir):
    from rayspec.models import load_tokenizer

    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    problems = load_problems(_data(path=path, system_prompt="'Be brief.'"))
    assert problems[0].prompt == [{"role": "system", "content": "Be brief."}, CHAT[0]["prompt"][0]]
    assert problems[0].text == ROWS[0]["prompt"] and problems[0].columns == {"answer": "4"}
    tok = load_tokenizer(str(smollm2_dir))
    chat_ids = prompt_ids(tok, problems[0])
    assert chat_ids == tok.apply_chat_template(problems[0].prompt, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    assert "Be brief." in tok.decode(chat_ids) and tok.decode(chat_ids).rstrip().endswith("assistant")
    standard = load_problems(_data(path=_jsonl(tmp_path / "s.jsonl", ROWS)))[0]
    assert tok.decode(prompt_ids(tok, standard)) == ROWS[0]["prompt"]  # as is: no template, no BOS


def test_eval_path_is_the_held_out_set(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", ROWS)
    held_file = _jsonl(tmp_path / "test.jsonl", ROWS[:2])
    problems, held = train_and_heldout(_data(path=train, eval_path=held_file), 1)
    assert len(problems) == 3 and [p.prompt for p in held] == [ROWS[0]["prompt"]]
    problems, held = train_and_heldout(_data(path=train), 1)  # without it: the last distinct prompt
    assert len(problems) == 2 and held[0].prompt == ROWS[2]["prompt"]
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "q", "solution": "1"}])
    with pytest.raises(DataFileError, match=r"data\.eval_path: columns \['solution'\] differ.*\['answer', 'level'\]"):
        train_and_heldout(_data(path=train, eval_path=other), 1)


@pytest.mark.parametrize("setup, fragments", [
    (lambda d: d / "missing.jsonl", ["missing.jsonl", "no such file"]),
    (lambda d: str(d / "nothing-*.jsonl"), ["the glob matches nothing"]),
    (lambda d: _jsonl(d / "t.jsonl", [{"question": "q", "answer": "1"}]),
     ["t.jsonl", "no column 'prompt' (data.prompt_key)", "['answer', 'question']"]),
    (lambda d: _jsonl(d / "t.jsonl", [{"prompt": "q"}, {"prompt": ""}]), ["t.jsonl, row 1", "empty prompt"]),
    (lambda d: _jsonl(d / "t.jsonl", [{"prompt": [{"role": "user", "content": "q"}]},
                                      {"prompt": [{"role": "robot", "content": "q"}]}]),
     ["t.jsonl, row 1", "role 'robot'"]),
    (lambda d: _jsonl(d / "t.jsonl", [{"prompt": {"text": "q"}}]), ["t.jsonl, row 0", "of type dict", "expected a string"]),
    (lambda d: (d / "t.jsonl").write_text('{"prompt": "q"}\n{"prompt": \n') and d / "t.jsonl",
     ["t.jsonl: cannot be read as json"]),
    (lambda d: (d / "t.txt").write_text("q") and d / "t.txt", ["t.txt", "unsupported format '.txt'"]),
    (lambda d: _jsonl(d / "x.jsonl", ROWS) and (d / "y.csv").write_text("prompt\nq\n") and d,
     ["mixes formats ['csv', 'json']"]),
], ids=["missing", "empty-glob", "no-prompt-column", "empty-prompt", "bad-role", "prompt-not-text", "bad-json",
        "unsupported", "mixed"])
def test_bad_files_are_named_with_the_row(setup, fragments, tmp_path):
    path = setup(tmp_path)
    with pytest.raises(DataFileError) as e:
        load_problems(_data(path=path))
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_a_system_prompt_needs_conversational_prompts_and_split_needs_a_saved_dataset(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataFileError, match=r"t\.jsonl, row 0: data\.system_prompt needs conversational"):
        load_problems(_data(path=path, system_prompt="x"))
    with pytest.raises(DataFileError, match="data.split='test' is read only from a saved DatasetDict"):
        load_problems(_data(path=path, split="test"))


@pytest.mark.parametrize("overrides, fragment", [
    (["data.path=/data/x.jsonl"], "data.path='/data/x.jsonl': not read by data.name=arithmetic"),
    (["data.name=gsm8k", "data.prompt_key=q"], "data.prompt_key='q': not read by data.name=gsm8k"),
    (["data.name=gsm8k", "data.eval_path=x"], "data.eval_path='x': not read by data.name=gsm8k"),
    (["data.name=files", "data.path=x", "data.level=2"], "data.level=2: not read by data.name=files"),
    (["data.name=files"], "data.path=None: data.name=files needs a file"),
])
def test_a_key_the_dataset_does_not_read_is_refused(overrides, fragment):
    with pytest.raises(ConfigError, match="^" + fragment.replace(".", r"\.").replace("(", r"\(")):
        load_config("jobs/configs/default.yaml", overrides)
