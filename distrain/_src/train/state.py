"""``TrainState``: the immutable pytree a train step reads and returns.

Frozen parameters (``create(trainable=...)``): only the trainable leaves have optimizer
state, and ``apply_gradients`` drops the frozen leaves' gradients before the all-reduce,
so XLA removes their computation and nothing of them crosses devices. A ``train_step``
written for full training fine-tunes unchanged.

A state read from a pretrained model records it (``TrainState.base``: its hash and
path). Checkpoints (:func:`checkpointed`) then leave out the frozen parameters, which a
resume re-reads from the base, and record the base's hash, which :func:`restored_over`
checks before it puts the checkpoint's leaves over the freshly read state.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import jax
import jax.numpy as jnp
import optax
from flax import struct

from distrain._src import context
from distrain._src import mixed_precision as mp
from distrain._src.pytree import path_str

_CREATE_KEYWORDS = ("params", "tx", "rng", "policy", "trainable", "frozen_dtype")


@dataclasses.dataclass(frozen=True)
class Base:
    """The pretrained model a state starts from: ``sha256``, ``dt.models``' hash of its
    parameters (``peft_format.base_sha256``), and ``path``, where it was read.

    Example:
      >>> state = state.replace(base=Base(sha256=base_sha256(model.params), path="hf/"))
    """

    sha256: str
    path: str


@struct.dataclass
class TrainState:
    """Step counter, parameters, optimizer state, RNG key and extra collections.

    ``extra`` holds other mutable collections (e.g. ``{"batch_stats": ...}``).
    Any other pytree works as Trainer state too (e.g. two of these for a GAN).
    ``trainable`` (static) says which leaves of ``params`` train, in their flattened
    order; None: all of them (see :meth:`create`).

    Example:
      >>> state = dt.TrainState.create(params=params, tx=optax.adam(1e-3), rng=jax.random.key(0))
      >>> def train_step(state, batch):
      ...     grads = jax.grad(loss_fn)(state.params, batch)
      ...     return state.apply_gradients(grads=grads), {}
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array | None = None
    extra: dict[str, Any] = struct.field(default_factory=dict)
    loss_scale: mp.DynamicLossScale | None = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)
    policy: mp.Policy | None = struct.field(pytree_node=False, default=None)
    # Gradient accumulation, set by ``dt.accumulate_gradients`` on the state it passes
    # to each micro-step (never by users): ``apply_gradients`` then keeps its gradients
    # in ``micro_grads`` instead of applying them, and the sum over the micro-steps is
    # applied once per update.
    accumulating: bool = struct.field(pytree_node=False, default=False)
    micro_grads: Any = None
    trainable: tuple[bool, ...] | None = struct.field(pytree_node=False, default=None)
    # Where the parameters came from (train/pretrained.py sets it): a checkpoint then
    # holds no frozen parameter (see `checkpointed`) and records the base's hash.
    base: Base | None = struct.field(pytree_node=False, default=None)

    if TYPE_CHECKING:
        # Added by @struct.dataclass at runtime; declared here so type checkers see it.
        def replace(self, **changes: Any) -> Self: ...

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array | None = None,
        policy: mp.Policy | str | None = None,
        trainable: str | Any | None = None,
        frozen_dtype: Any = None,
        **extra: Any,
    ) -> TrainState:
        """A state at step 0 with ``tx``'s freshly initialised optimizer state.

        Args:
          params: the parameters (kept in float32 under a mixed-precision policy).
          tx: the optax optimizer.
          rng: an optional PRNG key carried with the state.
          policy: ``"float32"`` (default), ``"mixed_bfloat16"`` or ``"mixed_float16"``
            (see ``dt.mixed_precision``); ``mixed_float16`` adds a dynamic loss scale.
          trainable: which parameters train (None: all): a regex searched in each
            leaf's path (keys joined by ``/``, e.g. ``"blocks/0/attn/q/lora_a"``), or a
            pytree of bools with ``params``' structure. The others are frozen: no
            optimizer state (absent, not zeros), no gradient all-reduce, unchanged by
            ``apply_gradients``.
          frozen_dtype: store the frozen parameters in this dtype (e.g. ``"bfloat16"``:
            half the bytes of a frozen base model); None keeps theirs.
          **extra: other collections, e.g. ``batch_stats=...``.

        Raises:
          ValueError: a ``trainable`` that matches no parameter (everything frozen), or
            a tree of bools whose structure is not ``params``'.
          TypeError: a keyword that looks like a misspelt argument (``trainible=``).

        Example:
          >>> state = dt.TrainState.create(params=params, tx=optax.adamw(1e-3),
          ...                              trainable=r"lora_|head")
        """
        for key in extra:  # a misspelt argument would silently become a collection
            close = difflib.get_close_matches(key, _CREATE_KEYWORDS, n=1, cutoff=0.75)
            if close:
                raise TypeError(
                    f"TrainState.create() got the keyword {key!r}: did you mean "
                    f"{close[0]!r}? (Other keywords are extra collections, e.g. "
                    "batch_stats=...; its arguments are "
                    f"{', '.join(_CREATE_KEYWORDS)}.)"
                )
        policy = mp.policy_of(policy)
        if policy is not None:
            params = policy.cast_to_param(params)
        mask = _trainable_mask(params, trainable)
        if mask is not None and frozen_dtype is not None:
            cast = lambda x: jnp.asarray(x, frozen_dtype)  # noqa: E731
            params = _merge(params, _select(params, mask), mask, cast)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(_select(params, mask)),
            rng=rng,
            extra=dict(extra),
            loss_scale=mp.DynamicLossScale.create() if policy and policy.loss_scaling else None,
            tx=tx,
            policy=policy,
            trainable=mask,
        )

    def select_trainable(self, tree: Any) -> Any:
        """``tree`` (with ``params``' structure) with None for the frozen leaves: the
        structure of the optimizer's parameters and of the gradients it applies."""
        return _select(tree, self.trainable)

    def value_and_grad(
        self, fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
    ) -> Callable[..., Any]:
        """``jax.value_and_grad(fn)`` under this state's mixed-precision policy.

        Floating arguments are cast to the compute dtype; with a loss scale the loss is
        scaled before differentiation and the gradients unscaled after. The loss and
        gradients come back in float32. Without a policy it is ``jax.value_and_grad``.

        Example:
          >>> loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
        """
        policy, scale = self.policy, self.loss_scale
        if policy is None:
            return jax.value_and_grad(fn, argnums, has_aux=has_aux)

        share: list[float | None] = [None]  # the loss's count if it is a loss share

        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = fn(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
            loss, aux = out if has_aux else (out, None)
            share[0] = context.share_count(loss)
            loss = jnp.asarray(loss, jnp.float32)
            if scale is not None:
                loss = loss * scale.scale
            return loss, (loss, aux)

        grad_fn = jax.grad(scaled, argnums, has_aux=True)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            grads, (loss, aux) = grad_fn(*args, **kwargs)
            grads = policy.cast_to_param(grads)
            if scale is not None:
                loss = loss / scale.scale
                grads = jax.tree.map(lambda g: g / scale.scale, grads)
            if share[0] is not None:  # still the value of compute_average_loss, unscaled
                context._record_share(loss, share[0])
            return ((loss, aux) if has_aux else loss), grads

        return wrapped

    def apply_gradients(self, *, grads: Any, all_reduce: bool = True, **changes: Any) -> TrainState:
        """One optimizer update with ``grads``.

        Inside ``strategy.run`` the gradients are first summed over replicas, as
        ``apply_gradients`` does under a TensorFlow strategy: with
        ``dt.compute_average_loss`` that is the gradient of the global mean loss.
        Pass ``all_reduce=False`` when they are already reduced (or to keep them local).

        Args:
          grads: a pytree like ``params``.
          all_reduce: sum ``grads`` over replicas first (in a replica context).
          **changes: other fields to replace, e.g. ``extra=...``.
        """
        frozen_out = self.trainable is not None and _same(
            grads, _select(self.params, self.trainable)
        )
        if not (_same(grads, self.params) or frozen_out):
            raise ValueError(
                "`apply_gradients(grads=...)` needs gradients with the structure of "
                f"`params`. Received:\n  grads:  {jax.tree.structure(grads)}\n  params: "
                f"{jax.tree.structure(self.params)}\nTake the gradient with respect to "
                "state.params, e.g. `jax.grad(loss_fn)(state.params, batch)`."
            )
        if self.trainable is not None and not frozen_out:
            # Dropped here, before the all-reduce: nothing of them crosses devices, and
            # XLA removes their computation (the gradients are no longer used).
            grads = _select(grads, self.trainable)
        if self.accumulating:  # a micro-step: keep them, applied once per update
            if self.micro_grads is not None:
                raise ValueError(
                    "Under gradient accumulation `apply_gradients` may be called once per "
                    "step (the gradients of one optimizer). Accumulate GAN-style steps with "
                    "several optimizers by hand."
                )
            return self.replace(micro_grads=grads, **changes)
        if self.policy is not None:
            grads = self.policy.cast_to_param(grads)  # the all-reduce runs in float32
        ctx = context.get_replica_context()
        if all_reduce and ctx is not None:
            grads = ctx.all_reduce("sum", grads)
        trained = _select(self.params, self.trainable)
        updates, opt_state = self.tx.update(grads, self.opt_state, trained)
        params = _merge(self.params, optax.apply_updates(trained, updates), self.trainable)
        if self.loss_scale is not None:
            # An overflow skips the update on every replica (the gradients were
            # all-reduced, so all agree) and halves the scale.
            finite = mp.all_finite(grads)

            def keep(new: Any, old: Any) -> Any:
                return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

            params, opt_state = keep(params, self.params), keep(opt_state, self.opt_state)
            changes = {"loss_scale": self.loss_scale.adjust(finite), **changes}
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **changes)


def _same(a: Any, b: Any) -> bool:
    """Whether two pytrees have one structure."""
    # The ignore: jaxlib ships no stubs for PyTreeDef, so mypy cannot see its __eq__.
    return bool(jax.tree.structure(a) == jax.tree.structure(b))  # type: ignore[operator]


def _paths(tree: Any) -> list[str]:
    """Each leaf's path, keys joined by ``/`` (flax's trailing ``/value`` left out)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = path_str(path)
        out.append(p[: -len("/value")] if p.endswith("/value") else p)
    return out


def _trainable_mask(params: Any, trainable: str | Any | None) -> tuple[bool, ...] | None:
    """One bool per leaf of ``params`` (None: all trainable)."""
    if trainable is None:
        return None
    if isinstance(trainable, str):
        pattern = re.compile(trainable)
        paths = _paths(params)
        mask = tuple(bool(pattern.search(p)) for p in paths)
        if not any(mask):
            raise ValueError(
                f"TrainState.create(trainable={trainable!r}) matches no parameter, which "
                f"would freeze them all. Parameter paths look like {paths[:4]}; give a "
                "pattern that one of them contains."
            )
    else:
        if not _same(trainable, params):
            raise ValueError(
                "TrainState.create(trainable=...) takes a regex or a pytree of bools with "
                f"params' structure. Received the structure\n  {jax.tree.structure(trainable)}"
                f"\nfor params'\n  {jax.tree.structure(params)}."
            )
        mask = tuple(bool(x) for x in jax.tree.leaves(trainable))
        if not any(mask):
            raise ValueError(
                "TrainState.create(trainable=...) marks no parameter trainable (all False): "
                "nothing would train. Mark at least one True, or freeze nothing (None)."
            )
    return None if all(mask) else mask


def _select(tree: Any, mask: tuple[bool, ...] | None) -> Any:
    """``tree`` with None for the frozen leaves (optax keeps no state for a None)."""
    if mask is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        treedef, [x if m else None for x, m in zip(leaves, mask, strict=True)]
    )


def _merge(
    full: Any,
    trained: Any,
    mask: tuple[bool, ...] | None,
    frozen: Callable[[Any], Any] | None = None,
) -> Any:
    """``full`` with its trainable leaves taken from ``trained`` (the ``_select``-ed
    tree) and ``frozen`` applied to the others."""
    if mask is None:
        return trained
    leaves, treedef = jax.tree.flatten(full)
    new = iter(jax.tree.leaves(trained))
    keep = frozen or (lambda x: x)
    out = [next(new) if m else keep(x) for x, m in zip(leaves, mask, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _is_state(x: Any) -> bool:
    return isinstance(x, TrainState)


def _rebased(x: Any) -> bool:
    """Whether ``x`` is a state whose frozen parameters can be re-read from its base."""
    return isinstance(x, TrainState) and x.base is not None and x.trainable is not None


def checkpointed(state: Any, copy: bool = False) -> Any:
    """What a checkpoint of ``state`` holds: ``state`` with the frozen parameters of each
    ``TrainState`` that has a ``base`` left out (None). Others are whole.

    Args:
      state: the train state (any pytree; the ``TrainState``s in it are looked at).
      copy: copy the arrays kept (for an asynchronous write while later steps donate
        ``state``'s buffers); the frozen ones are never copied.

    Example:
      >>> manager.save(step, checkpointed(state), metadata=checkpoint_metadata(state))
    """
    view = jax.tree.map(
        lambda x: x.replace(params=_select(x.params, x.trainable)) if _rebased(x) else x,
        state,
        is_leaf=_is_state,
    )
    return (
        jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, view) if copy else view
    )


def checkpoint_metadata(state: Any) -> dict[str, Any]:
    """``{"bases": [{"sha256", "path"}, ...]}`` for the states in ``state`` that have a
    ``base`` (``{}`` if none): a checkpoint's record of the models it starts from."""
    leaves = jax.tree.leaves(state, is_leaf=_is_state)
    bases = [dataclasses.asdict(x.base) for x in leaves if _is_state(x) and x.base]
    return {"bases": bases} if bases else {}


def restored_over(state: Any, restored: Any, where: str) -> Any:
    """The checkpoint's state (``restored``: a ``CheckpointManager.restore`` of the target
    ``checkpointed(state)``) with the frozen parameters it left out taken from ``state``.

    Raises:
      ValueError: the checkpoint was trained from other base models than ``state``'s
        (different hashes, or a base on one side only), naming both hashes and paths.
    """
    ours = checkpoint_metadata(state).get("bases", [])
    theirs = (restored.metadata or {}).get("bases", [])
    if [b["sha256"] for b in ours] != [b["sha256"] for b in theirs]:
        raise ValueError(
            f"The checkpoint of step {restored.step} in {where} was trained from the base "
            f"model {_named(theirs)}; this run starts from {_named(ours)}: a different model. "
            "Resume with the base it was trained from (model.pretrained), or use a new "
            "checkpoint directory."
        )

    def over(fresh: Any, saved: Any) -> Any:
        if not _rebased(fresh):
            return saved
        return saved.replace(params=_merge(fresh.params, saved.params, fresh.trainable))

    return jax.tree.map(over, state, restored.state, is_leaf=_is_state)


def _named(bases: list[dict[str, str]]) -> str:
    return ", ".join(f"{b['path']} (sha256 {b['sha256']})" for b in bases) or "none"
