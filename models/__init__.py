"""PyTorch reference decoders with the arborspec engine contract, and their loaders."""

from .config import ModelConfig
from .gemma3 import Gemma3Decoder
from .gpt2 import GPT2Decoder
from .llama import LlamaDecoder

DECODERS = {"llama": LlamaDecoder, "gemma3": Gemma3Decoder, "gpt2": GPT2Decoder}


def build_model(cfg: ModelConfig):
    """The contract nn.Module for a config (llama, gemma3 or gpt2 family), randomly initialised."""
    return DECODERS[cfg.family](cfg)


__all__ = ["ModelConfig", "LlamaDecoder", "Gemma3Decoder", "GPT2Decoder", "build_model"]
