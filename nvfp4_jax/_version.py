"""The package version (read by __init__ and by what writes files: checkpoints, exports)."""

__version__ = "0.2.0"
