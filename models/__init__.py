"""PyTorch reference decoders with the arborspec engine contract, and their loaders."""

from .config import ModelConfig
from .gpt2 import GPT2Decoder
from .llama import LlamaDecoder


def build_model(cfg: ModelConfig):
    """The contract nn.Module for a config (llama or gpt2 family), randomly initialised."""
    return LlamaDecoder(cfg) if cfg.family == "llama" else GPT2Decoder(cfg)


__all__ = ["ModelConfig", "LlamaDecoder", "GPT2Decoder", "build_model"]
