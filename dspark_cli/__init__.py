"""dspark: train DSpark speculative-decoding drafters end to end."""

__version__ = "0.1.0"
