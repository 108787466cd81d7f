"""'residual': classic error feedback, A = beta * R + gamma * g and R' = A - decompress(sent).
'global_residual': the same store fed by a sparse all-reduce with the residual it computed
after communication (for SparDL, Global Residual Collection: what was dropped anywhere on the
way, including other workers' contributions this worker absorbed).

Residuals are kept in float32 (or float64) even for half-precision gradients, so small
corrections are not rounded away; compensate returns the wider dtype."""
from __future__ import annotations

import torch

from ..api import Memory


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class ResidualMemory(Memory):
    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        super().__init__()
        self.beta = beta
        self.gamma = gamma
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, tensor, name):
        tensor = _wide(tensor)
        residual = self.residuals.get(name)
        if residual is None:
            return tensor if self.gamma == 1.0 else self.gamma * tensor
        if residual.shape != tensor.shape:
            raise ValueError(f"residual for '{name}' has shape {tuple(residual.shape)}, the gradient "
                             f"{tuple(tensor.shape)}: one name must always carry the same tensor")
        if self.beta == 1.0 and self.gamma == 1.0:
            return residual + tensor  # one pass over memory instead of three
        return self.beta * residual + self.gamma * tensor

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        self.residuals[name] = tensor - compressor.decompress(tensor_compressed, ctx)

    def store_residual(self, name, residual):
        self.residuals[name] = residual

    def stores(self):
        return [self.residuals]

    def state_dict(self):
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state):
        self.residuals = dict(state.get("residuals", {}))


class GlobalResidualMemory(ResidualMemory):
    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        raise ValueError("memory 'global_residual' collects residuals after communication and works "
                         "with the sparse all-reduce communicators (spardl, topka, topkdsa, gtopk, "
                         "oktopk); use memory 'residual' with communicator allgather/allreduce")
