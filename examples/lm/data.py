"""Byte-level text corpora for the LM example, packed into fixed-length sequences.

* :func:`python_corpus`: text that ships with every Python installation and needs no
  download: the standard library's source (``sysconfig.get_paths()["stdlib"]``, without
  ``site-packages``) and any docs under ``sys.base_prefix`` (``share/doc``, ``share/man``),
  ~30 MB on CPython 3.11. Each file is a document; a document is held out when a hash
  of its relative path says so, so the split is the same on every machine, in any file
  order, and no file is in both splits.
* :func:`load_tinyshakespeare`: the public TinyShakespeare corpus (1,115,394 bytes),
  downloaded once into a cache with a SHA-256 check (``$DISTRAIN_DATA_DIR/lm`` or
  ``~/.cache/distrain/lm``), split 90/10 by position.
* :func:`pack`: documents -> one byte stream (documents separated by byte 0, which
  text files never hold) -> rows of ``seq_len + 1`` bytes, consecutive rows
  overlapping by one byte, so each byte after the first is a target exactly once.
  Inputs are ``row[:-1]``, targets ``row[1:]``.

* :func:`pack_stream`: one text -> rows of ``seq_len`` inputs and targets in which every
  byte after the first is a target exactly once, the last row padded (segment id 0)
  rather than dropped: a held-out loss over the whole text
  (``tinyshakespeare_splits(whole_test=True)``).

* :func:`pack_documents`: documents -> rows of exactly ``seq_len`` tokens, several
  documents per row, each with its own segment id (0 = padding) and positions that
  restart at 0: attention never crosses a document (``segment_ids`` to the
  attention), and a row wastes almost nothing on padding (>= 99% real text on the
  stdlib corpus at ``seq_len=128``; see :func:`real_text_fraction`).

Rows are ``uint8`` (4x smaller than int32 on the host and in transfers); the step
casts them to int32.

Why packing is done once, into arrays, rather than as a grain transformation in the
input stream: distrain's data position is a pure function of ``(seed, step, global
batch size)`` (``dt.data.ArrayPipeline``), restorable on any process count. grain's
packers (``grain.experimental.FirstFitPackIterDataset``, ``ConcatThenSplitIterDataset``)
are ``IterDataset``s: their state (``{"parent": {"next_index": ...}, "next_row": ...,
"counter": ...}``) is a position in one process's sequential stream, which restores
only on the same process count and input order, and reaching step ``n`` means
replaying the packer from the start. So grain's first-fit packer is run once here,
deterministically, over each document's last (short) piece, and the packed rows are
then an ordinary array dataset: shuffled, sharded and resumed exactly like any other.

Example:
  >>> splits = stdlib_splits(seq_len=128)
  >>> splits["train"]["tokens"].shape        # (~240000, 129) uint8
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "SEPARATOR",
    "TINYSHAKESPEARE_SHA256",
    "TINYSHAKESPEARE_URL",
    "is_held_out",
    "list_documents",
    "load_tinyshakespeare",
    "pack",
    "pack_documents",
    "pack_stream",
    "real_text_fraction",
    "stdlib_packed_splits",
    "python_corpus",
    "stdlib_splits",
    "tinyshakespeare_splits",
]

SEPARATOR = 0  # byte between documents (NUL: absent from the text files we keep)
TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".rst", ".md", ".html", ".1")
TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_BYTES = 1_115_394


def default_roots() -> list[tuple[str, Path]]:
    """``(name, directory)`` of the text shipped with this Python: stdlib and docs."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    for sub in ("share/doc", "share/man"):
        p = Path(sys.base_prefix) / sub
        if p.is_dir():
            roots.append((sub, p))
    return roots


def list_documents(
    roots: Sequence[tuple[str, str | os.PathLike[str]]] | None = None,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
) -> list[tuple[str, Path]]:
    """``(document id, path)`` of every text file under ``roots``, sorted by id.

    The id is ``"<root name>/<path relative to the root>"``: it names a document the
    same way on every machine with this Python version. ``site-packages`` and
    ``dist-packages`` (what the user installed, not what ships) and ``__pycache__`` are
    skipped.
    """
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for name, root in roots if roots is not None else default_roots():
        root = Path(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            for f in filenames:
                if f.endswith(tuple(suffixes)):
                    p = Path(dirpath) / f
                    if p.is_file():
                        out.append((f"{name}/{p.relative_to(root).as_posix()}", p))
    return sorted(out)


def is_held_out(doc_id: str, heldout_fraction: float) -> bool:
    """Whether ``doc_id`` belongs to the held-out split (a hash of the id, not an RNG)."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2.0**64 < heldout_fraction


def read_text(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text without NUL bytes, else ``None``."""
    try:
        raw = path.read_bytes()
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return raw if raw and bytes([SEPARATOR]) not in raw else None


def python_corpus(
    heldout_fraction: float = 0.01,
    *,
    roots: Sequence[tuple[str, str | os.PathLike[str]]] | None = None,
    max_documents: int | None = None,
) -> dict[str, list[bytes]]:
    """``{"train": [doc, ...], "test": [doc, ...]}``: the text shipped with Python.

    Args:
      heldout_fraction: share of documents (by id hash) in ``test``.
      roots: ``(name, directory)`` pairs to read instead of :func:`default_roots`.
      max_documents: read only the first this many documents (sorted by id); for tests.

    Raises:
      ValueError: ``heldout_fraction`` outside (0, 1), or a split ends up empty.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(
            f"heldout_fraction must be in (0, 1); received heldout_fraction={heldout_fraction!r}."
        )
    docs = list_documents(roots)
    if max_documents is not None:
        docs = docs[:max_documents]
    splits: dict[str, list[bytes]] = {"train": [], "test": []}
    for doc_id, path in docs:
        raw = read_text(path)
        if raw is not None:
            splits["test" if is_held_out(doc_id, heldout_fraction) else "train"].append(raw)
    for name, split in splits.items():
        if not split:
            raise ValueError(
                f"The {name!r} split is empty: {len(docs)} documents were found under "
                f"{[str(r) for _, r in (roots or default_roots())]} with heldout_fraction="
                f"{heldout_fraction}. Give more documents or another heldout_fraction."
            )
    return splits


def pack(docs: Iterable[bytes], seq_len: int, *, max_rows: int | None = None) -> np.ndarray:
    """Documents -> ``uint8[rows, seq_len + 1]``, joined by :data:`SEPARATOR`.

    Row ``i`` is ``stream[i * seq_len : i * seq_len + seq_len + 1]``; the tail that does
    not fill a row is dropped (at most ``seq_len`` bytes). ``max_rows`` keeps that many
    rows evenly spaced over the stream (a sample of every part of the text, not its
    first documents only).

    Raises:
      ValueError: ``seq_len < 1``, or the text is shorter than one row.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int; received seq_len={seq_len!r}.")
    stream = np.frombuffer(bytes([SEPARATOR]).join(docs), dtype=np.uint8)
    rows = (stream.size - 1) // seq_len
    if rows < 1:
        raise ValueError(
            f"The text has {stream.size} bytes, fewer than one sequence of seq_len + 1 = "
            f"{seq_len + 1}. Use a shorter seq_len or more text."
        )
    starts = np.arange(rows)
    if max_rows is not None and max_rows < rows:
        starts = np.linspace(0, rows - 1, max_rows).round().astype(np.int64)
    idx = starts[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def stdlib_splits(
    seq_len: int = 128,
    heldout_fraction: float = 0.01,
    max_documents: int | None = None,
    max_test_rows: int | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """``data.fn`` for ``distrain train``: ``{"train": {"tokens"}, "test": {"tokens"}}``.

    ``max_test_rows`` caps the held-out rows (evaluation time on a CPU).
    """
    corpus = python_corpus(heldout_fraction, max_documents=max_documents)
    return {
        "train": {"tokens": pack(corpus["train"], seq_len)},
        "test": {"tokens": pack(corpus["test"], seq_len, max_rows=max_test_rows)},
    }


def pack_documents(
    docs: Sequence[bytes], seq_len: int, *, num_packing_bins: int = 64
) -> dict[str, np.ndarray]:
    """Documents -> packed rows ``{"inputs", "targets", "segment_ids", "positions"}``.

    Each document is followed by :data:`SEPARATOR` (its last target: "the document ends
    here") and cut into pieces of ``seq_len`` input tokens; every full piece is a row of
    its own, and the last, shorter pieces are packed several to a row by grain's
    first-fit packer (``grain.experimental.FirstFitPackIterDataset``, bins not
    shuffled: the rows depend only on the documents and their order). Within a row,
    piece ``j`` has segment id ``j + 1`` and positions ``0, 1, ...``; padding has segment
    id 0 (the loss weights it 0). All arrays are ``[rows, seq_len]``: tokens ``uint8``,
    segment ids and positions ``int16`` (``int32`` beyond 32,767 tokens).

    Raises:
      ValueError: ``seq_len < 1``, or no document.

    Example:
      >>> rows = pack_documents([b"ab", b"c"], 4)
      >>> rows["segment_ids"]                # both documents in one row, then padding
      array([[1, 1, 2, 0]], dtype=int16)
    """
    import grain
    from grain import experimental as grain_experimental

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int; received seq_len={seq_len!r}.")
    if not docs:
        raise ValueError("pack_documents needs at least one document. Received none.")
    ids = np.int16 if seq_len <= np.iinfo(np.int16).max else np.int32
    full_in, full_out, tails = [], [], []
    for doc in docs:
        ext = np.frombuffer(doc + bytes([SEPARATOR]), np.uint8)
        n_full = len(doc) // seq_len  # inputs ext[:len(doc)], targets ext[1:]
        if n_full:
            cut = n_full * seq_len
            full_in.append(ext[:cut].reshape(n_full, seq_len))
            full_out.append(ext[1 : cut + 1].reshape(n_full, seq_len))
        if len(doc) % seq_len:
            start = n_full * seq_len
            tails.append({"inputs": ext[start:-1], "targets": ext[start + 1 :]})
    n = sum(len(x) for x in full_in)
    rows: dict[str, list[np.ndarray]] = {
        "inputs": full_in,
        "targets": full_out,
        "segment_ids": [np.ones((n, seq_len), ids)],
        "positions": [np.broadcast_to(np.arange(seq_len, dtype=ids), (n, seq_len))],
    }
    if tails:
        packed = grain_experimental.FirstFitPackIterDataset(
            grain.MapDataset.source(tails).to_iter_dataset(),
            length_struct={"inputs": seq_len, "targets": seq_len},
            num_packing_bins=num_packing_bins,
            shuffle_bins=False,
        )
        out = list(packed)
        rows["inputs"].append(np.stack([r["inputs"] for r in out]).astype(np.uint8))
        rows["targets"].append(np.stack([r["targets"] for r in out]).astype(np.uint8))
        rows["segment_ids"].append(np.stack([r["inputs_segment_ids"] for r in out]).astype(ids))
        rows["positions"].append(np.stack([r["inputs_positions"] for r in out]).astype(ids))
    return {k: np.concatenate([x.reshape(-1, seq_len) for x in v]) for k, v in rows.items()}


def real_text_fraction(rows: dict[str, np.ndarray]) -> float:
    """The share of row tokens that are text, not padding (segment id > 0)."""
    return float((rows["segment_ids"] > 0).mean())


def stdlib_packed_splits(
    seq_len: int = 128,
    heldout_fraction: float = 0.01,
    max_documents: int | None = None,
    max_test_rows: int | None = None,
    load_balance: int | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """``data.fn``: :func:`stdlib_splits` with documents packed by :func:`pack_documents`.

    ``load_balance=C`` reorders every row for a sequence split over a ``"context"`` axis
    of ``C`` devices with causal attention (``dt.nn.load_balance``: device ``i`` holds
    chunks ``i`` and ``2C - 1 - i``), once, here in the input path; positions move with
    the tokens, so the model and the loss see the same numbers.
    """
    corpus = python_corpus(heldout_fraction, max_documents=max_documents)
    out = {name: pack_documents(docs, seq_len) for name, docs in corpus.items()}
    if max_test_rows is not None and len(out["test"]["inputs"]) > max_test_rows:
        keep = np.linspace(0, len(out["test"]["inputs"]) - 1, max_test_rows).round().astype(int)
        out["test"] = {k: v[keep] for k, v in out["test"].items()}
    if load_balance is not None:
        import distrain as dt

        out = {name: dt.nn.load_balance(rows, load_balance) for name, rows in out.items()}
    return out


# ------------------------------------------------------------------ TinyShakespeare


def _default_cache_dir() -> Path:
    root = os.environ.get("DISTRAIN_DATA_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "distrain") / "lm"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: Path, sha256: str, *, timeout: float = 60.0) -> Path:
    """``dest``, downloaded from ``url`` unless a copy with the right SHA-256 is there.

    The download goes to a temporary file next to ``dest``, is checked, then renamed:
    the cache never holds a partial or unverified file.

    Raises:
      ValueError: a cached file with another checksum (deleted; call again), or a
        download whose checksum differs (discarded).
      ConnectionError: ``url`` cannot be fetched; the message says where to put the file
        by hand.
    """
    if dest.exists():
        got = _sha256(dest)
        if got != sha256:
            dest.unlink()
            raise ValueError(
                f"Cached file {dest} is corrupt: sha256 {got}, expected {sha256}. It was "
                "deleted; call again to download it afresh."
            )
        return dest
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
            reason = getattr(e, "reason", None) or e
            raise ConnectionError(
                f"Could not download {url}: {reason}. If this machine is offline, fetch the "
                f"file elsewhere and copy it to {dest} (sha256 {sha256}), or pass url= a "
                "reachable mirror."
            ) from e
        got = digest.hexdigest()
        if got != sha256:
            raise ValueError(
                f"Checksum mismatch for {url}: expected sha256 {sha256}, received {got}. The "
                "download was discarded; check the url (a mirror serving another file?)."
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def load_tinyshakespeare(
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    url: str = TINYSHAKESPEARE_URL,
    sha256: str = TINYSHAKESPEARE_SHA256,
    heldout_fraction: float = 0.1,
    timeout: float = 60.0,
) -> dict[str, bytes]:
    """``{"train": bytes, "test": bytes}``: TinyShakespeare, the last 10% held out.

    Downloads ``url`` once into ``cache_dir`` (default ``$DISTRAIN_DATA_DIR/lm`` or
    ``~/.cache/distrain/lm``) as ``tinyshakespeare.txt`` and checks its SHA-256.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(
            f"heldout_fraction must be in (0, 1); received heldout_fraction={heldout_fraction!r}."
        )
    cache = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    raw = download(url, cache / "tinyshakespeare.txt", sha256, timeout=timeout).read_bytes()
    cut = int(round(len(raw) * (1.0 - heldout_fraction)))
    return {"train": raw[:cut], "test": raw[cut:]}


def pack_stream(text: bytes, seq_len: int) -> dict[str, np.ndarray]:
    """One text -> rows in which every byte after the first is a target exactly once.

    Inputs ``text[:-1]`` and targets ``text[1:]`` cut into rows of ``seq_len``, as
    :func:`pack_documents` lays rows out (``{"inputs", "targets", "segment_ids",
    "positions"}``, ``[rows, seq_len]``); the last row is padded (segment id 0, weight 0
    in the loss) instead of dropped, so a mean over these rows is the mean over the
    whole text.

    Raises:
      ValueError: ``seq_len < 1``, or a text of fewer than 2 bytes.

    Example:
      >>> pack_stream(b"abcd", 2)["segment_ids"]
      array([[1, 1],
             [1, 0]], dtype=int16)
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int; received seq_len={seq_len!r}.")
    stream = np.frombuffer(text, dtype=np.uint8)
    n = stream.size - 1  # targets
    if n < 1:
        raise ValueError(f"pack_stream needs a text of at least 2 bytes. Received {stream.size}.")
    rows = -(-n // seq_len)
    pad = np.zeros(rows * seq_len - n, np.uint8)
    ids = np.int16 if seq_len <= np.iinfo(np.int16).max else np.int32
    segment_ids = np.ones(rows * seq_len, ids)
    segment_ids[n:] = 0
    return {
        "inputs": np.concatenate([stream[:-1], pad]).reshape(rows, seq_len),
        "targets": np.concatenate([stream[1:], pad]).reshape(rows, seq_len),
        "segment_ids": segment_ids.reshape(rows, seq_len),
        "positions": np.tile(np.arange(seq_len, dtype=ids), (rows, 1)),
    }


def tinyshakespeare_splits(
    seq_len: int = 128,
    *,
    whole_test: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    url: str = TINYSHAKESPEARE_URL,
    sha256: str = TINYSHAKESPEARE_SHA256,
    heldout_fraction: float = 0.1,
    timeout: float = 60.0,
) -> dict[str, dict[str, np.ndarray]]:
    """``data.fn`` for ``distrain train`` on TinyShakespeare (downloads ~1.1 MB once).

    Args:
      seq_len: tokens per row.
      whole_test: the held-out split as :func:`pack_stream` rows (every held-out target
        once; the held-out loss is over the whole split) instead of :func:`pack` rows
        (the tail that fills no row, under ``seq_len`` bytes, dropped).
      cache_dir, url, sha256, heldout_fraction, timeout: :func:`load_tinyshakespeare`'s,
        named here so that a config sees them (``data.kwargs.url=MIRROR``).
    """
    text = load_tinyshakespeare(
        cache_dir=cache_dir,
        url=url,
        sha256=sha256,
        heldout_fraction=heldout_fraction,
        timeout=timeout,
    )
    out = {name: {"tokens": pack([t], seq_len)} for name, t in text.items()}
    if whole_test:
        out["test"] = pack_stream(text["test"], seq_len)
    return out
