"""'signum': signSGD on a momentum m <- (1 - momentum) g + momentum m kept per name; sends the
sign of m as uint8, aggregates by majority vote (average=False)."""

import torch

from ..api import Compressor
from .signsgd import SignSGDCompressor, majority_vote


class SignumCompressor(SignSGDCompressor):
    """GRACE's 'signum': the sign of a per-name momentum, aggregated by majority vote."""

    RANK_LOCAL_STATE = ("momentums",)

    def __init__(self, momentum: float):
        super().__init__()
        self.momentum = momentum
        self.momentums: dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        if name in self.momentums:
            tensor = (1.0 - self.momentum) * tensor + self.momentum * self.momentums[name]
        self.momentums[name] = tensor.detach().clone()
        return super().compress(tensor, name)

    def aggregate(self, tensors):
        return majority_vote(tensors)

    def state_dict(self):
        return {**Compressor.state_dict(self), "momentums": dict(self.momentums)}

    def load_state_dict(self, state):
        Compressor.load_state_dict(self, state)
        self.momentums = dict(state.get("momentums", {}))
