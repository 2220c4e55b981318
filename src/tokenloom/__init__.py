"""tokenloom: the Transformer family, real, fast and practical on an ordinary machine."""

from .errors import TokenloomError
from .generation import GenerationConfig, generate, stream
from .models import GPT, EncoderDecoder, GPTConfig, Seq2SeqConfig, Swin, SwinConfig, ViT, ViTConfig
from .tasks.translation import translate

__version__ = "0.1.0"

__all__ = ["GPT", "EncoderDecoder", "GPTConfig", "GenerationConfig", "Seq2SeqConfig", "Swin", "SwinConfig",
           "TokenloomError", "ViT", "ViTConfig", "__version__", "generate", "stream", "translate"]
