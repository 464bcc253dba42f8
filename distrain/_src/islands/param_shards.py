"""The islands' global parameters and outer optimizer state, split into shards.

The flattened float32 parameter vector is cut into ``S`` contiguous ranges of (nearly)
equal length (:func:`plan`); a range may start or end inside a leaf. A contiguous range
rather than a partition of the leaves: one large leaf (an embedding) would otherwise
hold most of the bytes in one shard, and the busiest holder would receive most of the
model. The outer optimizers of islands (SGD, Nesterov, the delayed Nesterov of the
asynchronous mode) are elementwise, so a segment of a leaf updates as the whole leaf
would, bit for bit; an optimizer that mixes elements of a leaf (a norm, a factored
second moment) would not, and belongs in ``DiLoCoStrategy``.

A :class:`ShardHolder` keeps one shard: its segments (1-D, one per leaf it covers) and
their outer optimizer state. Each island puts its pseudo-gradient's segments to it
(:meth:`ShardHolder.put`); when the coordinator closes round ``r`` it asks every
holder to apply it with the islands' row weights (:meth:`ShardHolder.apply`: the
weighted mean, islands in sorted order, and the outer update), which saves the new
shard durably as ``DIR/shards/round-(r+1)/shard-K-of-S.npz`` but keeps serving round
``r``; the coordinator's own checkpoint of round ``r + 1`` is the commit point, after
which it tells the holders to :meth:`~ShardHolder.install` it. In a run each holder is
a Ray actor (``remote.py``); in-process it is this plain object.

Example:
  >>> import optax
  >>> leaves = [np.zeros(3, np.float32), np.ones((2, 2), np.float32)]
  >>> [[tuple(s) for s in shard] for shard in plan([(3,), (2, 2)], 2)]
  [[(0, 0, 3), (1, 0, 1)], [(1, 1, 4)]]
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from distrain._src.islands import codecs, store


class Segment(NamedTuple):
    """Elements ``start:stop`` of leaf ``leaf``, flattened."""

    leaf: int
    start: int
    stop: int


class LeafSpec(NamedTuple):
    """A leaf's shape and dtype, sent instead of its values (the coordinator holds none)."""

    shape: tuple[int, ...]
    dtype: str


class ShardFailed(RuntimeError):
    """A shard holder could not apply or save a round (one line: which, and why)."""


class PseudoGradientLost(RuntimeError):
    """A holder has no pseudo-gradient an island sent it for the open round (the holder
    restarted since): the round is trained again (``rounds.py``), not applied."""


class HolderLost(RuntimeError):
    """A shard holder's actor died during a call (Ray restarts it)."""


def specs_of(leaves: Sequence[Any]) -> list[LeafSpec]:
    return [LeafSpec(tuple(np.shape(x)), np.dtype(x.dtype).name) for x in leaves]


def plan(shapes: Sequence[Sequence[int]], shards: int) -> list[list[Segment]]:
    """Cuts the flattened leaves of ``shapes`` into ``shards`` contiguous ranges whose
    lengths differ by at most one element; each range as its segments of leaves."""
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    total = int(offsets[-1])
    out: list[list[Segment]] = []
    for k in range(shards):
        lo, hi = k * total // shards, (k + 1) * total // shards
        segments = []
        for leaf, size in enumerate(sizes):
            start, stop = max(lo, offsets[leaf]), min(hi, offsets[leaf] + size)
            if start < stop:
                segments.append(Segment(leaf, start - offsets[leaf], stop - offsets[leaf]))
        out.append(segments)
    return out


def split(leaves: Sequence[np.ndarray], segments: Sequence[Segment]) -> list[np.ndarray]:
    """The segments of ``leaves`` (views where the leaves are contiguous)."""
    return [np.asarray(leaves[s.leaf]).reshape(-1)[s.start : s.stop] for s in segments]


def join(shards: Sequence[Sequence[np.ndarray]], segments: Sequence[Sequence[Segment]],
         specs: Sequence[LeafSpec]) -> list[np.ndarray]:  # fmt: skip
    """The leaves again, from every shard's segments."""
    flat = [np.empty(int(np.prod(s.shape)), s.dtype) for s in specs]
    for values, segs in zip(shards, segments, strict=True):
        for v, s in zip(values, segs, strict=True):
            flat[s.leaf][s.start : s.stop] = v
    return [f.reshape(s.shape) for f, s in zip(flat, specs, strict=True)]


def check_elementwise(outer_optimizer: Any) -> None:
    """Refuses an outer optimizer whose update of an element depends on other elements
    (a global-norm clip, a per-leaf trust ratio, a factored second moment): a holder
    updates its 1-D segments alone, so such an optimizer would silently compute another
    update than on the whole leaves. Probed: two steps on a 130 x 130 and a 7-element
    leaf (large enough to factor, gradients large enough to clip), whole against cut into
    three shards.

    Raises:
      ValueError: the shards' update differs from the whole leaves'.

    Example:
      >>> import optax
      >>> check_elementwise(optax.adam(0.1))  # elementwise: accepted
    """
    import jax.numpy as jnp

    from distrain._src.islands.outer_step import outer_update

    rng = np.random.default_rng(0)
    shapes = [(130, 130), (7,)]
    leaves = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [100 * rng.standard_normal(s).astype(np.float32) for s in shapes]

    def two_steps(values: list[np.ndarray], pseudo: list[np.ndarray]) -> list[np.ndarray]:
        params: Any = [jnp.asarray(p) for p in values]
        state = outer_optimizer.init(params)
        for _ in range(2):
            params, state = outer_update(outer_optimizer, params, state, pseudo)
        return [np.asarray(p) for p in params]

    whole = two_steps(leaves, grads)
    cut = plan(shapes, 3)
    parts = [two_steps(split(leaves, segs), split(grads, segs)) for segs in cut]
    joined = join(parts, cut, specs_of(leaves))
    if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(whole, joined, strict=True)):
        raise ValueError(
            "fault-isolated islands update the global parameters in shards, each a 1-D "
            "segment of the flattened parameters, so the outer optimizer must update every "
            "element from its own values alone (SGD, Nesterov, Adam, delayed_nesterov); "
            "received one whose update of the segments differs from the whole leaves' (a "
            "global-norm clip, a per-leaf trust ratio or a factored moment). Use another "
            "outer optimizer, or DiLoCoStrategy, which updates whole leaves."
        )


def shard_path(directory: str, round_: int, index: int, shards: int) -> str:
    return os.path.join(
        directory, "shards", f"round-{round_:07d}", f"shard-{index}-of-{shards}.npz"
    )


class ShardHolder:
    """One shard of the global parameters and its outer optimizer state.

    Args:
      directory: the run directory (its files go under ``DIR/shards``).
      index: this shard's index, ``0 .. shards - 1``.
      shards: how many shards the parameters are split into.
      segments: the shard's initial values (1-D arrays), or only their
        :class:`LeafSpec` (a holder made after the run started: it loads its shard of
        the newest committed round).
      outer_optimizer: the outer optimizer (an elementwise optax transformation).
      check: called first (``remote.check_shared``: the actor sees the run directory).

    Raises:
      ShardFailed: only specs were given and no committed shard could be read.
    """

    def __init__(
        self,
        directory: str,
        index: int,
        shards: int,
        segments: Sequence[np.ndarray | LeafSpec],
        outer_optimizer: Any,
        check: Callable[[], None] | None = None,
    ) -> None:
        import jax
        import jax.numpy as jnp

        if check is not None:  # a Ray actor: it must see the islands' run directory
            check()

        from distrain._src.islands.outer import outer_update

        self.directory, self.index, self.shards = os.path.abspath(directory), index, shards
        known = all(not isinstance(s, LeafSpec) for s in segments)
        self._params = [np.array(s) if known else np.zeros(s.shape, s.dtype) for s in segments]
        opt_state = outer_optimizer.init([jnp.asarray(p) for p in self._params])
        opt_leaves, self._opt_def = jax.tree.flatten(opt_state)
        self._opt = [np.asarray(x) for x in opt_leaves]
        self._update = jax.jit(functools.partial(outer_update, outer_optimizer))
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str, int, list[np.ndarray]]] = {}
        self._staged: tuple[int, list[np.ndarray], list[np.ndarray]] | None = None
        self.round = 0
        self.bytes_received = self.bytes_sent = 0  # pseudo-gradients in, parameters out
        committed = store.newest_round(self.directory)
        if not known and not committed:
            raise ShardFailed(
                f"shard {index} of {shards} was made without values and {self.directory} "
                "holds no committed round to load: expected the first island to make it"
            )
        if committed:  # (re)started under a run: its shard of the committed round
            problem = self.restore(committed)
            if problem is not None and not known:
                raise ShardFailed(problem)

    # ---------------------------------------------------------------- islands
    def put(self, island: int, token: str, round_: int,
            grads: Sequence[np.ndarray | codecs.Packed]) -> None:  # fmt: skip
        """``island``'s pseudo-gradient segments for ``round_`` (replacing any earlier),
        float32 or packed by an outer codec (unpacked here)."""
        received = sum(int(np.asarray(g).nbytes) if not isinstance(g, codecs.Packed)
                       else g.nbytes for g in grads)  # fmt: skip
        if len(grads) == len(self._params):
            values = [codecs.unpack(g, p.size) if isinstance(g, codecs.Packed) else np.asarray(g)
                      for g, p in zip(grads, self._params, strict=True)]  # fmt: skip
        else:  # refused below, by their shapes
            values = [np.asarray(g.data if isinstance(g, codecs.Packed) else g) for g in grads]
        shapes = [np.shape(g) for g in values]
        if shapes != [np.shape(p) for p in self._params]:
            raise ValueError(
                f"shard {self.index} of {self.shards} expected segments of shapes "
                f"{[np.shape(p) for p in self._params]} from island {island}; received "
                f"{shapes}. Nothing was stored."
            )
        with self._lock:
            self._pending[island] = (token, round_, values)
            self.bytes_received += received

    def params(self, round_: int) -> list[np.ndarray] | None:
        """The shard of the committed round ``round_``; None if it serves another."""
        with self._lock:
            if self.round != round_:
                return None
            self.bytes_sent += sum(p.nbytes for p in self._params)
            return list(self._params)

    # ------------------------------------------------------------ coordinator
    def apply(self, r: int, entries: Sequence[tuple[int, str, int, float]]) -> None:
        """Applies round ``r``: the mean of the pseudo-gradients of ``entries``
        (``(island, token, round, weight)``, summed in island order) through the outer
        optimizer; saves the result as round ``r + 1``, served only after
        :meth:`install`. No entries: round ``r + 1`` holds round ``r``'s values.

        Raises:
          PseudoGradientLost: a pseudo-gradient is missing (this holder restarted
            since the island put it); nothing changes.
          ShardFailed: the update or the save failed; nothing changes.
        """
        import jax

        with self._lock:
            grads = []
            for island, token, round_, weight in sorted(entries):
                got = self._pending.get(island)
                if got is None or got[:2] != (token, round_):
                    raise PseudoGradientLost(
                        f"shard {self.index} of {self.shards} has no pseudo-gradient of "
                        f"island {island} for round {round_} (the holder restarted since "
                        "the island sent it)"
                    )
                grads.append((got[2], weight))
            params, opt = self._params, self._opt
        try:
            if grads:  # the star's arithmetic: float32, islands in order, Python's sum
                mean = [sum(g[k] * w for g, w in grads) for k in range(len(params))]
                state = jax.tree.unflatten(self._opt_def, opt)
                new_params, state = self._update(params, state, mean)
                params = [np.asarray(p) for p in new_params]
                opt = [np.asarray(x) for x in jax.tree.leaves(state)]
        except Exception as e:  # noqa: BLE001 - one line, the coordinator fails the run
            raise ShardFailed(f"shard {self.index}'s outer update failed ({_line(e)})") from None
        path = shard_path(self.directory, r + 1, self.index, self.shards)
        try:
            self._save(path, params, opt)
        except Exception as e:  # noqa: BLE001
            raise ShardFailed(
                f"shard {self.index} could not be written to {path} ({_line(e)})"
            ) from None
        with self._lock:
            self._staged = (r + 1, params, opt)
            for island, *_ in entries:
                self._pending.pop(island, None)

    def install(self, round_: int) -> None:
        """Serves round ``round_`` (committed by the coordinator): the staged shard, else
        the one on disk (this holder restarted after it saved it)."""
        with self._lock:
            if self.round == round_:
                return
            staged, self._staged = self._staged, None
            if staged is not None and staged[0] == round_:
                _, self._params, self._opt = staged
            else:
                self._params, self._opt = self._load(round_)
            self.round = round_
        self._drop_older(round_ - store.CHECKPOINTS_KEPT + 1)

    def discard(self, round_: int) -> None:
        """Round ``round_ - 1`` was not committed: forgets its update, on disk too."""
        with self._lock:
            if self._staged is not None and self._staged[0] == round_:
                self._staged = None
        shutil.rmtree(os.path.dirname(shard_path(self.directory, round_, 0, 1)), ignore_errors=True)

    def restore(self, round_: int) -> str | None:
        """Serves round ``round_``, the coordinator's committed one (it restarted); the
        shards of later rounds, never committed, are deleted, as are the pending
        pseudo-gradients. Returns None, or why this holder cannot (one line)."""
        with self._lock:
            self._pending.clear()
            self._staged = None
            if self.round != round_:
                if (
                    not os.path.exists(shard_path(self.directory, round_, self.index, self.shards))
                    and round_ == 0
                ):
                    return f"shard {self.index} holds round {self.round} and has no file of round 0"
                try:
                    self._params, self._opt = self._load(round_)
                except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                    path = shard_path(self.directory, round_, self.index, self.shards)
                    return f"{path} is unreadable ({_line(e)})"
                self.round = round_
        for name in _round_dirs(self.directory):
            if int(name[6:]) > round_:
                shutil.rmtree(os.path.join(self.directory, "shards", name), ignore_errors=True)
        return None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "index": self.index,
                "round": self.round,
                "pending": sorted(self._pending),
                "bytes_received": self.bytes_received,
                "bytes_sent": self.bytes_sent,
            }

    # ------------------------------------------------------------------ files
    def _save(self, path: str, params: list[np.ndarray], opt: list[np.ndarray]) -> None:
        arrays = {f"p{k}": p for k, p in enumerate(params)}
        arrays.update({f"o{k}": x for k, x in enumerate(opt)})
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}.npz"
        store.write_durably(tmp, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]  # numpy's stub
        os.replace(tmp, path)
        store.fsync_directory(os.path.dirname(path))
        store.fsync_directory(os.path.dirname(os.path.dirname(path)))

    def _load(self, round_: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        path = shard_path(self.directory, round_, self.index, self.shards)
        with np.load(path) as z:
            params = [z[f"p{k}"] for k in range(len(self._params))]
            opt = [z[f"o{k}"] for k in range(len(self._opt))]
        got, mine = [p.shape for p in params], [p.shape for p in self._params]
        if got != mine:
            raise ValueError(f"its segments have shapes {got}, this model's {mine}")
        return params, opt

    def _drop_older(self, keep_from: int) -> None:
        """Only this holder's files of the kept rounds stay (the coordinator keeps the
        same rounds' checkpoints)."""
        for name in _round_dirs(self.directory):
            if int(name[6:]) < keep_from:
                folder = os.path.join(self.directory, "shards", name)
                with contextlib.suppress(OSError):  # other holders remove (and write) there too
                    os.remove(os.path.join(folder, f"shard-{self.index}-of-{self.shards}.npz"))
                    if not os.listdir(folder):
                        os.rmdir(folder)


def _round_dirs(directory: str) -> list[str]:
    root = os.path.join(directory, "shards")
    names = os.listdir(root) if os.path.isdir(root) else []
    return [n for n in names if n.startswith("round-") and "." not in n]


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")


class LocalHolders:
    """The coordinator's shard holders in its own process (no Ray): each call runs on
    every holder in turn. ``remote.RayHolders`` is the same over Ray actors."""

    def __init__(self, holders: Sequence[ShardHolder]) -> None:
        self.holders = list(holders)

    @classmethod
    def of(cls, directory: str, params: Sequence[np.ndarray], shards: int,
           outer_optimizer: Any) -> LocalHolders:  # fmt: skip
        """``shards`` holders of ``params`` (their initial values).

        Raises:
          ValueError: ``outer_optimizer`` is not elementwise (:func:`check_elementwise`).
        """
        check_elementwise(outer_optimizer)
        cut = plan([np.shape(p) for p in params], shards)
        return cls([ShardHolder(directory, k, shards, split(params, segments), outer_optimizer)
                    for k, segments in enumerate(cut)])  # fmt: skip

    def map(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        return [getattr(h, method)(*a) for h, a in zip(self.holders, args, strict=True)]


class Exchange:
    """The shard plan and the holders: splits a pseudo-gradient to the holders, joins a
    round's parameters from them, and counts the bytes it sends and receives.

    Args:
      specs: the parameters' shapes and dtypes.
      shards: the number of shards (one holder each).
      holders: ``map(method, args_per_holder)`` over the holders (:class:`LocalHolders`
        or ``remote.RayHolders``).
      outer_dtype: what a pseudo-gradient's segments travel as (``codecs.py``).
    """

    def __init__(self, specs: Sequence[LeafSpec], shards: int, holders: Any,
                 outer_dtype: codecs.OuterDType = "float32") -> None:  # fmt: skip
        self.specs = list(specs)
        self.outer_dtype = outer_dtype
        self.plan = plan([s.shape for s in self.specs], shards)
        self.holders = holders
        self.bytes_sent = self.bytes_received = 0

    def map(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every holder."""
        return self.holders.map(method, [args] * len(self.plan))

    def put(self, island: int, token: str, round_: int, grads: Sequence[np.ndarray]) -> None:
        """Sends each holder its segments of ``island``'s pseudo-gradient.

        Raises:
          ValueError: its shapes are not the parameters' (nothing is sent).
        """
        shapes = [tuple(np.shape(g)) for g in grads]
        if shapes != [s.shape for s in self.specs]:
            raise ValueError(
                f"island {island}'s pseudo-gradient has shapes {shapes}; the global "
                f"parameters have {[s.shape for s in self.specs]}. Nothing was applied."
            )
        parts: list[list[Any]] = [split(grads, segments) for segments in self.plan]
        if self.outer_dtype != "float32":
            parts = [[codecs.pack(x, self.outer_dtype) for x in p] for p in parts]
        self.holders.map("put", [(island, token, round_, p) for p in parts])
        self.bytes_sent += sum(x.nbytes for p in parts for x in p)

    def params(self, round_: int) -> list[np.ndarray] | None:
        """The parameters of the committed round ``round_``; None while a holder serves
        another round (asynchronous islands moved on, or a holder restarts)."""
        parts = self.map("params", round_)
        if any(p is None for p in parts):
            return None
        self.bytes_received += sum(x.nbytes for p in parts for x in p)
        return join(parts, self.plan, self.specs)
