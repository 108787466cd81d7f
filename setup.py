"""For tools that still run setup.py (python setup.py develop, older pip and IDEs): everything
is declared in pyproject.toml (PEP 621), which setuptools reads from here too."""
from setuptools import setup

setup()
