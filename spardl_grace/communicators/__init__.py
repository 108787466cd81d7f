"""Communicators: GRACE's (allreduce, allgather, broadcast) and the sparse all-reduces."""
from .grace import Allgather, Allreduce, Broadcast
from .spardl import SparDL

__all__ = ["Allreduce", "Allgather", "Broadcast", "SparDL"]
