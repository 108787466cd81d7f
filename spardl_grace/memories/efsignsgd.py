"""'efsignsgd': error feedback for EF-signSGD, A = R + lr * g, R' = A - decompress(sent)."""

from .residual import ResidualMemory


class EFSignSGDMemory(ResidualMemory):
    """GRACE's 'efsignsgd' memory: error feedback on lr * g for the efsignsgd compressor."""

    def __init__(self, lr: float):
        super().__init__(beta=1.0, gamma=lr)
        self.learning_rate = lr
