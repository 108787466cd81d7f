"""The one version string of spardl-grace."""

__version__ = "0.1.0"
