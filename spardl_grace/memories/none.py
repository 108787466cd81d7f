"""'none': no error feedback; whatever compression drops is lost."""

from ..api import Memory


class NoneMemory(Memory):
    """GRACE's 'none' memory: remembers nothing."""

    def compensate(self, tensor, name):
        return tensor

    def store_residual(self, name, residual, result=None):
        pass
