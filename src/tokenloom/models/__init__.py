"""Models: thin compositions of ``tokenloom.nn`` parts."""

from .gpt import GPT, GPT_PRESETS, GPTConfig
from .nat import NATConfig, NonAutoregressiveTransformer
from .registry import MODELS
from .reward import REWARD_FAMILIES, GPTReward, SequenceScorer
from .rnn import RNNLM, RNNConfig
from .rnn_seq2seq import RNNEncoderDecoder, RNNSeq2SeqCache, RNNSeq2SeqConfig, RNNSeq2SeqDecoder
from .semi_ar import SemiARConfig, SemiAutoregressiveTransformer
from .seq2seq import EncoderDecoder, Seq2SeqCache, Seq2SeqConfig, Seq2SeqDecoder
from .swin import SWIN_PRESETS, Swin, SwinConfig
from .universal import PonderOutput, UniversalConfig, UniversalTransformer
from .universal_seq2seq import EncoderPonder, UniversalEncoderDecoder, UniversalSeq2SeqConfig
from .vit import VIT_PRESETS, ViT, ViTConfig

__all__ = ["GPT", "GPT_PRESETS", "EncoderDecoder", "GPTConfig", "GPTReward", "MODELS", "REWARD_FAMILIES",
           "SequenceScorer", "NATConfig", "NonAutoregressiveTransformer",
           "RNNLM", "RNNConfig", "RNNEncoderDecoder", "RNNSeq2SeqCache", "RNNSeq2SeqConfig",
           "RNNSeq2SeqDecoder", "SWIN_PRESETS", "SemiARConfig", "SemiAutoregressiveTransformer", "Seq2SeqCache",
           "Seq2SeqConfig", "Seq2SeqDecoder", "Swin", "SwinConfig", "PonderOutput", "UniversalConfig",
           "UniversalTransformer", "EncoderPonder", "UniversalEncoderDecoder", "UniversalSeq2SeqConfig", "VIT_PRESETS",
           "ViT", "ViTConfig"]
