"""Evaluation: corpus metrics of generated text (BLEU, chrF, ROUGE, exact match) and classification
metrics (accuracy, top-5, per-class accuracy, confusion matrix), on a 0-100 scale; multiple-choice scoring by
continuation log-likelihood as lm-evaluation-harness does it (:mod:`.choices`)."""

from .choices import choice_accuracy, score_choices
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

__all__ = ["METRICS", "ClassificationReport", "MetricResult", "choice_accuracy", "classification_report",
           "compute_metrics", "confusion_matrix", "expected_calibration_error", "format_metrics", "format_report",
           "plot_confusion_matrix", "score_choices", "topk_accuracy"]
