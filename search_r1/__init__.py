"""Search-R1: reinforcement learning for language models that reason and search."""
__version__ = "0.1.0"
