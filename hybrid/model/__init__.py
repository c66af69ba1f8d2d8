"""The DeepSeek-V3 model family (DeepSeek-V3/R1/V3.1, Kimi-K2) as device-agnostic torch modules."""
from hybrid.model.args import ModelArgs
from hybrid.model.transformer import Transformer

__all__ = ["ModelArgs", "Transformer"]
