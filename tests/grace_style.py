"""Compressors and memories written against GRACE's published interface only, as a GRACE or
DeepReduce user writes them (written here, not copied from GRACE): they subclass nothing of
this library and have none of its extra methods (bind, next_step, state_dict, stores, ...).

Also scenarios for tests/mp_worker.py ('grace_style.NAME'): the same checks under torchrun."""
from __future__ import annotations

import torch

from spardl_grace.communicators.grace import Allgather, Allreduce, Broadcast


class GraceABC:
    """The shape of GRACE's Compressor base: average, tensors_size_are_same, aggregate = sum."""

    def __init__(self, average=True, tensors_size_are_same=True):
        self.average = average
        self.tensors_size_are_same = tensors_size_are_same

    def aggregate(self, tensors):
        return sum(tensors)


class PlainNone(GraceABC):
    def compress(self, tensor, name):
        return [tensor.reshape(-1)], tensor.shape

    def decompress(self, tensors, ctx):
        return tensors[0].view(ctx)


class PlainTopK(GraceABC):
    def __init__(self, ratio):
        super().__init__()
        self.ratio = ratio

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        k = max(1, int(flat.numel() * self.ratio))
        _, indices = flat.abs().topk(k)
        return [flat[indices], indices], (flat.numel(), tensor.shape)

    def decompress(self, tensors, ctx):
        values, indices = tensors
        numel, shape = ctx
        return torch.zeros(numel, dtype=values.dtype).scatter_(0, indices, values).view(shape)


class DuckNone:
    """Not even GRACE's base: compress and decompress only (no aggregate, average or sizes)."""

    def compress(self, tensor, name):
        return [tensor.reshape(-1).clone()], tensor.shape

    def decompress(self, tensors, ctx):
        return tensors[0].view(ctx)


class DeepReduceShaped(GraceABC):
    """Shaped like DeepReduce's wrappers: subclasses a GRACE-style Compressor, calls the inner
    sparsifier's compress, codes its values (fp16) and indices (gaps, int32), ctx = shape."""

    def __init__(self, inner):
        super().__init__(average=inner.average, tensors_size_are_same=False)
        self.inner = inner

    def compress(self, tensor, name):
        (values, indices), inner_ctx = self.inner.compress(tensor, name)
        order = indices.argsort()
        indices, values = indices[order], values[order]
        gaps = torch.diff(indices, prepend=indices.new_zeros(1)).to(torch.int32)
        return [values.half(), gaps], (inner_ctx, tensor.shape)

    def decompress(self, tensors, ctx):
        values, gaps = tensors
        inner_ctx, shape = ctx
        indices = gaps.to(torch.int64).cumsum(0)
        return self.inner.decompress([values.float(), indices], inner_ctx).view(shape)


class PlainResidual:
    """GRACE's residual memory, from its interface: compensate adds, update keeps what the
    compressor dropped."""

    def __init__(self):
        self.residuals = {}

    def compensate(self, tensor, name):
        return tensor + self.residuals[name] if name in self.residuals else tensor

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        self.residuals[name] = tensor - compressor.decompress(tensor_compressed, ctx)


class PlainNoneMemory:
    def compensate(self, tensor, name):
        return tensor


def pairs():
    """(label, communicator class, compressor, memory, lossless)."""
    return [
        ("allreduce-none", Allreduce, PlainNone(), PlainNoneMemory(), True),
        ("allreduce-duck", Allreduce, DuckNone(), PlainNoneMemory(), True),
        ("allgather-none", Allgather, PlainNone(), PlainResidual(), True),
        ("allgather-topk", Allgather, PlainTopK(0.1), PlainResidual(), False),
        ("allgather-deepreduce", Allgather, DeepReduceShaped(PlainTopK(0.1)), PlainResidual(), False),
        ("broadcast-duck", Broadcast, DuckNone(), PlainNoneMemory(), True),
        ("broadcast-topk", Broadcast, PlainTopK(0.1), PlainResidual(), False),
        ("broadcast-deepreduce", Broadcast, DeepReduceShaped(PlainTopK(0.1)), PlainNoneMemory(), False),
    ]


def gradients(rank: int, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(6, 50, generator=g) for _ in range(steps)]


def run_pairs(transport, grace_constructor: bool = False) -> dict:
    """Every pair for 3 steps: inputs and results per step. grace_constructor: build each
    communicator with GRACE's signature (compressor, memory, world_size), and Broadcast with
    grace_dl.dist's (compressor, memory, world_size, rank)."""
    from spardl_grace.communicators.grace import Broadcast
    out = {}
    for label, cls, compressor, memory, lossless in pairs():
        if grace_constructor and cls is Broadcast:
            comm = cls(compressor, memory, transport.size, transport.rank)
        else:
            comm = cls(compressor, memory, transport.size if grace_constructor else transport)
        out[label] = {"inputs": gradients(transport.rank),
                      "results": [comm.step(g, "w") for g in gradients(transport.rank)],
                      "lossless": lossless}
    return out


def with_grace_constructors(transport) -> dict:
    return run_pairs(transport, grace_constructor=True)


def training(transport, steps: int = 20, ddp_hook: bool = False) -> dict:
    """DistributedOptimizer (or, under torchrun, DDP with comm_hook) with a GRACE user's own
    DeepReduce-shaped top-k and residual memory over allgather."""
    import training_scenarios as ts
    from spardl_grace import (CommHookState, DistributedOptimizer, broadcast_parameters,
                              comm_hook, grace_from_params)
    model = ts.mlp()
    broadcast_parameters(model.state_dict(), 0, transport)
    grc = grace_from_params({"compressor": DeepReduceShaped(PlainTopK(0.1)),
                             "memory": PlainResidual(), "communicator": "allgather"},
                            transport=transport)
    if ddp_hook:
        trained = torch.nn.parallel.DistributedDataParallel(model)
        trained.register_comm_hook(CommHookState(grc, trained), comm_hook)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
    else:
        trained = model
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())
    losses = ts.train(trained, optimizer, transport.rank, transport.size, steps)
    return {"params": ts.flat_params(model), "losses": torch.tensor(losses),
            "residual_names": sorted(grc.memory.residuals)}


def ddp_training(transport) -> dict:
    return training(transport, ddp_hook=True)


def wrong_world_size(transport) -> None:
    Allgather(PlainNone(), PlainNoneMemory(), 5)


def horovod_flavour(transport) -> dict:
    """grace_dl.torch's shape, for Horovod: Allgather(compressor, memory) without a transport,
    and GRACE's send_step / receive_step."""
    out = {}
    for label, cls, compressor, memory, lossless in pairs():
        comm = cls(compressor, memory)
        results = []
        for g in gradients(transport.rank):
            handles, ctx = comm.send_step(g, "w")
            results.append(comm.receive_step(handles, ctx))
        out[label] = {"inputs": gradients(transport.rank), "results": results,
                      "lossless": lossless, "transport": type(comm.transport).__name__}
    return out
