"""The package's layering (``rayspec/__init__.py``): every import of one of
rayspec's folders or top-level modules by another, at module or function
level, points to a lower layer, so no two of them import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import rayspec

PACKAGE = Path(rayspec.__file__).parent


def _layers() -> list[set[str]]:
    """The layers the package docstring declares, lowest first."""
    text = rayspec.__doc__.split("\n\n")[-1]
    return [{name.strip() for name in layer.split(",")} for layer in text.replace("\n", " ").split("<")]


def _room(path: Path) -> str:
    """A file's folder under rayspec/, or its module name at the top."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("rayspec."):
                yield node.lineno, name.split(".")[1]


def test_every_import_points_to_a_lower_layer():
    layers = _layers()
    level = {room: i for i, layer in enumerate(layers) for room in layer}
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent != PACKAGE]
    rooms = {_room(p) for p in files}
    assert rooms == set(level), f"rooms missing from the layers: {rooms - set(level)}; gone: {set(level) - rooms}"
    upward = [f"{p.relative_to(PACKAGE.parent)}:{line} imports rayspec.{dst}"
              for p in files for line, dst in _imports(p)
              if dst != _room(p) and level[dst] >= level[_room(p)]]
    assert not upward, "imports of the same or a higher layer:\n" + "\n".join(upward)
