"""Small image-classification datasets as in-memory NumPy arrays.

Two loaders, both returning the same layout so examples can switch between them
by name::

    {"image": float32 [N, H, W, 1] in [0, 1], "label": int32 [N]}

* :func:`load_digits` reads scikit-learn's bundled 8x8 handwritten digits
  (1,797 images, shipped inside the ``scikit-learn`` wheel), so it works offline
  on a fresh machine. It needs the ``examples`` extra.
* :func:`load_mnist` downloads the four standard MNIST ``idx.gz`` files once into
  a cache directory (written atomically, verified by SHA-256) and parses them with
  NumPy. When the machine is offline it says which URL failed and where to put the
  files by hand. ``$DISTRAIN_MNIST_URL`` names another mirror (``$DISTRAIN_DATA_DIR``
  another cache root).

Example::

    from distrain._src.data.datasets import load_digits
    train = load_digits("train")
    train["image"].shape  # (1438, 8, 8, 1)
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_MNIST_URL",
    "MNISTDownloadError",
    "MNIST_FILES",
    "MNIST_SHA256",
    "load_digits",
    "load_mnist",
]

_SPLITS = ("train", "test")

# The mirror TensorFlow Datasets and Keras download from; yann.lecun.com itself now
# refuses most automated downloads. Another commonly used mirror is
# https://ossci-datasets.s3.amazonaws.com/mnist/ (torchvision's).
DEFAULT_MNIST_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"

MNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# Published SHA-256 sums of the original files, as pinned by TensorFlow Datasets'
# MNIST checksums for the default mirror (the ossci mirror serves the same bytes).
MNIST_SHA256: dict[str, str] = {
    "train-images-idx3-ubyte.gz": (
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"
    ),
    "train-labels-idx1-ubyte.gz": (
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"
    ),
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}


class MNISTDownloadError(ConnectionError):
    """An MNIST file is not cached and cannot be downloaded.

    Attributes:
      url: the URL that failed.
      reason: why (the network error, as text).
      cache_dir: where the files are expected.
      missing: the MNIST file names not yet in ``cache_dir`` (all splits).
    """

    def __init__(self, url: str, reason: str, cache_dir: Path, missing: list[str]) -> None:
        self.url, self.reason, self.cache_dir, self.missing = url, reason, cache_dir, missing
        super().__init__(
            f"Could not download {url}: {reason}. If this machine is offline, download "
            f"{', '.join(missing)} from {DEFAULT_MNIST_URL} (or another MNIST mirror) on a "
            f"machine that has access and copy them into {cache_dir}/, or pass base_url= (or "
            "set DISTRAIN_MNIST_URL) pointing at a reachable mirror."
        )


# idx magic numbers: two zero bytes, type code 0x08 (unsigned byte), number of dims.
_IDX_IMAGES_MAGIC = 0x00000803
_IDX_LABELS_MAGIC = 0x00000801


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}; received split={split!r}.")


def load_digits(
    split: str = "train", *, test_fraction: float = 0.2, seed: int = 0
) -> dict[str, np.ndarray]:
    """Loads scikit-learn's bundled 8x8 handwritten digits (offline).

    The split is stratified and seeded: for each class, a permutation drawn from
    ``numpy.random.default_rng(seed)`` puts ``round(test_fraction * n_class)``
    images in the test split and the rest in the training split. The two splits
    are disjoint and together cover all 1,797 images (with the defaults: 1,438
    train / 359 test); rows keep the order of the original data.

    Args:
      split: ``"train"`` or ``"test"``.
      test_fraction: fraction of each class held out for ``"test"``, in (0, 1).
      seed: non-negative seed of the split.

    Returns:
      ``{"image": float32 [N, 8, 8, 1] in [0, 1], "label": int32 [N]}``.

    Raises:
      ImportError: scikit-learn is not installed.
      ValueError: an unknown split, a fraction outside (0, 1) or a negative seed.

    Example::

        test = load_digits("test")
        test["label"][:5]
    """
    _check_split(split)
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(
            f"test_fraction must be in (0, 1); received test_fraction={test_fraction!r}."
        )
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; received seed={seed!r}.")
    pixels, target = _digits_table()
    # Pixel values are integers 0..16 in the bundled data.
    images = (pixels.reshape(-1, 8, 8).astype(np.float32) / 16.0)[..., None]
    labels = target.astype(np.int32)

    rng = np.random.default_rng(seed)
    is_test = np.zeros(labels.shape[0], dtype=bool)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        n_test = int(round(test_fraction * members.size))
        is_test[rng.permutation(members)[:n_test]] = True
    keep = is_test if split == "test" else ~is_test
    return {"image": np.ascontiguousarray(images[keep]), "label": labels[keep]}


def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (pixels [1797, 64], labels [1797]).

    Read from the file scikit-learn ships, found without importing scikit-learn: the
    import costs about 3 s of CPU (scipy, pandas), twice the import of jax, in every
    process that loads the quickstart's data. ``sklearn.datasets.load_digits`` parses the
    same file the same way; a layout where the file is elsewhere goes through it.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError(
            "load_digits needs scikit-learn, which ships the 8x8 digits data. Install it with "
            "`pip install 'distrain[examples]'` (or `pip install scikit-learn`)."
        )
    for root in spec.submodule_search_locations or []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1]
    from sklearn import datasets as sk_datasets

    bunch = sk_datasets.load_digits()
    return np.asarray(bunch.data), np.asarray(bunch.target)


def _default_cache_dir() -> Path:
    root = os.environ.get("DISTRAIN_DATA_DIR")
    if root:
        return Path(root) / "mnist"
    return Path.home() / ".cache" / "distrain" / "mnist"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _missing_files(cache_dir: Path) -> list[str]:
    return [n for pair in MNIST_FILES.values() for n in pair if not (cache_dir / n).exists()]


def _download(url: str, dest: Path, expected_sha256: str, timeout: float) -> None:
    """Downloads ``url`` to ``dest`` atomically: a temporary file, checked, then renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                for chunk in iter(lambda: resp.read(1 << 20), b""):
                    digest.update(chunk)
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as e:
            reason = str(getattr(e, "reason", None) or e)
            raise MNISTDownloadError(url, reason, dest.parent, _missing_files(dest.parent)) from e
        got = digest.hexdigest()
        if got != expected_sha256:
            raise ValueError(
                f"Checksum mismatch for {url}: expected sha256 {expected_sha256}, received "
                f"{got}. The download was discarded; check base_url (a mirror serving other "
                "files) or the checksums argument."
            )
        os.replace(tmp, dest)  # atomic on POSIX and Windows: no half-written file in the cache
    finally:
        tmp.unlink(missing_ok=True)


def _parse_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    """Parses a gzipped idx file of unsigned bytes; raises ValueError if it is malformed."""
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:
        raise ValueError(f"{path} is not a valid gzip file ({e}).") from e
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path} is too short for an idx header: {len(raw)} bytes.")
    got_magic = int.from_bytes(raw[:4], "big")
    if got_magic != magic:
        raise ValueError(
            f"{path} has idx magic number 0x{got_magic:08x}; expected 0x{magic:08x} "
            f"(unsigned bytes, {ndim} dimension(s))."
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(
            f"{path} declares shape {dims} ({expected} bytes with the header) but holds "
            f"{len(raw)} bytes."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _fetch(
    name: str, cache_dir: Path, base_url: str, checksums: Mapping[str, str], timeout: float
) -> Path:
    if name not in checksums:
        raise ValueError(
            f"checksums has no entry for {name!r}; expected keys {sorted(MNIST_SHA256)}, "
            f"received {sorted(checksums)}."
        )
    expected = checksums[name]
    path = cache_dir / name
    if path.exists():
        got = _sha256(path)
        if got != expected:
            path.unlink()
            raise ValueError(
                f"Cached file {path} is corrupt: sha256 {got}, expected {expected}. It was "
                "deleted; call again to download it afresh."
            )
        return path
    url = base_url.rstrip("/") + "/" + name
    _download(url, path, expected, timeout)
    return path


def load_mnist(
    split: str = "train",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    base_url: str | None = None,
    checksums: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> dict[str, np.ndarray]:
    """Loads MNIST, downloading the idx.gz files into a cache on first use.

    The files (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``) are fetched from
    ``base_url``, written to a temporary file in the cache directory and renamed
    only after their SHA-256 matches ``checksums`` (the published sums,
    :data:`MNIST_SHA256`, by default). A cached file whose checksum or idx header
    is wrong is deleted and an error raised, so the next call downloads it again.

    To use MNIST offline, copy the four files into the cache directory by hand.

    Args:
      split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
      cache_dir: where the files live. Default: ``$DISTRAIN_DATA_DIR/mnist`` when
        that variable is set, else ``~/.cache/distrain/mnist``.
      base_url: mirror to download from; the file names are appended to it. Default:
        ``$DISTRAIN_MNIST_URL`` when that variable is set, else :data:`DEFAULT_MNIST_URL`.
      checksums: file name -> expected SHA-256 hex digest. Override only for a
        mirror that serves other bytes (or in tests).
      timeout: seconds to wait on the network per request.

    Returns:
      ``{"image": float32 [N, 28, 28, 1] in [0, 1], "label": int32 [N]}``.

    Raises:
      MNISTDownloadError: (a ``ConnectionError``) a file is not cached and its URL
        cannot be fetched; the message names the URL, the missing files and the
        directory to place them in by hand.
      ValueError: a checksum mismatch or a corrupt idx file (deleted), or an
        unknown split.

    Example::

        train = load_mnist("train")  # ~11 MB download on the first call
        train["image"].shape  # (60000, 28, 28, 1)
    """
    _check_split(split)
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if base_url is None:
        base_url = os.environ.get("DISTRAIN_MNIST_URL") or DEFAULT_MNIST_URL
    sums = MNIST_SHA256 if checksums is None else checksums
    images_name, labels_name = MNIST_FILES[split]

    arrays = []
    for name, magic, ndim in (
        (images_name, _IDX_IMAGES_MAGIC, 3),
        (labels_name, _IDX_LABELS_MAGIC, 1),
    ):
        path = _fetch(name, cache, base_url, sums, timeout)
        try:
            arrays.append(_parse_idx(path, magic, ndim))
        except ValueError as e:
            path.unlink(missing_ok=True)
            raise ValueError(
                f"Corrupt MNIST file: {e} It was deleted; call again to download it afresh."
            ) from e
    images, labels = arrays
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"MNIST {split} split has {images.shape[0]} images but {labels.shape[0]} labels in "
            f"{cache}; delete the files there to download them again."
        )
    return {
        "image": (images.astype(np.float32) / 255.0)[..., None],
        "label": labels.astype(np.int32),
    }
