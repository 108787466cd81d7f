"""'dgc': momentum correction with momentum factor masking (Lin et al.). Keeps a velocity
u <- momentum * u + g and an accumulation v <- v + u per name, compresses v, and zeroes both at
the sent positions. With gradient_clipping, g is first clipped to the square root of the mean
over workers of ||g||^2 (one all-reduce of a scalar), as GRACE does."""

import torch

from ..api import Memory


class DgcMemory(Memory):
    """GRACE's 'dgc' memory: momentum correction and momentum factor masking (module docstring)."""

    def __init__(self, momentum: float, gradient_clipping: bool):
        super().__init__()
        self.momentum = momentum
        self.gradient_clipping = gradient_clipping
        self.velocities: dict[str, torch.Tensor] = {}
        self.accumulations: dict[str, torch.Tensor] = {}

    def compensate(self, tensor, name):
        if self.gradient_clipping:
            sq = (tensor.float() ** 2).sum().reshape(1)
            transport = self.bound_transport
            mean_sq = transport.allreduce(sq, f"dgc_clip.{name}") / transport.size
            bound = mean_sq.sqrt().to(tensor.dtype)
            tensor = torch.maximum(torch.minimum(tensor, bound), -bound)
        velocity = self.velocities.get(name)
        velocity = tensor.clone() if velocity is None else self.momentum * velocity + tensor
        self.velocities[name] = velocity
        accumulation = self.accumulations.get(name)
        accumulation = velocity.clone() if accumulation is None else accumulation + velocity
        self.accumulations[name] = accumulation
        return accumulation

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        keep = tensor_compressed[1].new_ones(tensor.numel(), dtype=torch.bool)
        keep[tensor_compressed[1].long()] = False
        keep = keep.view(tensor.shape)
        self.velocities[name] = self.velocities[name] * keep
        self.accumulations[name] = self.accumulations[name] * keep

    def stores(self):
        return [self.velocities, self.accumulations]

    def state_dict(self):
        return {"velocities": dict(self.velocities), "accumulations": dict(self.accumulations)}

    def load_state_dict(self, state):
        self.velocities = dict(state.get("velocities", {}))
        self.accumulations = dict(state.get("accumulations", {}))
