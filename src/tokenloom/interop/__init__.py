"""Import and export of Hugging Face checkpoints (``transformers`` is an optional extra, imported lazily)."""

from .hf_gpt2 import from_hf_gpt2, gpt2_config_to_hf, hf_config_to_gpt, to_hf_gpt2

__all__ = ["from_hf_gpt2", "gpt2_config_to_hf", "hf_config_to_gpt", "to_hf_gpt2"]
