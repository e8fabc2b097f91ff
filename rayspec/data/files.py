"""A dataset of one's own (``data.name=files``): local files read with
Hugging Face ``datasets``, one prompt per row, as TRL's GRPOTrainer takes them.

``data.path`` is a file, a glob or a directory of ``.jsonl``, ``.json``,
``.parquet`` or ``.csv`` files (one format per dataset), or a directory
written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` gives its
``data.split``). The column ``data.prompt_key`` holds the prompt: a string
("standard" format, used as is) or a list of ``{"role", "content"}``
messages ("conversational", through the chat template). Every other column
travels with its prompt to the reward functions.

Nothing is downloaded: the packaged builders (json, parquet, csv) read local
files, so this works on a machine without the hub.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from rayspec.data.prompts import Problem

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant", "tool")


class DataFileError(ValueError):
    """A dataset file, column or row is unusable; the message names it."""


def data_files(path: str) -> list[Path]:
    """The files ``path`` names: itself, the files a glob matches, or a
    directory's files of a supported format (sorted; subdirectories not read).

    Raises:
        DataFileError: nothing found, an unsupported extension, or formats mixed.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in FORMATS)
        if not files:
            raise DataFileError(f"{path}: a directory with no {'/'.join(FORMATS)} file and no "
                                "datasets.save_to_disk dataset")
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(path)) if Path(f).is_file())
        if not files:
            raise DataFileError(f"{path}: no such file" + (" (the glob matches nothing)" if glob.has_magic(path)
                                                          else ""))
    bad = [f for f in files if f.suffix not in FORMATS]
    if bad:
        raise DataFileError(f"{bad[0]}: unsupported format {bad[0].suffix!r}, expected one of {list(FORMATS)}")
    kinds = {FORMATS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise DataFileError(f"{path}: mixes formats {sorted(kinds)}: one dataset, one format")
    return files


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and any((p / name).is_file() for name in ("state.json", "dataset_dict.json"))


def load_rows(path: str, split: str | None) -> list[tuple[str, list[dict[str, Any]]]]:
    """[(source, rows)]: each file's rows (a saved dataset is one source).

    Raises:
        DataFileError: see :func:`data_files`; a file ``datasets`` cannot
            parse (naming it, with its reason); a saved ``DatasetDict``
            without ``split``; ``split`` given for plain files.
    """
    import datasets  # heavy: only runs that read files import it

    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if _is_saved_dataset(p):
        saved = datasets.load_from_disk(str(p))
        if isinstance(saved, datasets.DatasetDict):
            split = split or "train"
            if split not in saved:
                raise DataFileError(f"{path}: a DatasetDict without split {split!r} (data.split); "
                                    f"it has {sorted(saved)}")
            saved = saved[split]
        elif split is not None:
            raise DataFileError(f"{path}: a single saved Dataset has no splits; data.split={split!r} is not read")
        return [(str(p), saved.to_list())]
    if split is not None:
        raise DataFileError(f"data.split={split!r} is read only from a saved DatasetDict directory; "
                            f"{path} holds plain files (give each split its own data.path / data.eval_path)")
    out = []
    for f in data_files(path):
        try:
            ds = datasets.load_dataset(FORMATS[f.suffix], data_files=[str(f)], split="train")
        except Exception as e:  # datasets wraps the parser's error (pyarrow's) in its own
            cause = e.__cause__ or e
            raise DataFileError(f"{f}: cannot be read as {FORMATS[f.suffix]}: {cause}") from None
        out.append((str(f), ds.to_list()))
    return out


def _check_prompt(prompt: Any, where: str, prompt_key: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataFileError(f"{where}: column {prompt_key!r} is an empty prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataFileError(f"{where}: column {prompt_key!r} holds a value of type {type(prompt).__name__}; expected a string "
                            "(standard prompt) or a non-empty list of {'role', 'content'} messages (conversational)")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataFileError(f"{where}: message {i} of column {prompt_key!r} is not a {{'role': str, "
                                f"'content': str}} mapping: {m!r}")
        if m["role"] not in ROLES:
            raise DataFileError(f"{where}: message {i} of column {prompt_key!r} has role {m['role']!r}, "
                                f"expected one of {list(ROLES)}")


def load_files(path: str, prompt_key: str, split: str | None, system_prompt: str | None) -> list[Problem]:
    """The problems of a dataset of one's own (see the module docstring).

    Args:
        path: ``data.path`` (or ``data.eval_path``).
        prompt_key: the prompt's column (``data.prompt_key``).
        split: the split of a saved ``DatasetDict`` (``data.split``; None
            elsewhere).
        system_prompt: prepended to conversational prompts as a system
            message (``data.system_prompt``), or None.

    Returns:
        One ``Problem`` per row, its other columns in ``columns``;
        ``source`` is the file (or saved dataset), ``index`` the running row
        number over all files.

    Raises:
        DataFileError: see :func:`load_rows`; no rows; a file without
            ``prompt_key`` (naming the columns it has) or with other columns
            than the first file; a row (named by file and 0-based row) whose
            prompt is not a string or a message list, or is conversational
            and already starts with a system message while ``system_prompt``
            is given; ``system_prompt`` with a standard prompt.
    """
    problems: list[Problem] = []
    columns: list[str] | None = None
    for source, rows in load_rows(path, split):
        if not rows:
            continue
        if prompt_key not in rows[0]:
            raise DataFileError(f"{source}: no column {prompt_key!r} (data.prompt_key); its columns are "
                                f"{sorted(rows[0])}")
        if columns is None:
            columns = sorted(rows[0])
        elif sorted(rows[0]) != columns:
            raise DataFileError(f"{source}: columns {sorted(rows[0])} differ from the first file's {columns}")
        for i, row in enumerate(rows):
            where = f"{source}, row {i}"
            prompt = row[prompt_key]
            _check_prompt(prompt, where, prompt_key)
            if system_prompt is not None:
                if isinstance(prompt, str):
                    raise DataFileError(f"{where}: data.system_prompt needs conversational prompts (message "
                                        f"lists); column {prompt_key!r} holds a string")
                if prompt[0]["role"] == "system":
                    raise DataFileError(f"{where}: the prompt already starts with a system message; "
                                        "drop data.system_prompt or that message")
                prompt = [{"role": "system", "content": system_prompt}, *prompt]
            elif not isinstance(prompt, str):
                prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
            problems.append(Problem(prompt, {k: v for k, v in row.items() if k != prompt_key}, source,
                                    len(problems)))
    if not problems:
        raise DataFileError(f"{path}: no rows")
    return problems
