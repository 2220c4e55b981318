"""Classification metrics from logits, computed with torch: accuracy, top-k accuracy, per-class accuracy
and the confusion matrix; a PNG of the matrix (matplotlib, imported only when drawing).

Percentages are on the 0-100 scale of the text metrics::

    report = classification_report(logits, labels, classes=["0", "1", ...])   # logits (N, K), labels (N,)
    report.accuracy, report.top5            # 99.1, 99.98
    report.per_class                        # [99.7, 99.6, ...]: accuracy (recall) of each true class
    report.confusion                        # (K, K) int64: rows = true class, columns = predicted class
    print(format_report(report))
    plot_confusion_matrix(report, "confusion.png")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import DataError


@dataclass(frozen=True)
class ClassificationReport:
    """Scores of N predictions over K classes; percentages 0-100 (per-class nan for a class never seen)."""

    accuracy: float
    top5: float  # top-k accuracy with k = min(5, K)
    per_class: list[float]  # accuracy of the examples of each true class (recall)
    support: list[int]  # examples of each true class
    confusion: Tensor  # (K, K) int64, rows = true class, columns = predicted class
    classes: list[str]
    loss: float | None = None  # mean cross-entropy, when computed from logits

    @property
    def count(self) -> int:
        return int(sum(self.support))

    def to_dict(self) -> dict:
        """The report as JSON-ready data, percentages to 4 decimals and the loss to 6 (what a float32 sum holds)."""
        return {"accuracy": round(self.accuracy, 4), "top5": round(self.top5, 4), "loss": round(self.loss, 6),
                "count": self.count,
                "per_class": {c: round(a, 4) for c, a in zip(self.classes, self.per_class, strict=True)},
                "support": {c: s for c, s in zip(self.classes, self.support, strict=True)},
                "confusion": self.confusion.tolist(), "classes": self.classes}


def _check(logits: Tensor, labels: Tensor) -> None:
    if logits.ndim != 2 or labels.ndim != 1 or len(logits) != len(labels):
        raise DataError(f"expected logits (N, K) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if len(labels) == 0:
        raise DataError("no predictions to score (N = 0)")
    if labels.min() < 0 or labels.max() >= logits.shape[1]:
        raise DataError(f"labels must be in 0..{logits.shape[1] - 1}, got {int(labels.min())}..{int(labels.max())}")


def topk_accuracy(logits: Tensor, labels: Tensor, k: int = 1) -> float:
    """Percentage of rows whose label is among the ``k`` largest logits. logits (N, K), labels (N,)."""
    _check(logits, labels)
    top = logits.topk(min(k, logits.shape[1]), dim=1).indices  # (N, k)
    return 100.0 * float((top == labels[:, None]).any(1).float().mean())


def expected_calibration_error(confidence: Tensor, correct: Tensor, bins: int = 15) -> float:
    """ECE (Guo et al. 2017), in percent: predictions grouped by confidence into ``bins`` equal-width bins;
    the mean |accuracy - confidence| of the bins, weighted by how many predictions each holds. ``confidence``:
    the probability of each predicted label; ``correct``: whether it was right."""
    confidence, correct = confidence.detach().double().flatten(), correct.detach().double().flatten()
    if confidence.numel() != correct.numel() or confidence.numel() == 0:
        raise ValueError(f"confidence ({confidence.numel()}) and correct ({correct.numel()}) must be equally long, "
                         "and not empty")
    which = (confidence * bins).long().clamp(0, bins - 1)
    count = torch.bincount(which, minlength=bins).double()
    gap = torch.bincount(which, weights=correct - confidence, minlength=bins)  # sum over each bin
    return float(100.0 * gap.abs().sum() / count.sum())


def confusion_matrix(predictions: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """(K, K) int64 counts: entry [t, p] = examples of true class t predicted as p. Both (N,) int."""
    index = labels.long() * num_classes + predictions.long()
    return torch.bincount(index, minlength=num_classes * num_classes).view(num_classes, num_classes)


def classification_report(logits: Tensor, labels: Tensor, classes: Sequence[str] | None = None) -> ClassificationReport:
    """Accuracy, top-5, per-class accuracy, confusion matrix and mean cross-entropy of logits (N, K)."""
    logits, labels = logits.detach().float().cpu(), labels.detach().long().cpu()
    _check(logits, labels)
    K = logits.shape[1]
    classes = list(classes) if classes is not None else [str(i) for i in range(K)]
    if len(classes) != K:
        raise DataError(f"{len(classes)} class names for {K} logits per example")
    confusion = confusion_matrix(logits.argmax(1), labels, K)
    support = confusion.sum(1)
    per_class = torch.where(support > 0, 100.0 * confusion.diagonal() / support.clamp_min(1), float("nan"))
    loss = float(torch.nn.functional.cross_entropy(logits, labels))
    return ClassificationReport(accuracy=100.0 * float(confusion.diagonal().sum()) / len(labels),
                                top5=topk_accuracy(logits, labels, 5), per_class=per_class.tolist(),
                                support=support.tolist(), confusion=confusion, classes=classes, loss=loss)


def format_report(report: ClassificationReport) -> str:
    """Aligned lines: accuracy, top-5, loss, then a per-class table (accuracy, count, most confused with)."""
    k = min(5, len(report.classes))
    lines = [f"accuracy  {report.accuracy:6.2f}", f"top-{k}     {report.top5:6.2f}"]
    if report.loss is not None:
        lines.append(f"loss      {report.loss:.4f}")
    width = max(5, *(len(c) for c in report.classes))
    lines.append(f"{'class':<{width}}  accuracy  count  most confused with")
    for i, name in enumerate(report.classes):
        row = report.confusion[i].clone()
        row[i] = 0
        worst = int(row.argmax())
        confused = f"{report.classes[worst]} ({int(row[worst])})" if int(row[worst]) > 0 else "-"
        lines.append(f"{name:<{width}}  {report.per_class[i]:8.2f}  {report.support[i]:5d}  {confused}")
    return "\n".join(lines)


def plot_confusion_matrix(report: ClassificationReport, path: str | Path, title: str | None = None) -> Path:
    """Draw the confusion matrix (counts, rows = true class) as a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    matrix = report.confusion.numpy()
    K = len(report.classes)
    size = min(2 + 0.45 * K, 20)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    try:
        shown = ax.imshow(matrix, cmap="Blues", norm=matplotlib.colors.PowerNorm(0.3))  # small errors visible
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        ax.set_xticks(range(K), labels=report.classes, rotation=90 if K > 12 else 0)
        ax.set_yticks(range(K), labels=report.classes)
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
        ax.set_title(title or f"accuracy {report.accuracy:.2f}% ({report.count} examples)")
        if K <= 30:
            threshold = matrix.max() / 2
            for t in range(K):
                for p in range(K):
                    if matrix[t, p]:
                        ax.text(p, t, str(matrix[t, p]), ha="center", va="center", fontsize=7,
                                color="white" if matrix[t, p] > threshold else "black")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path
