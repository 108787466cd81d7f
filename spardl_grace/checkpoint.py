"""Crash-safe per-rank checkpoints, and the check that every rank resumes from the same step.

    save_checkpoint(state, f"ckpt-rank{rank}.pt")          # atomic; the previous one is kept
    state, path = load_checkpoint(f"ckpt-rank{rank}.pt")    # falls back to the previous one
    check_same_step(transport, state["step"], state["run_id"])

A checkpoint is written to a temporary file beside it, flushed to disk (fsync), and renamed over
the old one, which is first kept as `<name>.prev`. A crash at any moment therefore leaves at
least one complete checkpoint: the new one, or the previous one, which load_checkpoint falls
back to when the newest is missing or unreadable. Because a fallback can make ranks load
different steps, resuming ranks compare (step, run id) in one collective and all refuse together
when they differ. A job that a launcher restarts uses load_agreed_checkpoint instead: it
starts fresh when no rank holds a checkpoint, and otherwise takes the newest step that every
rank holds (a crash during a save leaves some ranks' newest one step behind):

    resumed = load_agreed_checkpoint(transport, f"ckpt-rank{rank}.pt")   # None: start fresh
"""

from __future__ import annotations

import hashlib
import os
import warnings
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


#: what a state that torch.load(weights_only=True) cannot read back should hold instead
UNLOADABLE_HINT = (
    "keep tensors, numbers, strings, lists and dicts in it (vars() of an argparse.Namespace, "
    ".item() of a numpy number), or register the type with "
    "torch.serialization.add_safe_globals"
)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `state` (torch.save) to `path` so that a crash never leaves no loadable checkpoint:
    temporary file, fsync, the current checkpoint kept as `<path>.prev`, rename. ValueError,
    with the files left as they were, when the state does not load back with
    torch.load(weights_only=True), as every load here reads it (checked with the storages
    mapped, not read)."""
    path = Path(path)
    temporary = path.with_name(path.name + TEMPORARY_SUFFIX)
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        torch.load(temporary, weights_only=True, mmap=True)
    except Exception as exc:
        temporary.unlink()
        raise ValueError(
            f"this checkpoint state would not load back (torch.load(weights_only=True), which "
            f"resuming uses): {_reason(exc)}. Nothing was written: {UNLOADABLE_HINT}"
        ) from None
    if path.exists():
        os.replace(path, previous_path(path))
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def _reason(exc: Exception) -> str:
    """The line of torch.load's error that names what it could not load (its weights-only
    unpickler's, after paragraphs of advice), else its first line."""
    lines = str(exc).splitlines() or [""]
    named = [line for line in lines if "WeightsUnpickler error:" in line]
    line = named[0].split("WeightsUnpickler error:", 1)[1] if named else lines[0]
    return f"{type(exc).__name__}: {line.strip().rstrip('.')}"


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


def _readable(path: Path) -> tuple[list[tuple[dict[str, Any], Path]], list[str]]:
    """The checkpoints at `path` and `<path>.prev` that load, newest file first, and why each
    file there that does not load failed."""
    held, failed = [], []
    for candidate in (path, previous_path(path)):
        if candidate.exists():
            try:
                held.append((torch.load(candidate, weights_only=True), candidate))
            except Exception as exc:  # a corrupted file: the other one may do
                failed.append(f"{candidate}: {_reason(exc)}")
    return held, failed


def load_agreed_checkpoint(
    transport: Transport, path: str | os.PathLike, name: str = "checkpoint.agree_newest"
) -> tuple[dict[str, Any], Path] | None:
    """Resume where a restart left off: the newest (step, run) that every rank holds, among
    each rank's `path` and `<path>.prev`, loaded on each rank as (state, the file); None on
    every rank when no rank holds a checkpoint (start fresh). One all-gather of four int64.

    A crash during a save can leave a rank's newest checkpoint one step behind the others';
    the ranks then all take the step they share. ValueError on every rank, naming each rank's
    steps, when some ranks hold checkpoints and others none, or when they share no step; and
    when a rank holds checkpoint files none of which loads (the ranks holding them say why),
    rather than starting afresh over them. A file that does not load beside one that does
    warns on its rank."""
    held, failed = _readable(Path(path))
    mine = torch.full((5,), -1, dtype=torch.int64)
    for slot, (state, _) in enumerate(held):
        mine[2 * slot] = int(state["step"])
        mine[2 * slot + 1] = _run_digest(state["run_id"])
    mine[4] = len(failed)
    everyone = [
        p.view(torch.int64).tolist() for p in transport.allgather(mine.view(torch.uint8), name)
    ]
    sets = [{(v[i], v[i + 1]) for i in (0, 2) if v[i] >= 0} for v in everyone]
    steps = [sorted(step for step, _ in s) for s in sets]
    unreadable = [r for r, (v, s) in enumerate(zip(everyone, sets)) if v[4] > 0 and not s]
    if unreadable:
        why = f": {'; '.join(failed)}" if failed and not held else " (those ranks say why)"
        raise ValueError(
            f"ranks {unreadable} hold checkpoint files at {path} that do not load{why}; "
            "resuming would start afresh over them. Move them aside to start afresh, or make "
            f"them loadable: {UNLOADABLE_HINT}"
        )
    if failed:
        warnings.warn(
            f"spardl_grace: a checkpoint file does not load, resuming from the other: "
            f"{'; '.join(failed)}",
            RuntimeWarning,
            stacklevel=2,
        )
    if not any(sets):
        return None
    if not all(sets):
        without = [r for r, s in enumerate(sets) if not s]
        raise ValueError(
            f"ranks {without} hold no checkpoint while others do (steps by rank: "
            f"{steps}): every rank must resume, or none"
        )
    shared = set.intersection(*sets)
    if not shared:
        raise ValueError(
            f"the ranks share no checkpoint step (steps by rank: {steps}, or checkpoints "
            "of different runs): resume them all from one step"
        )
    step, digest = max(shared)
    return next(
        (state, file)
        for state, file in held
        if int(state["step"]) == step and _run_digest(state["run_id"]) == digest
    )


def warn_if_resumed_afresh(optimizer: torch.optim.Optimizer, restored: bool, save: str) -> None:
    """At `optimizer`'s first step that synchronises in this process: a RuntimeWarning when it
    holds state that its steps here do not account for (a state loaded from a checkpoint:
    a step count above theirs, or any state before any step) while the communicator of its
    parameters `restored` none, so the residuals, step counters and warm-ups start afresh.
    The state an optimizer creates in steps of its own (Horovod's broadcast_optimizer_state
    and torch.distributed.checkpoint step on zero gradients to create it) is not taken for a
    loaded one, nor is the state a join gave it from another rank (spardl_grace.join). `save`
    names what the caller should have saved on every rank."""
    from .step_hooks import has_state_from_a_peer, steps_taken

    taken = steps_taken(optimizer)
    if (
        restored
        or has_state_from_a_peer(optimizer)
        or not any(
            _from_elsewhere(optimizer.state.get(p, {}), taken)
            for group in optimizer.param_groups
            for p in group["params"]
        )
    ):
        return
    warnings.warn(
        "spardl_grace: the optimizer holds state from before this process (a resumed run?) "
        "but the compression state was not restored: this rank's residuals, step counters "
        "and warm-ups start afresh ('auto' measures again), and the gradient mass unsent at "
        f"the save is lost. Save {save} on every rank beside the model and optimizer, each "
        "rank into a file of its own, and load each rank's own (see the Checkpoints guide); "
        "if this run did not resume, ignore this",
        RuntimeWarning,
        stacklevel=3,
    )


def _from_elsewhere(state: dict[str, Any], taken: int) -> bool:
    """Whether an optimizer's state of one parameter holds more than `taken` steps made: a
    step count above them, or any state at all before any step."""
    if "step" in state:
        return float(state["step"]) > taken
    return bool(state) and not taken
