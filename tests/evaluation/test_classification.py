"""Classification metrics on hand-made logits."""

import math

import pytest
import torch

from tokenloom.errors import DataError
from tokenloom.evaluation import (
    classification_report,
    compute_metrics,
    confusion_matrix,
    format_report,
    plot_confusion_matrix,
    topk_accuracy,
)


def one_hot_logits(predicted, K=3, second=None):
    logits = torch.zeros(len(predicted), K)
    logits[torch.arange(len(predicted)), torch.tensor(predicted)] = 5.0
    if second is not None:
        logits[torch.arange(len(predicted)), torch.tensor(second)] = 2.0
    return logits


def test_report_by_hand():
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    predicted = [0, 0, 0, 1, 1, 2, 2, 0]  # class 0: 3/4, class 1: 1/2, class 2: 1/2
    logits = one_hot_logits(predicted, second=[1, 1, 1, 0, 0, 0, 0, 2])
    report = classification_report(logits, labels, classes=["zero", "one", "two"])
    assert report.accuracy == pytest.approx(100 * 5 / 8)
    assert report.per_class == pytest.approx([75.0, 50.0, 50.0])
    assert report.support == [4, 2, 2] and report.count == 8
    assert report.confusion.tolist() == [[3, 1, 0], [0, 1, 1], [1, 0, 1]]
    assert report.top5 == 100.0  # K = 3: top-5 is top-3
    assert topk_accuracy(logits, labels, 2) == pytest.approx(100 * 7 / 8)  # only sample 5 (label 1) misses
    assert report.loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    text = format_report(report)
    assert "accuracy   62.50" in text and "top-3" in text
    assert "zero" + " " * 6 + "75.00" + " " * 6 + "4  one (1)" in text
    d = report.to_dict()
    assert d["per_class"]["one"] == 50.0 and d["confusion"][2] == [1, 0, 1]


def test_confusion_matrix_and_missing_class():
    cm = confusion_matrix(torch.tensor([1, 1, 0]), torch.tensor([1, 0, 0]), 3)
    assert cm.tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 0]] and cm.dtype == torch.int64
    report = classification_report(one_hot_logits([1, 1, 0]), torch.tensor([1, 0, 0]))
    assert report.classes == ["0", "1", "2"] and math.isnan(report.per_class[2]) and report.support[2] == 0


def test_top5_with_many_classes():
    logits = torch.arange(10.0).repeat(4, 1)  # class 9 best, then 8, ...
    labels = torch.tensor([9, 5, 4, 0])
    assert topk_accuracy(logits, labels, 1) == 25.0
    assert topk_accuracy(logits, labels, 5) == 50.0  # 9 and 5 are in the top five (9..5); 4 and 0 are not


def test_bad_inputs():
    with pytest.raises(DataError, match="expected logits"):
        classification_report(torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(DataError, match="labels must be in 0..2"):
        classification_report(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(DataError, match="no predictions"):
        topk_accuracy(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(DataError, match="2 class names for 3"):
        classification_report(torch.zeros(2, 3), torch.tensor([0, 1]), classes=["a", "b"])


def test_accuracy_in_the_metric_registry():
    result = compute_metrics(["accuracy"], ["cat", "dog", "dog", "cat"], ["cat", "dog", "cat", "cat"])
    assert result.scores == {"accuracy": 75.0}


def test_confusion_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = classification_report(one_hot_logits([0, 1, 2, 2]), torch.tensor([0, 1, 2, 1]))
    path = plot_confusion_matrix(report, tmp_path / "sub" / "cm.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_expected_calibration_error():
    from tokenloom.evaluation import expected_calibration_error

    confidence = torch.full((1000,), 0.9)
    correct = torch.arange(1000) % 10 != 0  # 90% right at 90% confidence: calibrated
    assert expected_calibration_error(confidence, correct) == pytest.approx(0.0, abs=1e-4)
    assert expected_calibration_error(torch.ones(10), torch.arange(10) < 5) == pytest.approx(50.0)
    # two bins: 0.95 confident and always right (gap 5), 0.55 confident and right 25% (gap 30), equal counts
    conf = torch.cat([torch.full((4,), 0.95), torch.full((4,), 0.55)])
    right = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert expected_calibration_error(conf, right) == pytest.approx((5.0 + 30.0) / 2)
    with pytest.raises(ValueError, match="equally long"):
        expected_calibration_error(torch.ones(3), torch.ones(2))
