"""'powersgd' (Vogels et al.): low-rank (rank r) approximation M ~ P Q^T of each >= 2-D gradient
reshaped to (rows, -1), with one power iteration per step warm-started from the previous Q.
P and Q are averaged with all-reduce inside compress, so it needs communicator 'allreduce'
and memory 'powersgd' (error feedback). 1-D tensors are sent uncompressed. The first Q is
drawn from a generator shared by every rank, so all ranks start from the same subspace
(GRACE re-draws it from the unseeded global RNG every step). As in the paper, the error kept by
memory 'powersgd' is against this worker's own approximation P Q_local^T."""

import torch

from ..api import Compressor
from ..utils.seeding import generator


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s columns (reduced QR)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class PowerSGDCompressor(Compressor):
    """GRACE's 'powersgd': a rank-`rank` approximation by one warm-started power iteration
    (module docstring); needs communicator 'allreduce' and memory 'powersgd'."""

    def __init__(self, rank: int = 1, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        self.compress_rank = rank
        self.seed = seed
        self.q_memory: dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        #: bytes this compress all-reduced (the factors P and Q; the communicator counts them)
        self.allreduced_bytes = 0
        if tensor.dim() < 2:
            return [tensor], None
        matrix = tensor.reshape(tensor.shape[0], -1).float()
        rows, cols = matrix.shape
        r = min(rows, cols, self.compress_rank)
        q = self.q_memory.get(name)
        if q is None or q.shape != (cols, r):
            g = generator("cpu", "powersgd", self.seed, name)
            q = torch.randn(cols, r, generator=g).to(matrix.device)
        transport = self.bound_transport
        world = transport.size
        p = transport.allreduce(matrix @ q, f"powersgd.{name}.p") / world
        p = orthogonalize(p)
        q_local = matrix.t() @ p
        q = transport.allreduce(q_local, f"powersgd.{name}.q") / world
        self.allreduced_bytes = (p.numel() + q.numel()) * 4
        self.q_memory[name] = q
        return [], (p, q, q_local, tensor.shape, tensor.dtype)

    def decompress(self, tensors, ctx):
        if ctx is None:
            return tensors[0]
        p, q, _, shape, dtype = ctx
        return (p @ q.t()).to(dtype).view(shape)

    @staticmethod
    def local_approximation(ctx) -> torch.Tensor:
        """This worker's own rank-r approximation P Q_local^T (what error feedback subtracts)."""
        p, _, q_local, shape, dtype = ctx
        return (p @ q_local.t()).to(dtype).view(shape)

    def state_dict(self):
        return {**super().state_dict(), "q_memory": dict(self.q_memory)}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.q_memory = dict(state.get("q_memory", {}))
