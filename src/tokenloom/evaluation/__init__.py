"""Evaluation: corpus metrics of generated text (BLEU, chrF, ROUGE, exact match) and classification
metrics (accuracy, top-5, per-class accuracy, confusion matrix), on a 0-100 scale."""

from .classification import (
    ClassificationReport,
    classification_report,
    confusion_matrix,
    expected_calibration_error,
    format_report,
    plot_confusion_matrix,
    topk_accuracy,
)
from .metrics import METRICS, MetricResult, compute_metrics, format_metrics

__all__ = ["METRICS", "ClassificationReport", "MetricResult", "classification_report", "compute_metrics",
           "confusion_matrix", "expected_calibration_error", "format_metrics", "format_report",
           "plot_confusion_matrix", "topk_accuracy"]
