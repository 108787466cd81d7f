"""'none': sends the tensor unchanged."""

from ..api import Compressor


class NoneCompressor(Compressor):
    """GRACE's 'none': the tensor itself."""

    def compress(self, tensor, name):
        return [tensor], None

    def decompress(self, tensors, ctx):
        return tensors[0]
