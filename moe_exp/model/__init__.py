"""The model alone: attention, MoE layer, transformer."""
from .moe import MoE, grouped_mm_supported
from .transformer import Output, Transformer, build_model

__all__ = ["MoE", "Output", "Transformer", "build_model", "grouped_mm_supported"]
