"""Start every rank from the same model: Horovod's broadcast_parameters for any transport."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .transport import Transport, default_transport


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    transport: Transport | None = None,
) -> None:
    """Overwrite, in place, every tensor of `params` (model.state_dict() or
    model.named_parameters()) with root_rank's. Tensors go in name order, so every rank must
    pass the same names."""
    transport = transport or default_transport()
    items = sorted(params.items() if isinstance(params, Mapping) else params, key=lambda kv: kv[0])
    with torch.no_grad():
        for name, tensor in items:
            received = transport.broadcast(tensor.detach().reshape(-1), root_rank, f"bcast.{name}")
            tensor.copy_(received.view_as(tensor))
