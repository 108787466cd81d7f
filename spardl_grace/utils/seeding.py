"""Deterministic random generators shared across ranks (or private to one rank).

Python's hash() is salted per process, so it can never seed anything that ranks must agree on;
these seeds come from a cryptographic hash of the parts instead.
"""

from __future__ import annotations

import hashlib

import torch


def stable_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on the string forms of `parts`."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(device: torch.device | str, *parts: object) -> torch.Generator:
    """A torch.Generator on `device` seeded from `parts`: the same parts give the same stream
    on every rank. Include the rank among the parts for a stream private to one rank."""
    g = torch.Generator(device=device)
    g.manual_seed(stable_seed(*parts))
    return g
