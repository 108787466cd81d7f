"""The one version string of spardl-grace."""

__version__ = "0.2.0"
