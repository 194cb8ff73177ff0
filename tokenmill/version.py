"""The tokenmill version (one place; read by packaging and `tokenmill --version`)."""

__version__ = "0.1.0"
