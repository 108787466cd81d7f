"""DeepReduce's GRACE compressor wrappers and deepreduce_from_params, as in DeepReduce's README:

    grc = grace_from_params(params)
    grc.compressor = DeepReduce(grc.compressor, params)     # or ValueCompressor / IndexCompressor

or in one call, grc = deepreduce_from_params(params). The wrapped compressor must be a
sparsifier that sends [values, indices] (topk, threshold, dgc); the wrapper sends one coded
uint8 tensor instead, and decompress rebuilds the dense tensor from it. Because the values are
re-read from the dense tensor at the positions the receiver decodes, and decompress returns
what the receiver gets, the residual memory keeps exactly what coding dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spardl_grace.api import Communicator, Compressor

from .codec import DeepReduceCodec, codec_for_mode

SPARSIFIERS = ("TopKCompressor", "ThresholdCompressor", "DgcCompressor")


class _Wrapper(Compressor):
    mode = "both"

    def __init__(self, sparsifier: Compressor, params: dict[str, Any] | None = None):
        super().__init__(average=sparsifier.average, tensors_size_are_same=False)
        if type(sparsifier).__name__ not in SPARSIFIERS:
            raise ValueError(
                f"DeepReduce wraps a sparsifier sending [values, indices] "
                f"(compressor topk, threshold or dgc), got {type(sparsifier).__name__}"
            )
        self.sparsifier = sparsifier
        self.codec: DeepReduceCodec = codec_for_mode(params or {}, self.mode)

    def bind(self, transport) -> None:
        super().bind(transport)
        self.sparsifier.bind(transport)

    def compress(self, tensor: torch.Tensor, name: str):
        (_, indices), ctx = self.sparsifier.compress(tensor, name)
        flat = tensor.reshape(-1)
        key = f"{name}.{self.next_step(name)}"
        data = self.codec.encode_bytes(flat, indices, key)
        return [data], (ctx, key, flat.dtype)

    def decompress(self, tensors: Sequence[torch.Tensor], ctx) -> torch.Tensor:
        inner_ctx, key, dtype = ctx
        numel = inner_ctx[0]
        positions, values = self.codec.decode(tensors[0], numel, dtype, tensors[0].device, key)
        return self.sparsifier.decompress([values, positions], inner_ctx)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sparsifier": self.sparsifier.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sparsifier.load_state_dict(state.get("sparsifier", {}))


class ValueCompressor(_Wrapper):
    """Codes the values with params['value'] (default polyfit); indices travel raw."""

    mode = "value"


class IndexCompressor(_Wrapper):
    """Codes the indices with params['index'] (default bloom); values travel raw."""

    mode = "index"


class DeepReduce(_Wrapper):
    """Codes both: params['index'] (default bloom) and params['value'] (default polyfit)."""

    mode = "both"


WRAPPERS = {"value": ValueCompressor, "index": IndexCompressor, "both": DeepReduce}


def deepreduce_from_params(params: dict[str, Any], transport=None):
    """grace_from_params(params) with the compressor wrapped as params['deepreduce'] says (for
    GRACE communicators) or the codec installed (sparse all-reduces do that themselves)."""
    from spardl_grace.registry import grace_from_params

    grc = grace_from_params(params, transport=transport)
    mode = params.get("deepreduce")
    if mode and isinstance(grc, Communicator):
        grc.compressor = WRAPPERS[mode](grc.compressor, params)
        grc.compressor.bind(grc.transport)
    return grc
