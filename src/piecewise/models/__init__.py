"""Reference models: plain PyTorch, with attention as a splitting op (examples and benchmarks)."""

from .llama import LlamaConfig, TinyLlama, example

__all__ = ["LlamaConfig", "TinyLlama", "example"]
