"""``tokenloom evaluate`` for image classifiers and ``tokenloom classify``."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import read_config, resolve_checkpoint
from ..errors import ConfigError
from .loading import load_inference_model
from .progress import progress

IMAGE_TASK = "image_classification"


def is_image_checkpoint(config: dict[str, Any]) -> bool:
    return config.get("task") == IMAGE_TASK


@contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """Print warnings as ``warning: ...`` lines (no file/line noise)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)


def _image_model(checkpoint: str | Path, precision: str, device: str = "auto"
                 ) -> tuple[Path, torch.nn.Module, dict[str, Any]]:
    ckpt = resolve_checkpoint(checkpoint)
    config = read_config(ckpt)
    if not is_image_checkpoint(config):
        family = (config.get("model") or {}).get("family", "gpt")
        raise ConfigError(f"{ckpt} holds a {config.get('task', 'lm')!r} model ({family}); classify needs an "
                          f"image classification checkpoint")
    model, _ = load_inference_model(ckpt, precision, device)
    return ckpt, model, config


def _default_plot_path(ckpt: Path, split: str) -> Path:
    return ckpt.parent / f"{ckpt.name}-confusion-{split}.png"


def evaluate_image(args: argparse.Namespace, ckpt: Path, config: dict[str, Any]) -> int:
    """Accuracy, top-5, loss, per-class table and the confusion-matrix PNG of a split."""
    from ..config import from_dict
    from ..evaluation.classification import classification_report, format_report, plot_confusion_matrix
    from ..tasks.image import ImageClassificationTask, ImageDataConfig, load_image_dataset

    if args.split not in ("train", "val", "test"):
        raise ConfigError(f"--split for an image classifier is train, val or test, got {args.split!r}")
    if args.metrics or args.source or args.reference:
        raise ConfigError("--metrics, --source and --reference apply to translation models; an image classifier "
                          "reports accuracy, top-5 and a confusion matrix")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    section = dict(config.get("data") or {})
    if args.data:
        section["dir"] = args.data
    if args.batch_size:
        section["eval_batch_size"] = args.batch_size
    data = from_dict(ImageDataConfig, section, prefix="data")
    _, model, _ = _image_model(ckpt, args.precision, args.device)
    with _warnings_to_stderr():
        dataset = load_image_dataset(data)
    task = ImageClassificationTask(dataset, data, batch_size=1)
    total = dataset.size(args.split)
    if args.batches is not None:
        total = min(total, args.batches * data.eval_batch_size)
    start = time.perf_counter()
    with progress("evaluate", total, "evaluated", "image") as done:
        logits, labels = task.logits(model, args.split, args.batches, progress=done)
    seconds = time.perf_counter() - start
    report = classification_report(logits, labels, dataset.classes)
    plot = None
    if not args.no_plot:
        try:
            plot = plot_confusion_matrix(report, args.output or _default_plot_path(ckpt, args.split),
                                         title=f"{ckpt.parent.name}/{ckpt.name} {args.split}: accuracy "
                                               f"{report.accuracy:.2f}% ({report.count} images)")
        except ImportError:
            print("warning: matplotlib is not installed, so no confusion-matrix PNG was drawn "
                  "(pip install 'tokenloom[viz]')", file=sys.stderr)
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "data": str(data.root), "split": args.split, **report.to_dict(),
                          "confusion_png": str(plot) if plot else None, "seconds": round(seconds, 2)}))
    else:
        print(f"{ckpt}: {data.dataset} {args.split} ({report.count} images, {seconds:.1f} s)")
        print(format_report(report))
        if plot:
            print(f"confusion matrix: {plot}")
    return 0


def classify(args: argparse.Namespace) -> int:
    """Predicted class and top-K probabilities of each image."""
    from ..tasks.image import classify as run

    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    ckpt, model, config = _image_model(args.checkpoint, args.precision, args.device)
    data = config.get("data") or {}
    classes = data.get("classes") or [str(i) for i in range(model_classes(model, data))]
    with _warnings_to_stderr(), progress("classify", len(args.images), "classified", "image") as done:
        probs = run(model, args.images, data, mismatch=args.mismatch, invert=args.invert, progress=done)  # (N, K)
    k = min(args.top, probs.shape[1])
    top = probs.topk(k, dim=1)
    predictions = []
    for path, values, indices in zip(args.images, top.values.tolist(), top.indices.tolist(), strict=True):
        ranked = [{"label": classes[i], "probability": round(p, 6)} for p, i in zip(values, indices, strict=True)]
        predictions.append({"image": str(path), "label": ranked[0]["label"], "top": ranked})
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "predictions": predictions}))
    else:
        for item in predictions:
            shown = ", ".join(f"{t['label']} {100 * t['probability']:.1f}%" for t in item["top"])
            print(f"{item['image']}: {item['label']}  ({shown})")
    return 0


def model_classes(model: torch.nn.Module, data: dict[str, Any]) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "num_classes", 0) or len(data.get("classes") or []))


def refuse_image_checkpoint(checkpoint: str | Path, command: str, use: str) -> None:
    """A one-line error when ``checkpoint`` holds an image classifier (for text commands)."""
    if is_image_checkpoint(read_config(checkpoint)):
        raise ConfigError(f"{resolve_checkpoint(checkpoint)} holds an image classifier: `tokenloom {command}` "
                          f"does not apply, use {use}")
