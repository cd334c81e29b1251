"""dashrun's version: the one string ``setup.cfg`` (``attr:``) and the three commands' ``--version`` read.

A leaf module, so that dash-memd and dash-agent tell their version without importing the rest of the package.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
