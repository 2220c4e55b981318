"""Evaluation of generated text: corpus metrics (BLEU, chrF, ROUGE, exact match) on a 0-100 scale."""

from .metrics import METRICS, MetricResult, compute_metrics, format_metrics

__all__ = ["METRICS", "MetricResult", "compute_metrics", "format_metrics"]
