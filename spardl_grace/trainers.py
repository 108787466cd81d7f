"""The compression state in a trainer's checkpoint.

The residuals of a sparse all-reduce belong to each rank (rank 0's copied to every rank would
count its unsent gradient mass P times), so a checkpoint must keep every rank's. Two forms:

- PerRankFiles (Accelerate, whose save_state names the folder): each rank writes its own
  state into the checkpoint folder, no collective, one rank's state in memory; saving from the
  main process alone writes rank 0's only, and resuming from such a checkpoint then raises on
  every rank, naming the ranks whose state is missing.
- AllRanksState (Lightning, whose checkpoint is one dict that rank 0 writes): every rank sends
  its state to rank 0 alone, which holds the P states while Lightning writes them (the other
  ranks hold their own); every rank takes its part back on resume.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .ddp import CommHookState

FORMAT = "spardl-grace every rank's compression state, 1"


class AllRanksState:
    """Saves and restores the compression state of every rank of a CommHookState through a
    checkpoint that holds one dict for all ranks. `without_it`: how to resume that checkpoint
    without the state (the error for another number of ranks says it)."""

    def __init__(self, state: CommHookState, without_it: str):
        if not isinstance(state, CommHookState):
            raise TypeError(
                f"state must be a spardl_grace.CommHookState, got {type(state).__name__}"
            )
        self.state = state
        self.without_it = without_it

    def state_dict(self) -> dict[str, Any]:
        """On rank 0, every rank's state_dict() in rank order; on the others, their own alone
        (the writer is rank 0). A collective: every rank must call it, as Lightning does when
        it saves. Tensors come back on the CPU."""
        transport = self.state.sync.grace.transport
        own = self.state.state_dict()
        ranks: list[Any] = [None] * transport.size
        ranks[transport.rank] = own
        for r in range(1, transport.size):
            sent = own if transport.rank == r else None
            received = send_object(sent, r, 0, transport, f"compression.{r}")
            if transport.rank == 0:
                ranks[r] = received
        return {"format": FORMAT, "world_size": transport.size, "ranks": ranks}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore this rank's part of a state_dict(); ValueError if it is not one, or was
        written by a run with another number of ranks."""
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(
                "not a compression state saved by spardl_grace.trainers.AllRanksState "
                f"(expected format {FORMAT!r})"
            )
        transport = self.state.sync.grace.transport
        if saved["world_size"] != transport.size:
            raise ValueError(
                f"the compression state was saved by {saved['world_size']} ranks; this run has "
                f"{transport.size}: residuals cannot be split or merged across ranks. To "
                f"change the number of ranks, resume without them: {self.without_it}, and the "
                "model and optimizer resume with fresh residuals"
            )
        self.state.load_state_dict(saved["ranks"][transport.rank])


def send_object(obj: Any, src: int, dst: int, transport: Any, name: str) -> Any:
    """`obj` from rank `src` to rank `dst` (torch.save'd; tensors come back on the CPU);
    every rank calls it, and ranks other than the two take no part beyond the call."""
    import io

    if transport.rank not in (src, dst):
        return None
    if transport.rank == src:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        transport.sendrecv(data, dst, dst, name)  # dst sends nothing back
        return obj
    empty = torch.empty(0, dtype=torch.uint8)
    received = transport.sendrecv(empty, src, src, name)
    return torch.load(io.BytesIO(received.cpu().numpy().tobytes()), weights_only=True)


class PerRankFiles:
    """Each rank's compression state in a file of its own in a checkpoint folder:
    FOLDER/spardl_compression_rank{r}.pt. save() is no collective; load() checks, in one
    small collective, that every rank found its file."""

    def __init__(self, state: CommHookState, stem: str = "spardl_compression"):
        if not isinstance(state, CommHookState):
            raise TypeError(
                f"state must be a spardl_grace.CommHookState, got {type(state).__name__}"
            )
        self.state = state
        self.stem = stem

    def path(self, folder: str | os.PathLike, rank: int) -> Path:
        """Where rank `rank`'s state lies in the checkpoint folder `folder`."""
        return Path(folder) / f"{self.stem}_rank{rank}.pt"

    def save(self, folder: str | os.PathLike) -> Path:
        """Write this rank's state (atomically: a crash mid-save leaves the previous file)."""
        transport = self.state.sync.grace.transport
        path = self.path(folder, transport.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        torch.save(
            {
                "format": FORMAT,
                "world_size": transport.size,
                "rank": transport.rank,
                "state": self.state.state_dict(),
            },
            partial,
        )
        os.replace(partial, path)
        return path

    def load(self, folder: str | os.PathLike) -> None:
        """Restore this rank's state from `folder`. Every rank must call it. When some ranks
        find no file (the checkpoint was saved from the main process alone) every rank raises
        ValueError naming them; when none does (a checkpoint written without the hook) every
        rank warns and keeps a fresh state; a checkpoint of another number of ranks raises."""
        transport = self.state.sync.grace.transport
        path = self.path(folder, transport.rank)
        found = transport.allgather(torch.tensor([int(path.exists())]), "compression.found")
        missing = [r for r, f in enumerate(found) if not int(f.item())]
        if len(missing) == transport.size:
            if not _load_legacy(self.state, Path(folder)):
                self.state.resume_checked = True
                warnings.warn(
                    f"spardl_grace: {folder} holds no compression state; the residuals start "
                    "afresh (a checkpoint written without the hook, or by another trainer)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        if missing:
            raise ValueError(
                f"{folder} holds the compression state of some ranks only (missing: ranks "
                f"{missing}): it was saved from one process (e.g. save_state under `if "
                "accelerator.is_main_process`). Save from every rank: each writes its own "
                "state, and Accelerate still writes the model once. To resume anyway with "
                f"fresh residuals on every rank, delete {self.stem}_rank*.pt from the folder"
            )
        saved = torch.load(path, weights_only=True)
        if saved.get("format") != FORMAT or saved.get("world_size") != transport.size:
            raise ValueError(
                f"{path} was saved by {saved.get('world_size')} ranks; this run has "
                f"{transport.size}: residuals cannot be split or merged across ranks (delete "
                f"{self.stem}_rank*.pt to start with fresh residuals)"
            )
        self.state.load_state_dict(saved["state"])


def _load_legacy(state: CommHookState, folder: Path) -> bool:
    """A checkpoint from before PerRankFiles: Accelerate's custom_checkpoint_*.pkl holding an
    AllRanksState dict (every rank's state). Loads this rank's part; False if there is none."""
    for candidate in sorted(folder.glob("custom_checkpoint_*.pkl")):
        try:
            saved = torch.load(candidate, weights_only=True)
        except Exception:  # another object's state, in any format
            continue
        if isinstance(saved, dict) and saved.get("format") == FORMAT:
            AllRanksState(state, f"delete {candidate.name}").load_state_dict(saved)
            return True
    return False
