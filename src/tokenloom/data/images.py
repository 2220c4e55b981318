"""Images for classification: readers and an in-memory dataset.

Readers return ``uint8`` images (N, C, H, W) with pixel values 0..255 and ``int64`` labels (N,):

* :func:`read_mnist` -- the MNIST IDX files (``train-images-idx3-ubyte[.gz]`` ...), checked against the
  IDX header: magic number, dimensions and the exact byte length; :func:`read_idx` / :func:`write_idx`
  handle any IDX file (plain or gzip).
* :func:`read_digits` -- scikit-learn's ``digits.csv.gz`` (one 8x8 image per line: 64 pixel values
  0..16, then the label 0..9); pixels are scaled to 0..255 (``round(v * 255 / 16)``).
  :func:`holdout_split` gives its fixed, seeded train/val/test split.
* :func:`read_image_folder` -- a folder with one subfolder per class (Pillow); each image is converted
  to grayscale (``L``) or ``RGB`` and resized to the requested size, with one warning for the whole
  folder (``mismatch="convert"``) or a one-line error naming the first such file (``"error"``).

Every problem a user can cause (missing, corrupt, truncated or empty files and folders) raises a
one-line :class:`~tokenloom.errors.DataError` naming the path.

:class:`ImageDataset` holds the splits in memory with the class names and the per-channel mean/std of
the [0, 1] pixels, and turns index lists into normalised float batches.
"""

from __future__ import annotations

import gzip
import math
import struct
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from ..packaged import where_bundled

# IDX element types: code -> numpy dtype (big-endian)
IDX_TYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
             0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
MODES = {1: "L", 3: "RGB"}  # in_channels -> Pillow mode


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when the file starts with the gzip magic; one-line DataErrors."""
    if not path.is_file():
        raise DataError(f"data file not found: {path}{where_bundled(path)}")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise DataError(f"{path} is a truncated or corrupt gzip file ({err})") from None
    except OSError as err:
        raise DataError(f"cannot read data file {path}: {err.strerror or err}") from None
    return raw


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (plain or gzip) -> a numpy array of its dimensions and type.

    The header is two zero bytes, a type code, the number of dimensions, then each dimension as a
    big-endian uint32. The data must fill exactly the product of the dimensions.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_TYPES or raw[3] == 0:
        magic = int.from_bytes(raw[:4].ljust(4, b"\0"), "big")
        raise DataError(f"{path} is not an IDX file (magic number 0x{magic:08x}, {len(raw)} bytes)")
    dtype, ndim = IDX_TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated: {len(raw)} bytes, shorter than its {header}-byte IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "corrupt (trailing bytes)"
        raise DataError(f"{path} is {what}: {len(raw)} bytes, its header (dims {'x'.join(map(str, dims))}) "
                        f"needs {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims)


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write ``array`` (uint8 or another IDX type) as an IDX file, gzipped when ``path`` ends in ``.gz``."""
    array = np.ascontiguousarray(array)
    code = next((c for c, d in IDX_TYPES.items() if d == array.dtype.newbyteorder(">")
                 or d == array.dtype), None)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    data = struct.pack(f">BBBB{array.ndim}I", 0, 0, code, array.ndim, *array.shape)
    data += array.astype(IDX_TYPES[code]).tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise DataError(f"MNIST file not found: {root / stem}[.gz]")


def read_mnist(root: str | Path, split: str = "train") -> tuple[Tensor, Tensor]:
    """MNIST ``train`` (60,000) or ``test`` (10,000) images (N, 1, 28, 28) uint8 and labels (N,) int64."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"MNIST folder not found: {root}{where_bundled(root)}")
    image_path, label_path = (_find(root, stem) for stem in MNIST_FILES[split])
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataError(f"{image_path}: expected uint8 images (magic 0x00000803), got {images.dtype} with "
                        f"{images.ndim} dims")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{label_path}: expected uint8 labels (magic 0x00000801), got {labels.dtype} with "
                        f"{labels.ndim} dims")
    if len(images) != len(labels):
        raise DataError(f"{image_path} holds {len(images)} images but {label_path} {len(labels)} labels")
    if len(labels) and labels.max() > 9:
        raise DataError(f"{label_path}: label {int(labels.max())} is outside 0..9")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def read_digits(path: str | Path) -> tuple[Tensor, Tensor]:
    """scikit-learn digits CSV (plain or gzip) -> images (N, 1, 8, 8) uint8 (0..16 scaled to 0..255) and
    labels (N,) int64."""
    path = Path(path)
    try:
        text = _read_bytes(path).decode("ascii")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not a digits CSV file (non-ASCII byte at offset {err.start})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values = [int(float(v)) for v in line.split(",")]
        except ValueError:
            raise DataError(f"{path} line {number}: expected comma-separated numbers") from None
        if len(values) != 65:
            raise DataError(f"{path} line {number}: expected 65 values (64 pixels and a label), got {len(values)}")
        if min(values[:64]) < 0 or max(values[:64]) > 16 or not 0 <= values[64] <= 9:
            raise DataError(f"{path} line {number}: pixels must be 0..16 and the label 0..9")
        rows.append(values)
    if not rows:
        raise DataError(f"data file is empty: {path}")
    table = torch.tensor(rows, dtype=torch.float64)
    images = (table[:, :64] * (255 / 16)).round().to(torch.uint8).view(-1, 1, 8, 8)
    return images, table[:, 64].long()


def holdout_split(n: int, sizes: Sequence[int], seed: int = 0) -> list[Tensor]:
    """Split ``range(n)`` by a seeded permutation: the first ``sizes[0]`` shuffled indices, the next
    ``sizes[1]``, ..., then the rest; each part sorted. The same (n, sizes, seed) gives the same split."""
    if sum(sizes) >= n:
        raise DataError(f"cannot hold out {' + '.join(map(str, sizes))} of {n} examples and keep any for training")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for size in [*sizes, n - sum(sizes)]:
        parts.append(perm[start:start + size].sort().values)
        start += size
    return parts


def image_size_hw(size: int | Sequence[int]) -> tuple[int, int]:
    """``28`` or ``[28, 28]`` -> (H, W)."""
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


def load_image(path: str | Path, size: tuple[int, int] | None, channels: int | None, *,
               mismatch: str = "convert", hint: str = "") -> tuple[Tensor, list[str]]:
    """One image file -> (uint8 (C, H, W), the changes made: ``"mode RGBA -> L"``, ``"size 32x32 -> 28x28"``).

    ``size`` (H, W) and ``channels`` (1 or 3) are what the caller needs (None: keep the file's). An image
    of another size or mode is converted (``mismatch="convert"``; the caller warns) or refused with a
    one-line DataError (``"error"``, with ``hint`` appended).
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise DataError(f"image not found: {path}")
    try:
        with Image.open(path) as img:
            img.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as err:
        raise DataError(f"cannot read image {path} ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                        ) from None
    gray = img.mode in ("1", "L", "LA", "F") or img.mode.startswith("I")
    mode = MODES[channels] if channels else ("L" if gray else "RGB")
    changes = []
    if img.mode != mode:
        changes.append(f"mode {img.mode} -> {mode}")
    w, h = img.size
    if size is not None and (h, w) != tuple(size):
        changes.append(f"size {h}x{w} -> {size[0]}x{size[1]}")
    if changes and mismatch == "error":
        raise DataError(f"{path}: {', '.join(changes).replace(' -> ', ' but expected ')}{hint}")
    if img.mode.startswith(("I", "F")):  # 16/32-bit or float grayscale: to 8 bits (Pillow would clip)
        arr = np.asarray(img, dtype=np.float64)
        arr = arr / 257 if img.mode.startswith("I;16") else arr * (255 / max(float(arr.max()), 255.0))
        img = Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8))  # mode L
    if img.mode != mode:
        img = img.convert(mode)
    if size is not None and (h, w) != tuple(size):
        img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.uint8)
    tensor = torch.from_numpy(arr.copy())
    tensor = tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1)
    return tensor.contiguous(), changes


def list_images(folder: Path) -> list[Path]:
    """Image files (by suffix) directly inside ``folder``, sorted; hidden files are skipped."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES)


def class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_image_folder(root: str | Path, *, image_size: tuple[int, int] | None = None, channels: int | None = None,
                      classes: Sequence[str] | None = None, mismatch: str = "convert",
                      ) -> tuple[Tensor, Tensor, list[str], tuple[int, int], int]:
    """A folder of class subfolders -> (images (N, C, H, W) uint8, labels (N,) int64, class names, (H, W), C).

    Classes are the subfolder names in sorted order, or ``classes`` (then every subfolder must be one of
    them, so labels keep their meaning across splits). ``image_size`` / ``channels`` None: those of the
    first image. Images of another size or mode are converted with one warning for the folder, or refused
    (``mismatch="error"``).
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    try:
        folders = class_folders(root)
    except OSError as err:
        raise DataError(f"cannot read image folder {root}: {err.strerror or err}") from None
    if not folders:
        raise DataError(f"image folder {root} has no class subfolders (expected {root}/<class>/<image>)")
    names = list(classes) if classes is not None else [p.name for p in folders]
    unknown = [p.name for p in folders if p.name not in names]
    if unknown:
        raise DataError(f"{root}: class folder {unknown[0]!r} is not one of the classes {names}")
    images, labels, converted, first = [], [], 0, None
    for folder in folders:
        files = list_images(folder)
        if not files:
            raise DataError(f"class folder {folder} has no images ({', '.join(IMAGE_SUFFIXES[:4])}, ...)")
        for file in files:
            image, changes = load_image(file, image_size, channels, mismatch=mismatch,
                                        hint=" (set data.mismatch: convert to convert such images)")
            if image_size is None:  # the first image fixes the size (and mode) of the rest
                image_size = (int(image.shape[1]), int(image.shape[2]))
            channels = channels or int(image.shape[0])
            if changes:
                converted += 1
                first = first or (file, changes)
            images.append(image)
            labels.append(names.index(folder.name))
    if converted:
        warnings.warn(f"{root}: {converted} image(s) converted to {image_size[0]}x{image_size[1]} "
                      f"{MODES[channels]} (e.g. {first[0].name}: {', '.join(first[1])})", stacklevel=2)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long), names, image_size, channels


def resize_images(images: Tensor, size: tuple[int, int]) -> Tensor:
    """uint8 (N, C, H, W) -> uint8 (N, C, *size), bilinear with antialiasing; unchanged when the size matches."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    out = torch.nn.functional.interpolate(images.float(), size=size, mode="bilinear", antialias=True,
                                          align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


class ImageDataset:
    """Splits held in memory: uint8 images (N, C, H, W) and int64 labels (N,) per split name, the class
    names, and the normalisation ``(x / 255 - mean) / std`` per channel."""

    def __init__(self, splits: dict[str, tuple[Tensor, Tensor]], classes: list[str],
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        if "train" not in splits:
            raise ValueError("an ImageDataset needs a 'train' split")
        self.splits, self.classes = splits, list(classes)
        images = splits["train"][0]
        self.channels, self.image_size = int(images.shape[1]), (int(images.shape[2]), int(images.shape[3]))
        for name, (x, y) in splits.items():
            if len(x) != len(y) or tuple(x.shape[1:]) != tuple(images.shape[1:]):
                raise ValueError(f"split {name!r}: {tuple(x.shape)} images, {len(y)} labels")
        if mean is None or std is None:
            mean, std = channel_stats(images)
        if len(mean) != self.channels or len(std) != self.channels or min(std) <= 0:
            raise DataError(f"data.mean / data.std need {self.channels} value(s) (std > 0), got {list(mean)} / "
                            f"{list(std)}")
        self.mean, self.std = [float(m) for m in mean], [float(s) for s in std]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def size(self, split: str) -> int:
        return len(self.labels(split))

    def images(self, split: str) -> Tensor:
        return self._split(split)[0]

    def labels(self, split: str) -> Tensor:
        return self._split(split)[1]

    def _split(self, split: str) -> tuple[Tensor, Tensor]:
        if split not in self.splits:
            raise DataError(f"this dataset has no {split!r} split; it has {', '.join(self.splits)}")
        return self.splits[split]

    def normalize(self, x: Tensor) -> Tensor:
        """float [0, 1] images (B, C, H, W) -> normalised."""
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std

    def pixels(self, split: str, indices: Tensor) -> Tensor:
        """float32 [0, 1] images (B, C, H, W) of ``indices`` in ``split`` (before normalisation)."""
        return self.images(split)[indices].float().div_(255)


def channel_stats(images: Tensor, chunk: int = 8192) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 images (N, C, H, W) as [0, 1] pixels (float64 sums)."""
    c = images.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    squares = torch.zeros(c, dtype=torch.float64)
    for start in range(0, len(images), chunk):
        x = images[start:start + chunk].double().div_(255).transpose(0, 1).reshape(c, -1)
        total += x.sum(1)
        squares += (x * x).sum(1)
    n = images.numel() // c
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(1e-12).sqrt()
    return mean.tolist(), std.tolist()
