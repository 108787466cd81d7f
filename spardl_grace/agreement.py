"""Ranks agree before they exchange, as Horovod's coordinator and DDP's shape check make them.

Before a tensor is synchronised under a name for the first time, and again whenever what a
rank would send under it changes (its size, dtype or device type, the algorithm or any of its
settings), the ranks compare a fingerprint of it in one small collective: an all-gather of an
8-byte digest. When the digests differ, a second all-gather brings every rank's fields, and
every rank raises the same ValueError naming each field that differs and each rank's value.
So a disagreement fails at once and loudly, never after a timeout or as silent divergence.

A change on some ranks only (one rank calls set_density, the others do not) makes only those
ranks agree again; the others are already in the algorithm's own exchange, so that case ends
in the transport's timeout error, not in a wrong result.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .payload import CodecPart, PayloadCodec
from .transport import Transport
from .version import __version__

SCALARS = (bool, int, float, str, type(None))


def settings_of(obj: Any, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The public settings of a compressor, memory, codec or communicator: its class, its
    public attributes that are plain values, and the settings of the payload codecs it holds
    (a DeepReduce codec's index and value codecs too). Private attributes (a leading
    underscore: state, counters, buffers) and `exclude` (values that differ between ranks by
    design) are left out."""
    out: dict[str, Any] = {"class": type(obj).__name__}
    for key, value in sorted(getattr(obj, "__dict__", {}).items()):
        if key.startswith("_") or key in exclude:
            continue
        if isinstance(value, SCALARS):
            out[key] = value
        elif _is_codec(value):
            out[key] = settings_of(value)
    return out


def _is_codec(value: Any) -> bool:
    return isinstance(value, (PayloadCodec, CodecPart))


def digest(fields: dict[str, Any]) -> int:
    """A signed 64-bit digest of `fields`, the same in every process."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def _flat(fields: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys ('communicator.density'), so a message names the field."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def agree(transport: Transport, what: str, fields: dict[str, Any]) -> None:
    """Return when every rank passed the same `fields` for `what`; otherwise raise ValueError
    on every rank, naming each differing field and every rank's value. Every rank must call it
    at the same point. Costs one all-gather of 8 bytes per rank (two collectives when the
    ranks disagree); nothing with one rank."""
    if transport.size == 1:
        return
    fields = {"library": __version__, "world_size": transport.size, **fields}
    mine = torch.tensor([digest(fields)], dtype=torch.int64)
    digests = transport.allgather(mine, f"agree.{what}")
    if all(int(d[0]) == int(mine[0]) for d in digests):
        return
    blob = torch.tensor(list(json.dumps(fields, default=str).encode()), dtype=torch.uint8)
    every = [
        _flat(json.loads(bytes(b.tolist()).decode()))
        for b in transport.allgather(blob, f"agree.{what}.fields")
    ]
    keys = list(dict.fromkeys(k for e in every for k in e))
    differ = [k for k in keys if len({json.dumps(e.get(k)) for e in every}) > 1]
    ranks = [transport.global_rank(r) for r in range(len(every))]
    detail = "; ".join(
        f"{k}: " + ", ".join(f"rank {g} {json.dumps(e.get(k))}" for g, e in zip(ranks, every))
        for k in differ
    )
    raise ValueError(
        f"the ranks disagree on {what}, so they cannot synchronise it "
        f"(every rank must pass the same): {detail}"
    )


FOREIGN_STATE = (
    "residuals belong to the rank that saved them: another rank's here would count its unsent "
    "gradient twice and lose this rank's. Save the compression state on every rank, into a "
    "file of its own (hook_state.state_dict(), optimizer.compression_state_dict()), and load "
    "each rank's own; or load it on no rank, and every rank starts afresh"
)
OWN_STATE_FIELD = "compression_state_saved_by_this_rank"


def agree_holding_own_state(
    transport: Transport, what: str, fields: dict[str, Any], saved_by: int | None
) -> None:
    """agree() on `fields` and on whether this rank's compression state, if it restored one,
    was saved by this rank (`saved_by`: the saving rank, None when nothing was restored or the
    checkpoint predates the record): ValueError on every rank at once when any rank holds
    another rank's state, rather than training on with one rank's residuals counted twice."""
    own = saved_by is None or saved_by == transport.rank
    try:
        agree(transport, what, {**fields, OWN_STATE_FIELD: own})
    except ValueError as exc:
        if OWN_STATE_FIELD not in str(exc):
            raise
        raise ValueError(
            f"{exc}. Some ranks restored another rank's compression state: {FOREIGN_STATE}"
        ) from exc
    if saved_by is not None and not own:
        raise ValueError(
            f"rank {transport.global_rank(transport.rank)} restored the compression state "
            f"that rank {transport.global_rank(saved_by)} saved: {FOREIGN_STATE}"
        )
