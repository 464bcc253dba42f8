"""Dataset loaders: bundled digits; MNIST download, cache and checksums over a local HTTP server."""

import contextlib
import functools
import gzip
import hashlib
import http.server
import threading
from collections import Counter

import numpy as np
import pytest

import distrain._src.data.datasets as datasets
from distrain._src.cluster.launch import free_port
from distrain._src.data.datasets import MNIST_FILES
from distrain.data import load_digits, load_mnist

# --------------------------------------------------------------------------- digits


def test_load_digits_shapes_ranges_and_determinism():
    train, test = load_digits("train"), load_digits("test")
    assert train["image"].shape == (1438, 8, 8, 1) and test["image"].shape == (359, 8, 8, 1)
    assert train["image"].dtype == np.float32 and train["label"].dtype == np.int32
    assert train["image"].min() == 0.0 and train["image"].max() == 1.0
    assert set(np.unique(train["label"])) == set(range(10)) == set(np.unique(test["label"]))
    # Stratified: every class is ~20% test.
    counts = np.bincount(test["label"], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    again = load_digits("train")
    np.testing.assert_array_equal(again["image"], train["image"])
    other = load_digits("train", seed=1)
    assert not np.array_equal(other["image"], train["image"])


def test_load_digits_splits_are_disjoint_and_cover_everything():
    from sklearn.datasets import load_digits as sk_load_digits

    train, test = load_digits("train", seed=3), load_digits("test", seed=3)
    rows = lambda images, labels: Counter(  # noqa: E731
        np.asarray(img, np.float32).tobytes() + bytes([int(lbl)])
        for img, lbl in zip(images, labels, strict=True)
    )
    source = sk_load_digits()
    # As multisets, train + test is exactly the source data: a partition, no row twice.
    assert rows(train["image"][..., 0], train["label"]) + rows(
        test["image"][..., 0], test["label"]
    ) == rows(source.images / 16.0, source.target)


def test_load_digits_bad_arguments():
    with pytest.raises(
        ValueError, match=r"split must be one of \('train', 'test'\); received split='val'"
    ):
        load_digits("val")
    with pytest.raises(
        ValueError, match=r"test_fraction must be in \(0, 1\); received test_fraction=1.5"
    ):
        load_digits("test", test_fraction=1.5)
    with pytest.raises(ValueError, match=r"seed must be a non-negative int; received seed=-2"):
        load_digits(seed=-2)


def test_load_digits_without_sklearn_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` raise ImportError
    with pytest.raises(ImportError, match=r"distrain\[examples\]"):
        load_digits()


def test_load_digits_reads_sklearns_file_without_importing_sklearn(tmp_path, monkeypatch):
    """The quickstart's processes skip scikit-learn's import (3 s of CPU): the table comes
    from the file it ships, equal to its loader's; where the file is not found, through
    the loader."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_load_digits

    code = (
        "import sys; from distrain.data import load_digits; load_digits(); "
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]
    pixels, labels = datasets._digits_table()
    source = sk_load_digits()
    np.testing.assert_array_equal(pixels, source.data)
    np.testing.assert_array_equal(labels, source.target)
    spec = datasets.importlib.util.find_spec("sklearn")
    moved = type(spec)(spec.name, spec.loader, is_package=True)
    moved.submodule_search_locations = [str(tmp_path)]  # no datasets/data/digits.csv.gz
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: moved)
    pixels_elsewhere, _ = datasets._digits_table()
    np.testing.assert_array_equal(pixels_elsewhere, source.data)


# --------------------------------------------------------------------------- MNIST

_N = 5


def _idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    return gzip.compress(header + payload)


def _make_mnist(root, n=_N, labels_n=None):
    """Writes the four MNIST files (n 28x28 images each) and returns (checksums, arrays)."""
    rng = np.random.default_rng(0)
    sums, arrays = {}, {}
    for split, (img_name, lbl_name) in MNIST_FILES.items():
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, labels_n or n, dtype=np.uint8)
        for name, blob in (
            (img_name, _idx(0x803, (n, 28, 28), images.tobytes())),
            (lbl_name, _idx(0x801, (len(labels),), labels.tobytes())),
        ):
            (root / name).write_bytes(blob)
            sums[name] = hashlib.sha256(blob).hexdigest()
        arrays[split] = (images, labels)
    return sums, arrays


@contextlib.contextmanager
def _serve(directory):
    """A real HTTP server on 127.0.0.1 (free port) serving `directory`; yields its base URL."""

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mnist/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "www" / "mnist"
    root.mkdir(parents=True)
    sums, arrays = _make_mnist(root)
    with _serve(tmp_path / "www") as url:
        yield url, root, sums, arrays


def test_load_mnist_downloads_caches_and_parses(mirror, tmp_path):
    url, root, sums, arrays = mirror
    cache = tmp_path / "cache"
    for split in ("train", "test"):
        out = load_mnist(split, cache_dir=cache, base_url=url, checksums=sums)
        images, labels = arrays[split]
        assert out["image"].shape == (_N, 28, 28, 1) and out["image"].dtype == np.float32
        assert out["label"].dtype == np.int32
        np.testing.assert_allclose(out["image"][..., 0], images / np.float32(255.0))
        np.testing.assert_array_equal(out["label"], labels)
    assert sorted(p.name for p in cache.iterdir()) == sorted(sums)  # no leftover temp files
    # Cached: works with the mirror gone.
    for f in root.iterdir():
        f.unlink()
    again = load_mnist("train", cache_dir=cache, base_url=url, checksums=sums)
    np.testing.assert_array_equal(again["label"], arrays["train"][1])


def test_load_mnist_default_cache_dir_from_env(mirror, tmp_path, monkeypatch):
    url, _, sums, _ = mirror
    monkeypatch.setenv("DISTRAIN_DATA_DIR", str(tmp_path / "data"))
    load_mnist("test", base_url=url, checksums=sums)
    assert (tmp_path / "data" / "mnist" / "t10k-images-idx3-ubyte.gz").exists()


def test_load_mnist_checksum_mismatch(mirror, tmp_path):
    url, _, sums, _ = mirror
    bad = dict(sums, **{"t10k-images-idx3-ubyte.gz": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(
        ValueError, match=r"Checksum mismatch for http://127\.0\.0\.1:\d+/mnist/t10k-images"
    ):
        load_mnist("test", cache_dir=cache, base_url=url, checksums=bad)
    assert not any(cache.iterdir())  # nothing half-written or unverified kept


def test_load_mnist_corrupt_cached_file_is_deleted_then_redownloaded(mirror, tmp_path):
    url, _, sums, arrays = mirror
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(b"truncated")
    with pytest.raises(
        ValueError, match=r"t10k-labels-idx1-ubyte.gz is corrupt: sha256 .* deleted"
    ):
        load_mnist("test", cache_dir=cache, base_url=url, checksums=sums)
    assert not path.exists()
    out = load_mnist("test", cache_dir=cache, base_url=url, checksums=sums)
    np.testing.assert_array_equal(out["label"], arrays["test"][1])


def test_load_mnist_bad_idx_magic_is_deleted(tmp_path):
    www = tmp_path / "www" / "mnist"
    www.mkdir(parents=True)
    sums, _ = _make_mnist(www)
    blob = _idx(0x802, (_N, 28, 28), bytes(_N * 784))  # wrong type code
    (www / "train-images-idx3-ubyte.gz").write_bytes(blob)
    sums["train-images-idx3-ubyte.gz"] = hashlib.sha256(blob).hexdigest()
    cache = tmp_path / "cache"
    with _serve(tmp_path / "www") as url:
        with pytest.raises(ValueError, match=r"magic number 0x00000802; expected 0x00000803"):
            load_mnist("train", cache_dir=cache, base_url=url, checksums=sums)
    assert not (cache / "train-images-idx3-ubyte.gz").exists()


def test_load_mnist_truncated_idx_and_count_mismatch(tmp_path):
    www = tmp_path / "www" / "mnist"
    www.mkdir(parents=True)
    sums, _ = _make_mnist(www, labels_n=_N + 1)  # one label too many
    short = _idx(0x803, (_N, 28, 28), bytes(10))
    (www / "t10k-images-idx3-ubyte.gz").write_bytes(short)
    sums["t10k-images-idx3-ubyte.gz"] = hashlib.sha256(short).hexdigest()
    with _serve(tmp_path / "www") as url:
        with pytest.raises(ValueError, match=r"declares shape \(5, 28, 28\) .* but holds 26 bytes"):
            load_mnist("test", cache_dir=tmp_path / "c", base_url=url, checksums=sums)
        with pytest.raises(ValueError, match=r"has 5 images but 6 labels"):
            load_mnist("train", cache_dir=tmp_path / "c", base_url=url, checksums=sums)


def test_load_mnist_unreachable_says_url_and_cache(tmp_path):
    port = free_port()  # free a moment ago: nothing listens there
    url = f"http://127.0.0.1:{port}/mnist/"
    cache = tmp_path / "cache"
    with pytest.raises(ConnectionError) as info:
        load_mnist("train", cache_dir=cache, base_url=url, timeout=5)
    msg = str(info.value)
    assert f"Could not download {url}train-images-idx3-ubyte.gz" in msg
    assert f"copy them into {cache}/" in msg
    assert not any(cache.iterdir())


def test_load_mnist_bad_arguments(tmp_path):
    with pytest.raises(
        ValueError, match=r"split must be one of \('train', 'test'\); received split='dev'"
    ):
        load_mnist("dev", cache_dir=tmp_path)
    with pytest.raises(
        ValueError, match=r"checksums has no entry for 'train-images-idx3-ubyte.gz'"
    ):
        load_mnist("train", cache_dir=tmp_path, checksums={})


def test_published_checksums_are_pinned():
    assert set(datasets.MNIST_SHA256) == {n for pair in MNIST_FILES.values() for n in pair}
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in datasets.MNIST_SHA256.values())


def test_docs_state_the_true_digits_split():
    """The 1,438 / 359 split the code makes is what the owned docs and configs state."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    n_train, n_test = len(load_digits("train")["label"]), len(load_digits("test")["label"])
    assert (n_train, n_test) == (1438, 359)
    files = ["docs/getting_started.md", "configs/quickstart.yaml", "distrain/_src/data/datasets.py"]
    for name in files:
        text = (root / name).read_text()
        for wrong in re.findall(r"\b1,?437\b|\b360 test\b", text):
            raise AssertionError(f"{name} states {wrong!r}; load_digits gives {n_train}/{n_test}")
    guide = (root / "docs/getting_started.md").read_text()
    assert f"{n_train:,} training" in guide and f"{n_test} test" in guide
    quick = (root / "configs/quickstart.yaml").read_text()
    assert f"{n_train} train / {n_test} test" in quick
