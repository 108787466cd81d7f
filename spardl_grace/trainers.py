"""The compression state in a trainer's checkpoint, which one rank writes and every rank reads.

Lightning and Accelerate save a checkpoint from rank 0 alone, but ask every rank for the
states that go into it; and on resume every rank loads the same file. The residuals of a
sparse all-reduce belong to each rank (rank 0's copied to every rank would count its unsent
gradient mass P times), so the state they save must hold every rank's:

    saved = AllRanksState(state)       # state: a CommHookState
    checkpoint["compression"] = saved.state_dict()    # on every rank: one gather
    saved.load_state_dict(checkpoint["compression"])  # each rank takes its own

spardl_grace.lightning and spardl_grace.accelerate use it; the file grows by P times the
residuals' size (rank 0 writes them all).
"""

from __future__ import annotations

from typing import Any

from .broadcast import broadcast_object
from .ddp import CommHookState

FORMAT = "spardl-grace every rank's compression state, 1"


class AllRanksState:
    """Saves and restores the compression state of every rank of a CommHookState through a
    checkpoint that holds one dict for all ranks."""

    def __init__(self, state: CommHookState):
        if not isinstance(state, CommHookState):
            raise TypeError(
                f"state must be a spardl_grace.CommHookState, got {type(state).__name__}"
            )
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state_dict(), in rank order, on every rank (a collective: every rank
        must call it, as the trainers do when they save). Tensors come back on the CPU."""
        transport = self.state.sync.grace.transport
        own = self.state.state_dict()
        ranks = [
            broadcast_object(own if r == transport.rank else None, r, transport, "compression")
            for r in range(transport.size)
        ]
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
                f"{transport.size}: residuals cannot be split or merged across ranks (start "
                "without them, i.e. a fresh state, to change the number of ranks)"
            )
        self.state.load_state_dict(saved["ranks"][transport.rank])
