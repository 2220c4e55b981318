"""Hugging Face checkpoints in and out, with exact parity (see :mod:`tokenloom.interop.hf`).

``from_hf(model_or_dir)`` / ``to_hf(model)`` convert models in memory; ``import_hf(dir, out)`` /
``export_hf(model_or_checkpoint, out)`` convert directories and need no ``transformers``. Families:
GPT-2 (``GPT2LMHeadModel``), Llama-style models (``LlamaForCausalLM``, ``MistralForCausalLM``), Marian
(``MarianMTModel``, into the encoder-decoder), ViT (``ViTForImageClassification``) and Swin
(``SwinForImageClassification``). A model is a directory, or a hub name (``gpt2``, ``org/name``) already in the
local Hugging Face cache (:func:`resolve_hf_model`; nothing is downloaded).
"""

from . import gpt2, llama, marian, swin, vit  # noqa: F401  (register the converters)
from .hf import (
    HF_CONVERTERS,
    OPS,
    HFConverter,
    Rule,
    converter_for,
    export_hf,
    find_converter,
    from_hf,
    hf_to_ours,
    import_hf,
    ours_to_hf,
    per_layer,
    read_hf_config,
    read_hf_tokenizer,
    read_hf_weights,
    rule,
    to_hf,
)
from .hub import hub_cache_dir, resolve_hf_model

__all__ = [
    "HF_CONVERTERS", "OPS", "HFConverter", "Rule", "converter_for", "export_hf", "find_converter", "from_hf",
    "hf_to_ours", "import_hf", "ours_to_hf", "per_layer", "read_hf_config", "read_hf_tokenizer", "read_hf_weights",
    "rule", "to_hf", "hub_cache_dir", "resolve_hf_model",
]
