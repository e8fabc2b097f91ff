"""A draft's acceptance record: its measured acceptance rates per draft
position, kept beside the checkpoint (``acceptance.json``), from which
adaptive k starts and the DraftTrainer's cadence takes its prior."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rayspec.config import DEFAULT_DRAFT_SAMPLE_METHOD, DRAFT_SAMPLE_METHODS
from rayspec.files import write_text_atomic

log = logging.getLogger(__name__)

ACCEPTANCE_FILE = "acceptance.json"


def write_acceptance(draft_dir, rates: list[float], **meta) -> Path:
    """Record a draft's measured acceptance rates per position beside it
    (``draft_dir/acceptance.json``: ``acceptance_rate_per_pos`` and ``meta``,
    e.g. the k, temperature and prompts they were measured with), written
    atomically. ``save_head`` replaces the whole directory, so a head
    rewritten later (trained further) loses the record. Returns the file."""
    return write_text_atomic(Path(draft_dir) / ACCEPTANCE_FILE,
                             json.dumps({"acceptance_rate_per_pos": list(rates), **meta}, indent=1))


def acceptance_record(draft_dir) -> dict | None:
    """The whole record ``write_acceptance`` left beside a draft (its rates
    and what the warm start noted: ``train_prompts``, ``final_lr``, ...),
    or None where there is none (or no ``draft_dir``).

    Raises:
        ValueError: the file is not a JSON object (the file is named).
    """
    path = Path(draft_dir) / ACCEPTANCE_FILE if draft_dir else None
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not an acceptance record (not JSON: {e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not an acceptance record (a {type(record).__name__}, not a JSON object)")
    return record


def read_acceptance(draft_dir, draft_sample_method: str = DEFAULT_DRAFT_SAMPLE_METHOD) -> list[float] | None:
    """The acceptance rates per position recorded beside a draft
    (``write_acceptance``), or None where there is no record (or no
    ``draft_dir``), or where it was measured with drafts of another
    ``draft_sample_method`` than the engine's (a record without the key was
    measured with vLLM's default, greedy): sampled drafts are accepted with
    sum_v min(p, q) where greedy ones are with p(argmax q), so one method's
    rates misjudge the other's (the warm GSM8K head at T = 1: 0.30 greedy
    against 0.43 sampled at position 1), and the first rollout then drafts
    at every batch size to measure them instead.

    Raises:
        ValueError: the record is not JSON, its ``acceptance_rate_per_pos``
            is not a list of rates in [0, 1] or its ``draft_sample_method``
            not one of vLLM's (the file is named).
    """
    record = acceptance_record(draft_dir)
    if record is None:
        return None
    path = Path(draft_dir) / ACCEPTANCE_FILE
    if "acceptance_rate_per_pos" not in record:
        raise ValueError(f"{path}: not an acceptance record (no acceptance_rate_per_pos)")
    rates = record["acceptance_rate_per_pos"]
    method = record.get("draft_sample_method", DEFAULT_DRAFT_SAMPLE_METHOD)
    if not (isinstance(rates, list) and all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in rates)):
        raise ValueError(f"{path}: acceptance_rate_per_pos must be a list of rates in [0, 1], got {rates!r}")
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"{path}: draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {method!r}")
    if method != draft_sample_method:
        log.warning("adaptive k: %s was measured with %s drafts, the engine drafts %s: not used",
                    path, method, draft_sample_method)
        return None
    return [float(r) for r in rates]
