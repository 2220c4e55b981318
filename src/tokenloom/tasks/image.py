"""Image classification: a vision model (ViT, Swin, ...) trained with cross-entropy on labelled images.

Datasets (``data.dataset``), all held in memory as uint8 images:

* ``mnist``: ``data.dir`` (default ``data/mnist``) holds the four IDX files. Train = the first 55,000
  training images, val = the last ``data.val_size`` (5,000), test = the official 10,000 test images.
* ``digits``: ``data.dir`` (default ``data/digits``) holds scikit-learn's ``digits.csv[.gz]`` (1,797 8x8
  images). A fixed permutation seeded by ``data.split_seed`` (0) gives test = its first
  ``data.test_size`` (360) images, val = the next ``data.val_size`` (180), train = the other 1,257.
* ``folder``: ``data.dir`` holds ``train/<class>/*.png`` (and optionally ``val/`` and ``test/`` laid out
  the same way), or the class folders directly. Without ``val/``, ``data.val_size`` training images
  (default 10%) are held out, without ``test/`` ``data.test_size`` more (default 10%; none when the folder
  is too small for it), by a permutation seeded by ``data.split_seed``.

The model's ``image_size``, ``in_channels`` and ``num_classes`` come from the data unless the recipe's model
section pins them: a pinned image size or channel count (where ``data.image_size`` / ``data.in_channels`` are
unset) is what the images are converted to; a pinned ``num_classes`` must equal the number of classes.

A training batch is ``batch_size`` images of a per-epoch permutation (seeded by ``train.seed`` and the
epoch, so resuming is exact), augmented on the fly (``data.augment``: random crop, flip, affine jitter,
erasing, mixup / cutmix, drawn from the trainer's generator), normalised with the per-channel mean/std
of the training images (or ``data.mean`` / ``data.std``). The loss is cross-entropy with
``train.label_smoothing`` (against soft targets for mixed batches). Evaluation reports
``{split}_loss``, ``{split}_acc`` and ``{split}_top5`` (percentages); ``train.keep_best: val_acc`` keeps
the most accurate checkpoint. The checkpoint's ``data`` section records the class names, image size,
channels and normalisation, so ``tokenloom classify`` and ``evaluate`` need nothing else.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..config import check
from ..data.augment import AugmentConfig, augment, mix_batch
from ..data.images import (
    ImageDataset,
    holdout_split,
    image_size_hw,
    load_image,
    read_digits,
    read_image_folder,
    read_mnist,
    resize_images,
)
from ..errors import ConfigError, DataError
from ..models.factory import create_model, model_config_from_dict
from ..models.registry import MODELS
from ..packaged import where_bundled
from .losses import cross_entropy, soft_cross_entropy
from .registry import TASKS, Sharded

DEFAULT_DIRS = {"mnist": "data/mnist", "digits": "data/digits"}
DIGITS = [str(i) for i in range(10)]


@dataclass
class ImageDataConfig:
    dataset: Literal["mnist", "digits", "folder"] = "mnist"  # the bundled MNIST or 8x8 digits, or a folder of
    #   class subfolders (train/<class>/, optionally val/ and test/)
    dir: str | None = None  # mnist / digits: default data/mnist, data/digits; folder: required
    image_size: int | list[int] | None = None  # H (= W) or [H, W] the images get; None: the dataset's own
    in_channels: int | None = None  # 1 (grayscale) or 3 (RGB); None: the dataset's own
    mismatch: Literal["convert", "error"] = "convert"  # folder images of another size / mode: convert (one
    #   warning) or refuse
    val_size: int | None = None  # validation images: mnist 5000 (the last training images), digits 180,
    #   folder without val/: 10% of train
    test_size: int | None = None  # held-out test images: digits 360, folder without test/: 10% of train (mnist
    #   has its own)
    split_seed: int = 0  # the permutation of the digits / folder hold-out split
    mean: list[float] | None = None  # per channel, of [0, 1] pixels; None: from the training images
    std: list[float] | None = None  # per channel, like mean; None: from the training images
    classes: list[str] | None = None  # class names (recorded by checkpoints); folder: the class folders
    eval_batch_size: int = 500  # images per evaluation batch
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # training-time augmentation (off by default)

    def __post_init__(self) -> None:
        check(self.dataset != "folder" or bool(self.dir), "data.dir must name the image folder for dataset 'folder'")
        if self.image_size is not None:
            size = [self.image_size] if isinstance(self.image_size, int) else self.image_size
            check(len(size) in (1, 2) and min(size) >= 1,
                  f"data.image_size must be a positive int or [H, W], got {self.image_size}")
            if len(size) == 1:
                self.image_size = size[0]
        check(self.in_channels in (None, 1, 3), f"data.in_channels must be 1 or 3, got {self.in_channels}")
        check(self.val_size is None or self.val_size >= 1, f"data.val_size must be >= 1, got {self.val_size}")
        check(self.test_size is None or self.test_size >= 1, f"data.test_size must be >= 1, got {self.test_size}")
        check(self.test_size is None or self.dataset != "mnist",
              "data.test_size applies to the digits dataset and image folders without test/ (mnist has its own test "
              "split)")
        check(self.eval_batch_size >= 1, f"data.eval_batch_size must be >= 1, got {self.eval_batch_size}")
        check((self.mean is None) == (self.std is None), "data.mean and data.std go together")
        if self.std is not None:
            check(len(self.std) == len(self.mean) and min(self.std) > 0,
                  f"data.std must be positive, one per channel like data.mean, got {self.std}")
        check(self.classes is None or len(set(self.classes)) == len(self.classes) >= 2,
              f"data.classes must be at least two distinct names, got {self.classes}")

    @property
    def root(self) -> Path:
        return Path(self.dir or DEFAULT_DIRS[self.dataset])


def _digits_file(root: Path) -> Path:
    if root.is_file():
        return root
    for name in ("digits.csv.gz", "digits.csv"):
        if (root / name).is_file():
            return root / name
    raise DataError(f"digits data not found: {root}/digits.csv[.gz]{where_bundled(root)}")


def _folder_splits(data: ImageDataConfig) -> tuple[dict[str, tuple[Tensor, Tensor]], list[str]]:
    root = data.root
    layout = root / "train"
    size = image_size_hw(data.image_size) if data.image_size is not None else None
    kwargs = {"channels": data.in_channels, "mismatch": data.mismatch}
    x, y, classes, size, channels = read_image_folder(layout if layout.is_dir() else root, image_size=size,
                                                      classes=data.classes, **kwargs)
    if len(classes) < 2:
        raise DataError(f"image folder {root} has {len(classes)} class folder(s); classification needs at least two")
    kwargs["channels"] = channels
    splits = {}
    for name in ("val", "test"):
        if layout.is_dir() and (root / name).is_dir():
            splits[name] = read_image_folder(root / name, image_size=size, classes=classes, **kwargs)[:2]
    # the splits the folder lacks are held out of its training images: data.val_size / data.test_size, else 10%
    # each (a test split only where the images leave room for it)
    held = {name: getattr(data, f"{name}_size") for name in ("val", "test") if name not in splits}
    sizes = {name: given or max(1, len(y) // 10) for name, given in held.items()}
    if "test" in sizes and held["test"] is None and sum(sizes.values()) >= len(y):
        del sizes["test"]  # (no room for a default test split)
    if sizes and sum(sizes.values()) >= len(y):
        wanted = " + ".join(f"{size} {name}" for name, size in sizes.items())
        given = [f"data.{name}_size={held[name]}" for name in sizes if held[name] is not None]
        raise DataError(f"image folder {root}: its {len(y)} training images cannot give {wanted} images and keep any "
                        f"for training" + (f" ({', '.join(given)}: set smaller)" if given else ""))
    if sizes:
        *parts, train = holdout_split(len(y), list(sizes.values()), data.split_seed)
        splits.update({name: (x[part], y[part]) for name, part in zip(sizes, parts, strict=True)})
        x, y = x[train], y[train]
    return {"train": (x, y), **splits}, classes


def load_image_dataset(data: ImageDataConfig) -> ImageDataset:
    """The splits of ``data`` (see the module docstring), resized / converted to its image size and channels."""
    if data.dataset == "folder":
        splits, classes = _folder_splits(data)
    else:
        if data.dataset == "mnist":
            x, y = read_mnist(data.root, "train")
            val_size = data.val_size or 5000
            if val_size >= len(y):
                raise DataError(f"data.val_size={val_size} leaves no MNIST training images (of {len(y)})")
            splits = {"train": (x[:-val_size], y[:-val_size]), "val": (x[-val_size:], y[-val_size:]),
                      "test": read_mnist(data.root, "test")}
        else:
            x, y = read_digits(_digits_file(data.root))
            test, val, train = holdout_split(len(y), [data.test_size or 360, data.val_size or 180], data.split_seed)
            splits = {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}
        if data.classes is not None and data.classes != DIGITS:
            raise ConfigError(f"data.classes of {data.dataset} are the digits 0..9, got {data.classes}")
        classes = DIGITS
        size = image_size_hw(data.image_size) if data.image_size is not None else None
        channels = data.in_channels or 1
        splits = {name: (resize_images(images, size) if size else images, labels)
                  for name, (images, labels) in splits.items()}
        if channels == 3:
            splits = {name: (images.expand(-1, 3, -1, -1).contiguous(), labels)
                      for name, (images, labels) in splits.items()}
    return ImageDataset(splits, classes, data.mean, data.std)


@dataclass
class ImageBatch:
    images: Tensor  # (B, C, H, W) float32, normalised
    labels: Tensor  # (B,) int64
    targets: Tensor | None = None  # (B, K) soft targets of a mixed batch, else None


@TASKS.register("image_classification")
class ImageClassificationTask(Sharded):
    """Batches of augmented images; cross-entropy (label smoothing, soft targets); loss / accuracy / top-5."""

    data_config_cls = ImageDataConfig
    default_family = "vit"
    uses_tokenizer = False
    count_unit = "img"  # the progress line's img/s

    def __init__(self, dataset: ImageDataset, data: ImageDataConfig, *, batch_size: int, label_smoothing: float = 0.0,
                 eval_batches: int | None = None, seed: int = 0) -> None:
        self.dataset, self.data = dataset, data
        self.batch_size, self.label_smoothing, self.eval_batches, self.seed = batch_size, label_smoothing, \
            eval_batches, seed
        self.epoch, self.offset = 0, 0  # the offset: images of the epoch's order already drawn
        self._order: Tensor | None = None

    @classmethod
    def setup(cls, data: ImageDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None, tokenizer: Any = None,
              seed: int = 0) -> tuple[ImageClassificationTask, nn.Module, None, dict[str, Any]]:
        """The dataset, and the model with ``image_size``, ``in_channels`` and ``num_classes`` taken from it
        where the recipe's model section leaves them out. A model ``image_size`` / ``in_channels`` it pins is what
        the images are converted to (unless ``data.image_size`` / ``data.in_channels`` say otherwise: then they
        must agree); a pinned ``num_classes`` must equal the data's. Returns (task, model, None, model section)."""
        check(seq_len is None, f"train.seq_len applies to sequence tasks, not image_classification (got {seq_len})")
        section = {"family": cls.default_family, **model_section}
        pinned = {key: section[key] for key in ("image_size", "in_channels")
                  if section.get(key) is not None and getattr(data, key) is None}
        if pinned.get("in_channels") not in (None, 1, 3):
            del pinned["in_channels"]  # not an image mode: refused below as a mismatch
        if isinstance(pinned.get("image_size"), (list, tuple)):
            pinned["image_size"] = list(pinned["image_size"])
        if pinned:
            data = dataclasses.replace(data, **pinned)
        dataset = load_image_dataset(data)
        from_data = []
        for key, value in model_fields(dataset).items():
            given = section.get(key)
            same = given is not None and (image_size_hw(given) == image_size_hw(value) if key == "image_size"
                                          else given == value)
            if given is not None and not same:
                raise ConfigError(f"model.{key}={given} does not match the data ({value}); leave it out or set "
                                  f"data.{'classes' if key == 'num_classes' else key} to match")
            if given is None:
                section[key] = value
                from_data.append(key)
        try:
            family, model_config = model_config_from_dict(section)
        except ConfigError as err:
            if "image_size" not in from_data or not str(err).startswith("model.image_size="):
                raise
            h, w = dataset.image_size
            raise ConfigError(f"{err} (model.image_size is the data's image size, {h}x{w}: set data.image_size to a "
                              f"size the patches divide and the images are resized to it)") from None
        model = create_model(family, model_config)
        task = cls(dataset, data, batch_size=batch_size, label_smoothing=label_smoothing, eval_batches=eval_batches,
                   seed=seed)
        return task, model, None, section

    @classmethod
    def model_stand_ins(cls, model: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """Until the images are read, an image of one patch stands in for an ``image_size`` the model section leaves
        to the data (the family's default size would have to be a multiple of the patch size), the family's
        defaults for ``in_channels`` / ``num_classes`` set to null (left to the data too)."""
        fields = {f.name: f for f in dataclasses.fields(MODELS.get(model["family"])[0])}
        stand_ins = {key: fields[key].default for key in ("in_channels", "num_classes")
                     if key in model and model[key] is None and key in fields}
        patch = model.get("patch_size", fields["patch_size"].default if "patch_size" in fields else None)
        if model.get("image_size") is None and "image_size" in fields and isinstance(patch, int) \
                and not isinstance(patch, bool) and patch >= 1:
            stand_ins["image_size"] = patch
        return stand_ins

    def checkpoint_data(self) -> dict[str, Any]:
        """What the checkpoint's ``data`` section records beyond the recipe: classes, size, channels, mean/std."""
        h, w = self.dataset.image_size
        return {"image_size": h if h == w else [h, w], "in_channels": self.dataset.channels,
                "classes": list(self.dataset.classes), "mean": self.dataset.mean, "std": self.dataset.std}

    # ---- training -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._order = int(state["epoch"]), None
        # older checkpoints count batches of batch_size
        self.offset = int(state["offset"]) if "offset" in state else int(state["position"]) * self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        """Updates per epoch (global batches of ``world_size`` x ``batch_size``; the last partial one is dropped)."""
        return max(1, self.dataset.size("train") // (self.batch_size * self.world_size))

    def get_batch(self, generator: torch.Generator) -> ImageBatch:
        """The next ``batch_size`` training images (the order is fixed by the seed and the epoch; a last partial
        batch is dropped), augmented with ``generator``. Distributed: the global batch is drawn and augmented
        (mixup pairs images across it), this rank keeps its slice."""
        size = self.batch_size * self.world_size
        if self.offset + size > self.dataset.size("train"):
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        if self._order is None:
            epoch_generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
            self._order = torch.randperm(self.dataset.size("train"), generator=epoch_generator)
        indices = self._order[self.offset:self.offset + size]
        self.offset += size
        x = augment(self.dataset.pixels("train", indices), self.data.augment, generator)
        labels = self.dataset.labels("train")[indices]
        x, targets = mix_batch(x, labels, self.dataset.num_classes, self.data.augment, generator)
        if self.world_size > 1:
            rows = self.local(self.batch_size)
            x, labels, targets = x[rows], labels[rows], targets[rows] if targets is not None else None
        return ImageBatch(self.dataset.normalize(x), labels, targets)

    def loss(self, model: nn.Module, batch: ImageBatch) -> tuple[Tensor, int]:
        """(mean cross-entropy, number of images)."""
        logits = predict(model, batch.images)  # (B, K)
        labels = batch.labels.to(logits.device)
        if batch.targets is None:
            loss = cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        else:
            loss = soft_cross_entropy(logits, batch.targets.to(logits.device), label_smoothing=self.label_smoothing)
        return loss, len(labels)

    # ---- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, model: nn.Module, split: str = "val", max_batches: int | None = None,
               progress: Callable[[int], object] | None = None) -> tuple[Tensor, Tensor]:
        """(logits (N, K) float32, labels (N,)) of the first ``max_batches`` evaluation batches of a split
        (None: all of it), without augmentation; ``progress`` is called with each batch's number of images."""
        n, size = self.dataset.size(split), self.data.eval_batch_size
        outputs = []
        for i, start in enumerate(range(0, n, size)):
            if max_batches is not None and i >= max_batches:
                break
            indices = torch.arange(start, min(start + size, n))
            outputs.append(predict(model, self.dataset.normalize(self.dataset.pixels(split, indices))).float().cpu())
            if progress is not None:
                progress(len(indices))
        if not outputs:
            raise DataError(f"the {split!r} split is empty: nothing to evaluate")
        logits = torch.cat(outputs)
        return logits, self.dataset.labels(split)[:len(logits)]

    def eval_split_batches(self, split: str = "val") -> int:
        """How many batches :meth:`evaluate` reads from all of ``split`` (``data.eval_batch_size`` images each)."""
        return -(-self.dataset.size(split) // self.data.eval_batch_size)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val") -> dict[str, float]:
        """``{split}_loss`` (no label smoothing), ``{split}_acc`` and ``{split}_top5`` (percentages) over the
        first ``max_batches`` batches (-1: the task's ``eval_batches``; None: the whole split)."""
        from ..evaluation.classification import topk_accuracy

        logits, labels = self.logits(model, split, self.eval_batches if max_batches == -1 else max_batches)
        return {f"{split}_loss": float(cross_entropy(logits, labels)), f"{split}_acc": topk_accuracy(logits, labels, 1),
                f"{split}_top5": topk_accuracy(logits, labels, 5)}


def model_fields(dataset: ImageDataset) -> dict[str, Any]:
    """The model settings the data fixes: image_size (int when square), in_channels, num_classes."""
    h, w = dataset.image_size
    return {"image_size": h if h == w else [h, w], "in_channels": dataset.channels, "num_classes": dataset.num_classes}


def predict(model: nn.Module, images: Tensor) -> Tensor:
    """Logits (B, K) of normalised images (B, C, H, W), cast to the model's device and dtype."""
    param = next(model.parameters())
    return model(images.to(device=param.device, dtype=param.dtype))


def classify(model: nn.Module, paths: Sequence[str | Path], data: ImageDataConfig | dict[str, Any], *,
             mismatch: str = "convert", invert: bool = False, progress: Callable[[int], object] | None = None
             ) -> Tensor:
    """Class probabilities (N, K) of image files, read as the model was trained: converted to its mode
    and size (with one warning; ``mismatch="error"`` refuses instead), optionally inverted (dark digits
    on light paper for an MNIST model), normalised with the checkpoint's mean/std. ``progress`` is called with 1
    as each image is read."""
    x = read_images(paths, data, mismatch=mismatch, invert=invert, progress=progress)
    with torch.no_grad():
        return predict(model, x).float().softmax(-1)


def read_images(paths: Sequence[str | Path], data: ImageDataConfig | dict[str, Any], *, mismatch: str = "convert",
                invert: bool = False, progress: Callable[[int], object] | None = None) -> Tensor:
    """Image files -> (N, C, H, W) normalised float32 model inputs, as :func:`classify` reads them."""
    from ..config import from_dict

    data = from_dict(ImageDataConfig, data, prefix="data") if isinstance(data, dict) else data
    if data.image_size is None or data.in_channels is None or data.mean is None:
        raise ConfigError("the checkpoint's data section lacks image_size / in_channels / mean (not an image "
                          "classification checkpoint?)")
    size = image_size_hw(data.image_size)
    images, notes = [], []
    for path in paths:
        image, changes = load_image(path, size, data.in_channels, mismatch=mismatch,
                                    hint=" (pass --mismatch convert to convert it)")
        images.append(image)
        notes += [f"{Path(path).name}: {', '.join(changes)}"] if changes else []
        if progress is not None:
            progress(1)
    if notes:
        warnings.warn(f"{len(notes)} image(s) converted to the model's {size[0]}x{size[1]} "
                      f"{'grayscale' if data.in_channels == 1 else 'RGB'} input ({notes[0]}"
                      f"{', ...' if len(notes) > 1 else ''})", stacklevel=2)
    x = torch.stack(images).float().div_(255)
    if invert:
        x = 1 - x
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    return (x - mean) / std
