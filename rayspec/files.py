"""Small file helpers shared by the stages."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it and a
    rename, so a reader (or a run stopped mid-write) sees the old file or the
    new one, never a part; returns the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def write_dir_atomic(out: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``out`` to write a whole directory
    into (a model, an adapter, a draft head); once the block completes it is
    renamed to ``out``, so a reader (or a run stopped mid-write) finds the
    old directory or the new one, never a part. An ``out`` already there is
    moved aside before the rename and removed after; with ``replace=False``
    it is kept and the new one dropped (another process wrote the same
    thing first). If the block raises, nothing at ``out`` changes and the
    temporary directory is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp
        if not replace:
            try:
                os.replace(tmp, out)
            except OSError:  # put there meanwhile (a directory does not replace one that is not empty)
                if not out.is_dir():
                    raise
            return
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def checkpoint_files(checkpoint, names: list[str]) -> Iterator[Path | None]:
    """The files ``names`` of a Ray Train checkpoint (``ray.train.Checkpoint``:
    a path on a ``pyarrow.fs`` filesystem) in a directory of this node: the
    checkpoint's own where it is on a local filesystem, else a temporary
    copy of those files alone (removed after the block), rather than
    ``as_directory``'s copy of the whole checkpoint (the policy's shards and
    optimizer state: GBs from S3 for a few MB). None where the first name
    is not in the checkpoint.

    Raises:
        OSError: a file could not be read (pyarrow's error for a remote one).
    """
    import pyarrow.fs

    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    if fs.get_file_info(f"{root}/{names[0]}").type != pyarrow.fs.FileType.File:
        yield None
    elif isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield Path(root)
    else:
        with tempfile.TemporaryDirectory(prefix="rayspec-ckpt-") as tmp:
            for name in names:
                pyarrow.fs.copy_files(f"{root}/{name}", str(Path(tmp) / name), source_filesystem=fs,
                                      destination_filesystem=pyarrow.fs.LocalFileSystem())
            yield Path(tmp)


def json_tuples(x):
    """JSON's lists back into the tuples a state was made of (e.g. what
    ``random.setstate`` wants)."""
    return tuple(json_tuples(v) for v in x) if isinstance(x, list) else x


def import_object(spec: str, key: str, error: type[Exception] = ValueError) -> Any:
    """The object ``spec`` names: ``path/to/file.py:name`` (a path ending in
    ``.py``; its own sibling modules import) or ``package.module:name``.
    Each file is imported once per process, under a module name of its own
    (two files' helpers never collide).

    Raises:
        error: naming ``key``: no such file, the file or module raised on
            import (with its error), or it has no ``name``.
    """
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise error(f"{key}: no file {path}")
        module_name = f"rayspec_user_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.resolve().parent))
            try:
                module_spec.loader.exec_module(module)
            except Exception as e:
                raise error(f"{key}: importing {path} raised {type(e).__name__}: {e}") from e
            finally:
                sys.path.remove(str(path.resolve().parent))
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise error(f"{key}: cannot import module {where!r}: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise error(f"{key}: {where} has no {name!r}")
    return getattr(module, name)


def content_digest(path: str | os.PathLike, edge_bytes: int = 1 << 20) -> str | None:
    """A digest of what is at ``path``, to tell whether two nodes hold the
    same file or directory there without reading gigabytes: each file's
    path (relative to ``path``), size, and first and last ``edge_bytes``
    bytes, in sorted order. None where nothing is there."""
    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file())
    else:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(edge_bytes))
            if size > 2 * edge_bytes:
                fh.seek(size - edge_bytes)
                h.update(fh.read(edge_bytes))
    return h.hexdigest()
