"""Communicators: GRACE's (allreduce, allgather, broadcast), SparDL, and the peer sparse
all-reduces it is measured against (dense, topka, gaussiank, topkdsa, gtopk, oktopk)."""

from .dense import Dense
from .grace import Allgather, Allreduce, Broadcast
from .gtopk import GTopk
from .oktopk import OkTopk
from .spardl import SparDL
from .topka import GaussianK, TopkA
from .topkdsa import TopkDSA

__all__ = [
    "Allgather",
    "Allreduce",
    "Broadcast",
    "Dense",
    "GTopk",
    "GaussianK",
    "OkTopk",
    "SparDL",
    "TopkA",
    "TopkDSA",
]
