"""Small file helpers shared by the stages."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it and a
    rename, so a reader (or a run stopped mid-write) sees the old file or the
    new one, never a part; returns the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def json_tuples(x):
    """JSON's lists back into the tuples a state was made of (e.g. what
    ``random.setstate`` wants)."""
    return tuple(json_tuples(v) for v in x) if isinstance(x, list) else x
