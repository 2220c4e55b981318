"""The linear-time backends of :mod:`tokenloom.nn.linear_attention`: ``performer`` and ``linformer`` (classes built
per layer, their options in ``Options`` dataclasses)."""

from ..linear_attention import LinformerAttention, PerformerAttention
from . import ATTENTION_BACKENDS

ATTENTION_BACKENDS.register("performer")(PerformerAttention)
ATTENTION_BACKENDS.register("linformer")(LinformerAttention)
