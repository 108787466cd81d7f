"""'powersgd': error feedback for PowerSGD against this worker's own low-rank approximation
(R' = A - P Q_local^T); 1-D tensors are sent exactly and keep no residual."""

from .residual import ResidualMemory


class PowerSGDMemory(ResidualMemory):
    """GRACE's 'powersgd' memory: error feedback against this worker's own approximation."""

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        if ctx is None:
            return
        self.residuals[name] = tensor - compressor.local_approximation(ctx)
