"""Seeing inside a model: attention capture on any backend, checks and head diagnostics, attention rollout,
plots (matplotlib, imported lazily) and a self-contained HTML run report."""

from .capture import AttentionCapture, attention_layers, capture_attention, select_layers
from .diagnostics import causal_check, head_diagnostics
from .rollout import attention_rollout

__all__ = ["AttentionCapture", "attention_layers", "attention_rollout", "capture_attention", "causal_check",
           "head_diagnostics", "select_layers"]
