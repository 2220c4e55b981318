"""Image readers: IDX (MNIST), digits CSV, class folders; the in-memory dataset."""

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenloom.data.images import (
    ImageDataset,
    channel_stats,
    holdout_split,
    read_digits,
    read_idx,
    read_image_folder,
    read_mnist,
    write_idx,
)
from tokenloom.errors import DataError

REPO = Path(__file__).resolve().parents[2]


def tiny_mnist(root: Path, n: int = 12, gz: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    suffix = ".gz" if gz else ""
    for split in ("train", "t10k"):
        write_idx(root / f"{split}-images-idx3-ubyte{suffix}", images)
        write_idx(root / f"{split}-labels-idx1-ubyte{suffix}", labels)
    return images, labels


@pytest.mark.parametrize("name", ["x.idx", "x.idx.gz"])
def test_idx_round_trip(tmp_path, name):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / name, array)
    raw = path.read_bytes()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    assert raw[:4] == bytes([0, 0, 8, 3]) and int.from_bytes(raw[4:8], "big") == 2
    np.testing.assert_array_equal(read_idx(path), array)
    ints = np.array([[1, -2], [70000, 5]], dtype=np.int32)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "i.idx", ints)), ints)


def test_idx_errors_name_the_file(tmp_path):
    good = write_idx(tmp_path / "a.idx", np.zeros((3, 4, 4), np.uint8)).read_bytes()
    cases = {
        "magic.idx": (b"\x01\x02" + good[2:], "not an IDX file (magic number 0x01020803"),
        "short.idx": (good[:-5], "is truncated: 59 bytes, its header (dims 3x4x4) needs 64"),
        "long.idx": (good + b"\0", "corrupt (trailing bytes)"),
        "header.idx": (good[:9], "shorter than its 16-byte IDX header"),
        "cut.gz": (gzip.compress(good)[:-12], "truncated or corrupt gzip file"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=re.escape(message)) as err:
            read_idx(tmp_path / name)
        assert str(tmp_path / name) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DataError, match="data file not found"):
        read_idx(tmp_path / "missing.idx")


@pytest.mark.parametrize("gz", [True, False])
def test_read_mnist(tmp_path, gz):
    images, labels = tiny_mnist(tmp_path, gz=gz)
    x, y = read_mnist(tmp_path, "train")
    assert x.shape == (12, 1, 28, 28) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x[:, 0], torch.from_numpy(images)) and torch.equal(y, torch.from_numpy(labels).long())


def test_read_mnist_mismatches(tmp_path):
    tiny_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(11, np.uint8))
    with pytest.raises(DataError, match="holds 12 images but .* 11 labels"):
        read_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros((12, 2), np.uint8))
    with pytest.raises(DataError, match="expected uint8 labels"):
        read_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError, match="MNIST file not found: .*t10k-images-idx3-ubyte"):
        read_mnist(tmp_path, "test")


def test_bundled_mnist_headers():
    """The vendored files parse (labels only: the 47 MB of training images would slow the suite)."""
    labels = read_idx(REPO / "data" / "mnist" / "t10k-labels-idx1-ubyte.gz")
    assert labels.shape == (10000,) and labels.max() == 9
    assert np.bincount(labels).tolist()[:3] == [980, 1135, 1032]


def test_read_digits_bundled_and_split():
    x, y = read_digits(REPO / "data" / "digits" / "digits.csv.gz")
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.uint8 and int(x.max()) == 255
    assert torch.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    test, val, train = holdout_split(len(y), [360, 180], seed=0)
    assert (len(test), len(val), len(train)) == (360, 180, 1257)
    assert torch.equal(torch.cat([test, val, train]).sort().values, torch.arange(1797))
    again = holdout_split(len(y), [360, 180], seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again, [test, val, train], strict=True))
    assert not torch.equal(holdout_split(len(y), [360, 180], seed=1)[0], test)


def test_read_digits_errors(tmp_path):
    bad = tmp_path / "d.csv"
    bad.write_text("0," * 64 + "3\n" + "0," * 63 + "3\n")
    with pytest.raises(DataError, match="line 2: expected 65 values"):
        read_digits(bad)
    bad.write_text("0," * 63 + "17,3\n")
    with pytest.raises(DataError, match="line 1: pixels must be 0..16"):
        read_digits(bad)
    bad.write_text("")
    with pytest.raises(DataError, match="empty"):
        read_digits(bad)
    with pytest.raises(DataError, match="cannot hold out"):
        holdout_split(10, [5, 5])


def save_png(path: Path, size=(8, 8), mode="L", value=None, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size[0], size[1]) if mode == "L" else (size[0], size[1], len(mode))
    arr = rng.integers(0, 256, shape, dtype=np.uint8) if value is None else np.full(shape, value, np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)  # the mode follows the shape: L, RGB, RGBA
    return arr


def test_image_folder(tmp_path):
    a = save_png(tmp_path / "cat" / "1.png", seed=1)
    save_png(tmp_path / "cat" / "2.png", seed=2)
    save_png(tmp_path / "dog" / "1.png", seed=3)
    (tmp_path / "dog" / "notes.txt").write_text("not an image")  # ignored
    x, y, classes, size, channels = read_image_folder(tmp_path)
    assert classes == ["cat", "dog"] and y.tolist() == [0, 0, 1] and size == (8, 8) and channels == 1
    assert x.shape == (3, 1, 8, 8) and torch.equal(x[0, 0], torch.from_numpy(a))


def test_image_folder_converts_with_one_warning_or_refuses(tmp_path):
    save_png(tmp_path / "a" / "1.png")
    save_png(tmp_path / "a" / "2.png", size=(10, 12), mode="RGB")
    save_png(tmp_path / "b" / "1.png", mode="RGBA")
    with pytest.warns(UserWarning, match=r"2 image\(s\) converted to 8x8 L \(e.g. 2.png: mode RGB -> L, size 10x12"):
        x, *_ = read_image_folder(tmp_path)
    assert x.shape == (3, 1, 8, 8)
    with pytest.warns(UserWarning, match="3 image"):
        x, _, _, size, channels = read_image_folder(tmp_path, image_size=(4, 4), channels=3)
    assert x.shape == (3, 3, 4, 4) and size == (4, 4) and channels == 3
    with pytest.raises(DataError, match=r"2.png: mode RGB but expected L, size 10x12 but expected 8x8"):
        read_image_folder(tmp_path, mismatch="error")


def test_image_folder_errors(tmp_path):
    with pytest.raises(DataError, match="image folder not found"):
        read_image_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no class subfolders"):
        read_image_folder(tmp_path / "empty")
    save_png(tmp_path / "data" / "a" / "1.png")
    (tmp_path / "data" / "b").mkdir()
    with pytest.raises(DataError, match=r"class folder .*data/b has no images"):
        read_image_folder(tmp_path / "data")
    (tmp_path / "data" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(DataError, match=r"cannot read image .*broken.png") as err:
        read_image_folder(tmp_path / "data")
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="class folder 'b' is not one of the classes"):
        read_image_folder(tmp_path / "data", classes=["a", "c"])


def test_dataset_normalisation():
    x = torch.randint(0, 256, (20, 3, 4, 4), dtype=torch.uint8)
    mean, std = channel_stats(x)
    pixels = x.double() / 255
    torch.testing.assert_close(torch.tensor(mean, dtype=torch.float64), pixels.mean((0, 2, 3)))
    torch.testing.assert_close(torch.tensor(std, dtype=torch.float64), pixels.std((0, 2, 3), unbiased=False))
    data = ImageDataset({"train": (x, torch.zeros(20, dtype=torch.long))}, ["a", "b"])
    out = data.normalize(data.pixels("train", torch.arange(20)))
    torch.testing.assert_close(out.mean((0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std((0, 2, 3), unbiased=False), torch.ones(3), atol=1e-4, rtol=0)
    with pytest.raises(DataError, match="no 'test' split"):
        data.images("test")
    with pytest.raises(DataError, match="need 3 value"):
        ImageDataset({"train": (x, torch.zeros(20, dtype=torch.long))}, ["a", "b"], mean=[0.5], std=[0.5])
