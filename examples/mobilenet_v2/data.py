"""Images for the MobileNetV2 example: synthetic stripes offline, cats vs dogs when available.

Both loaders return ``{"image": uint8 [N, S, S, 3], "label": int32 [N]}``; images stay
``uint8`` in memory (a quarter of float32) and the train step scales them to [0, 1].

* :func:`make_stripes` draws a two-class task with NumPy: a circle or a square (at
  random; radius or half-side 5-10 px) of random colour and position on a noisy
  background of another random colour, painted with **horizontal** (label 0) or
  **vertical** (label 1) stripes 2-3 px wide at a random phase. Colour, brightness,
  outline and position are drawn independently of the label, so only the stripes'
  orientation tells the classes apart: a model must learn oriented edge detectors.
* :func:`load_cats_vs_dogs` reads the real data set of seed ``004``
  (``tfds.load("cats_vs_dogs")``): either the Microsoft/Kaggle archive unpacked into a
  directory (``PetImages/Cat/*.jpg``, ``PetImages/Dog/*.jpg``; decoded with Pillow) or,
  without a directory, ``tensorflow_datasets`` if it is installed (it downloads the
  same 786 MB archive once).

Example:
  >>> train = make_stripes(512, image_size=32, seed=0)
  >>> train["image"].shape, train["label"][:4]  # doctest: +SKIP
  ((512, 32, 32, 3), array([0, 1, 1, 0], dtype=int32))
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

CLASS_NAMES = {"stripes": ("horizontal", "vertical"), "cats_vs_dogs": ("cat", "dog")}
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def make_stripes(
    num_examples: int, *, image_size: int = 32, seed: int = 0
) -> dict[str, np.ndarray]:
    """Generates the two-class stripes task (see the module docstring); balanced, seeded."""
    if num_examples < 1 or image_size < 24:
        raise ValueError(
            f"Expected num_examples >= 1 and image_size >= 24 (the shapes are up to 21 px "
            f"wide); received num_examples={num_examples}, image_size={image_size}."
        )
    rng = np.random.default_rng(seed)
    n, s = num_examples, image_size
    labels = rng.permutation(np.arange(n) % 2).astype(np.int32)
    background = rng.uniform(0, 160, size=(n, 1, 1, 3))
    noise = rng.normal(0, 20, size=(n, s, s, 3))
    colour = rng.uniform(60, 255, size=(n, 1, 1, 3))
    # The outline (a circle of radius r or a square of half-side r) is a nuisance variable.
    r = rng.uniform(5, 10, n)
    margin = np.ceil(r).astype(int) + 1
    cy, cx = rng.integers(margin, s - margin), rng.integers(margin, s - margin)
    yy, xx = np.mgrid[0:s, 0:s]
    dy, dx, r = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None], r[:, None, None]
    square = rng.integers(0, 2, n)[:, None, None] == 1
    inside = np.where(square, (np.abs(dy) <= r) & (np.abs(dx) <= r), dy**2 + dx**2 <= r**2)
    # Stripes 2-3 px wide with a random phase, across y (label 0) or x (label 1).
    width = rng.integers(2, 4, n)[:, None, None]
    phase = rng.integers(0, 6, n)[:, None, None]
    across = np.where(labels[:, None, None] == 1, xx[None], yy[None])
    stripe = (across + phase) // width % 2 == 0
    images = np.where((inside & stripe)[..., None], colour, background) + noise
    return {"image": np.clip(images, 0, 255).astype(np.uint8), "label": labels}


def _resize_rgb(path: Path, image_size: int) -> np.ndarray:
    from PIL import Image  # only this loader needs Pillow

    with Image.open(path) as img:
        img = img.convert("RGB").resize((image_size, image_size), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.uint8)


def _class_dirs(data_dir: Path) -> tuple[Path, Path]:
    for root in (data_dir / "PetImages", data_dir):
        cat, dog = root / "Cat", root / "Dog"
        if cat.is_dir() and dog.is_dir():
            return cat, dog
    raise FileNotFoundError(
        f"Expected the cats-vs-dogs images in {data_dir}/PetImages/{{Cat,Dog}}/ or "
        f"{data_dir}/{{Cat,Dog}}/ (the layout of Microsoft's kagglecatsanddogs archive); "
        f"found neither. Unzip the archive there, or pass data_dir=None to use "
        "tensorflow_datasets."
    )


def load_cats_vs_dogs(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    image_size: int = 32,
    limit_per_class: int | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Loads cats (label 0) and dogs (label 1), resized to ``image_size`` squares.

    Args:
      data_dir: a directory holding ``PetImages/Cat`` and ``PetImages/Dog`` (or ``Cat``
        and ``Dog``) of JPEGs, read with Pillow. ``None`` uses ``tensorflow_datasets``'
        ``cats_vs_dogs`` (train split, the only one it has).
      image_size: side of the square the images are resized to (bilinear, no crop).
      limit_per_class: read at most this many files per class (files in sorted order).

    Returns:
      ``(data, skipped)``: the arrays in file order (cats, then dogs) and how many
      files could not be decoded. The archive contains some broken files;
      ``tensorflow_datasets`` drops 1,738 of its 25,000 for the same reason.

    Raises:
      FileNotFoundError: ``data_dir`` lacks the class folders.
      ImportError: Pillow (for ``data_dir``) or ``tensorflow_datasets`` (without it)
        is not installed.
      ValueError: no image could be decoded.
    """
    if data_dir is None:
        return _load_tfds(image_size, limit_per_class)
    try:
        import PIL  # noqa: F401
    except ImportError as e:
        raise ImportError("Reading cats-vs-dogs JPEGs needs Pillow: `pip install pillow`.") from e
    images, labels, skipped = [], [], 0
    for label, folder in enumerate(_class_dirs(Path(data_dir))):
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        for path in files[:limit_per_class]:
            try:
                images.append(_resize_rgb(path, image_size))
            except (OSError, ValueError):  # truncated or non-image files in the archive
                skipped += 1
                continue
            labels.append(label)
    if not images:
        raise ValueError(
            f"No image in {data_dir} could be decoded ({skipped} files tried). Check that the "
            "archive was unpacked completely."
        )
    return {"image": np.stack(images), "label": np.asarray(labels, np.int32)}, skipped


def _load_tfds(image_size: int, limit_per_class: int | None) -> tuple[dict[str, np.ndarray], int]:
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "load_cats_vs_dogs(data_dir=None) reads the data through tensorflow_datasets, which "
            "is not installed. Either `pip install tensorflow tensorflow-datasets` (downloads "
            "786 MB once), or download Microsoft's kagglecatsanddogs archive, unzip it and pass "
            "its directory as data_dir."
        ) from e
    from PIL import Image

    images, labels, counts = [], [], [0, 0]
    for image, label in tfds.as_numpy(tfds.load("cats_vs_dogs", split="train", as_supervised=True)):
        if limit_per_class is not None and counts[int(label)] >= limit_per_class:
            continue
        counts[int(label)] += 1
        img = Image.fromarray(image).resize((image_size, image_size), Image.Resampling.BILINEAR)
        images.append(np.asarray(img, dtype=np.uint8))
        labels.append(int(label))
    return {"image": np.stack(images), "label": np.asarray(labels, np.int32)}, 0


def split(data: dict[str, np.ndarray], test_fraction: float, seed: int) -> tuple[dict, dict]:
    """A seeded random ``(train, test)`` split of a dict of arrays."""
    n = len(data["label"])
    perm = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    test, train = perm[:n_test], perm[n_test:]
    return ({k: v[train] for k, v in data.items()}, {k: v[test] for k, v in data.items()})
