"""Crash-safe per-rank checkpoints, and the check that every rank resumes from the same step.

    save_checkpoint(state, f"ckpt-rank{rank}.pt")          # atomic; the previous one is kept
    state, path = load_checkpoint(f"ckpt-rank{rank}.pt")    # falls back to the previous one
    check_same_step(transport, state["step"], state["run_id"])

A checkpoint is written to a temporary file beside it, flushed to disk (fsync), and renamed over
the old one, which is first kept as `<name>.prev`. A crash at any moment therefore leaves at
least one complete checkpoint: the new one, or the previous one, which load_checkpoint falls
back to when the newest is missing or unreadable. Because a fallback can make ranks load
different steps, resuming ranks compare (step, run id) in one collective and all refuse together
when they differ.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from .transport import Transport

PREVIOUS_SUFFIX = ".prev"
TEMPORARY_SUFFIX = ".tmp"


def previous_path(path: str | os.PathLike) -> Path:
    """Where save_checkpoint keeps the checkpoint it replaced."""
    path = Path(path)
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `state` (torch.save) to `path` so that a crash never leaves no loadable checkpoint:
    temporary file, fsync, the current checkpoint kept as `<path>.prev`, rename."""
    path = Path(path)
    temporary = path.with_name(path.name + TEMPORARY_SUFFIX)
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.replace(path, previous_path(path))
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    """(state, the file it came from): `path`, or `<path>.prev` when `path` is missing or
    cannot be read (a crash during save_checkpoint). FileNotFoundError when neither exists,
    ValueError naming both when neither loads."""
    path = Path(path)
    candidates = [p for p in (path, previous_path(path)) if p.exists()]
    if not candidates:
        raise FileNotFoundError(f"no checkpoint at {path} or {previous_path(path)}")
    errors = []
    for candidate in candidates:
        try:
            return torch.load(candidate, weights_only=True), candidate
        except Exception as exc:  # a torn or corrupted file: try the previous one
            errors.append(f"{candidate}: {type(exc).__name__}: {exc}")
    raise ValueError("no checkpoint could be loaded: " + "; ".join(errors))


def _run_digest(run_id: str) -> int:
    return int.from_bytes(hashlib.sha1(run_id.encode()).digest()[:7], "big")


def check_same_step(
    transport: Transport, step: int, run_id: str, name: str = "checkpoint.agree"
) -> None:
    """Every rank passes the step and run id of the checkpoint it loaded; one all-gather of two
    int64. Returns when all agree; otherwise raises ValueError on every rank, naming each rank's
    step (and which ranks hold another run's checkpoint)."""
    mine = torch.tensor([int(step), _run_digest(run_id)], dtype=torch.int64)
    everyone = transport.allgather(mine.view(torch.uint8), name)
    values = [piece.view(torch.int64).tolist() for piece in everyone]
    steps = [v[0] for v in values]
    runs = [v[1] for v in values]
    if len(set(runs)) > 1:
        others = [r for r, d in enumerate(runs) if d != runs[0]]
        raise ValueError(
            f"the ranks loaded checkpoints of different runs: ranks {others} hold a "
            f"checkpoint of another run than rank 0 (steps by rank: {steps})"
        )
    if len(set(steps)) > 1:
        raise ValueError(
            f"the ranks loaded checkpoints of different steps: {steps} (rank by "
            "rank); a crash during a save leaves some ranks with the previous "
            "checkpoint: resume them all from one step"
        )
