"""The model config of a token task: the recipe's model section with the tokenizer's vocabulary."""

from __future__ import annotations

from typing import Any

from ..config import check
from ..data.tokenizers import Tokenizer
from ..models.factory import model_config_from_dict


def config_for_tokenizer(model_section: dict[str, Any], tokenizer: Tokenizer, seq_len: int | None = None,
                         length_setting: str = "train.seq_len") -> tuple[str, Any, dict[str, Any], int]:
    """(family, config, section, seq_len): the model section with ``vocab_size`` from the tokenizer where unset
    (imported models may pad the vocabulary; smaller than the tokenizer's is a one-line ConfigError), and the
    sequence length (``seq_len``, else the model's ``max_seq_len``; longer than it is an error naming
    ``length_setting``)."""
    vocab = model_section.get("vocab_size") or tokenizer.vocab_size
    check(vocab >= tokenizer.vocab_size,
          f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
    section = {**model_section, "vocab_size": vocab}
    family, config = model_config_from_dict(section)
    max_len = getattr(config, "max_seq_len", None)
    seq_len = seq_len or max_len
    check(max_len is None or seq_len <= max_len, f"{length_setting}={seq_len} exceeds model.max_seq_len={max_len}")
    return family, config, section, seq_len
