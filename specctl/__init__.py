"""specctl: train, export and benchmark parallel drafters for speculative decoding."""

__version__ = "0.1.0"
