"""What every job that runs the RL config shares on its command line: an
optional preset first, then OmegaConf ``key=value`` overrides, checked
before anything heavy starts, and a ``--help`` that lists the presets and
every config key with its default and one line of its documentation."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any

from rayspec.config import ConfigError, RunConfig

PRESETS = Path(__file__).resolve().parent / "configs"
DEFAULT_PRESET = PRESETS / "default.yaml"


def split_args(args: list[str], default_preset: Path | None = DEFAULT_PRESET) -> tuple[Path | None, list[str]]:
    """(preset, overrides) of a job's positional arguments: an optional
    preset file first, then ``key=value`` overrides.

    Raises:
        ConfigError: an argument that is neither (named, with what to write
            instead), or a preset after an override.
    """
    preset, overrides = default_preset, []
    for i, arg in enumerate(args):
        if arg.endswith((".yaml", ".yml")) and "=" not in arg:
            if i > 0:
                raise ConfigError(f"the preset {arg} must come first, before the key=value overrides "
                                  f"({' '.join(args[:i])})")
            preset = Path(arg)
            if not preset.is_file():
                raise ConfigError(f"preset {arg}: no such file (the presets: {preset_names()})")
            continue
        if arg.startswith("-"):
            raise ConfigError(f"unknown option {arg} (--help lists the options and config keys)")
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"'{arg}' is not a key=value override: write e.g. {arg}=<value> "
                              f"({'a preset must end in .yaml' if '.' not in arg else '--help lists the keys'})")
        if not key:
            raise ConfigError(f"'{arg}': an override needs a key before '='")
        overrides.append(arg)
    return preset, overrides


def preset_names() -> str:
    return ", ".join(str(p.relative_to(PRESETS.parents[1])) for p in sorted(PRESETS.glob("*.yaml")))


def _first_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    return _first_sentence(" ".join(lines))


def _first_sentence(text: str) -> str:
    """``text`` up to its first '. ' (before a capital) or '; ' outside parentheses."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([") - (c in ")]")
        nxt = text[i + 1:i + 3]
        if depth == 0 and ((c == "." and (nxt[:1] == "" or nxt[:1] == " " and nxt[1:2].isupper())) or
                           (c == ";" and nxt[:1] == " ")):
            return text[:i + (c == ".")]
    return text


def _field_docs(cls) -> dict[str, str]:
    """{field: the first sentence of its ``Args:`` entry} of a config dataclass."""
    docs: dict[str, str] = {}
    doc = textwrap.dedent("\n".join((cls.__doc__ or "").splitlines()[1:]))
    body = textwrap.dedent(doc.split("Args:", 1)[1]) if "Args:" in doc else ""
    fields = {f.name for f in dataclasses.fields(cls)}
    for entry in re.split(r"\n(?=\S)", body.strip("\n")):
        names, sep, text = entry.partition(":")
        if not sep:
            continue
        text = " ".join(text.replace("``", "").split())
        first = _first_sentence(text)
        parts = [n.strip() for n in re.split(r"/|,", names)]
        for name in parts:
            if name.startswith("_"):  # "suffix_decoding_max_tree_depth / _max_cached_requests": a shared prefix
                cuts = [i for i, c in enumerate(parts[0]) if c == "_"]
                name = next((parts[0][:i] + name for i in cuts if parts[0][:i] + name in fields), name)
            docs[name] = first
    return docs


def _keys(cls, prefix: str, out: list[tuple[str, Any, str]]) -> None:
    docs = _field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            _keys(type(value), f"{prefix}{f.name}.", out)
        else:
            out.append((f"{prefix}{f.name}", value, docs.get(f.name, "")))


def config_keys() -> list[tuple[str, Any, str]]:
    """(dotted key, default, first sentence of its doc) of every RunConfig key."""
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(RunConfig):
        _keys(f.default_factory().__class__, f"{f.name}.", out)
    return out


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, dict):
        return "{...}" if v else "{}"
    return str(v)


def config_help(width: int = 110) -> str:
    """The presets and every key, its default and one line of doc, by section."""
    lines = ["presets (jobs/configs/; the first argument, default.yaml if none):"]
    for p in sorted(PRESETS.glob("*.yaml")):
        lines.append(_fit(f"  {p.name:<14} {_first_comment(p)}", width))
    lines.append("")
    lines.append("config keys (key=value; dataclass defaults, which a preset may change):")
    section = None
    for key, value, doc in config_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines.append(f"  {top}:")
        line = f"    {key} = {_value(value)}"
        lines.append(_fit(f"{line}  # {doc}", width) if doc and len(line) < width - 24 else line)
    return "\n".join(lines)


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."
