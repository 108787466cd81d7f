"""Models for the experiments."""
from .small import FashionCNN

__all__ = ["FashionCNN"]
