"""Fine-tuning from a config: ``model.pretrained``, ``model.lora``, ``optimizer.trainable``.

``distrain train`` (``run.py``) and ``distrain plan`` (``plan.py``) call this module for
a config whose model is a Hugging Face directory instead of a ``model.fn``:

- :func:`pretrained_model` reads it with ``dt.models.from_pretrained`` into the
  strategy's layout (each process reads its devices' slices), hashes the base
  (``peft_format.base_sha256``) and adds ``model.lora``'s adapters.
- :func:`abstract_model` builds the same model from ``config.json`` and the files'
  headers only (nothing read, nothing allocated), for ``distrain plan``.
- :func:`new_state` makes the ``TrainState`` with ``optimizer.trainable`` (default: the
  adapters with ``model.lora``), recording the base (``TrainState.base``): checkpoints
  then hold only what trains and the base's hash, and a resume re-reads the base,
  checks the hash and puts the checkpoint over it (``state.restored_over``).
- :func:`with_lora_dropout` gives a step the adapters' dropout (``model.lora.dropout``).

Example:
  >>> apply_fn, params, base = pretrained_model(cfg, strategy)
  >>> state = jax.jit(new_state(cfg, tx, base))(params, jax.random.PRNGKey(1))
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from distrain._src.models.lora import ADAPTERS, LoraConfig, add_lora, leaf_path
from distrain._src.train.config import RunConfig
from distrain._src.train.config_errors import ConfigError
from distrain._src.train.state import Base, TrainState
from distrain._src.train.training_config import PRETRAINED_FN

__all__ = ["abstract_model", "new_state", "pretrained_model", "with_lora_dropout"]

#: ``optimizer.trainable``'s default with ``model.lora``: the adapters' leaves.
ADAPTER_LEAVES = rf"/({'|'.join(ADAPTERS)})$"


def lora_config(cfg: RunConfig) -> LoraConfig | None:
    """``model.lora`` as a ``dt.models.LoraConfig`` (None without it)."""
    lora = cfg.model.lora
    if lora is None:
        return None
    extra = {} if lora.targets is None else {"targets": lora.targets}
    try:
        return LoraConfig(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, **extra)
    except ValueError as e:  # a targets that is not a regex
        raise ConfigError(f"Config field 'model.lora': {e}") from None


def trainable_of(cfg: RunConfig) -> str | None:
    """The regex of the parameters that train: ``optimizer.trainable``, else the adapters
    with ``model.lora``, else None (all)."""
    if cfg.optimizer.trainable is not None:
        return cfg.optimizer.trainable
    return ADAPTER_LEAVES if cfg.model.lora is not None else None


def _register_families() -> None:
    # Importing a family's module registers it, as `dt.models` does (the CLI may not
    # have imported dt.models).
    from distrain._src.models import gpt2, llama_family, mixtral  # noqa: F401


def _read_config(path: str) -> tuple[Any, Any]:
    """The family and its config of the local checkpoint at ``path`` (``config.json``)."""
    from distrain._src.models import family as _family
    from distrain._src.models import safetensors_io as io

    _register_families()
    try:
        hf = io.read_config(path)
        family = _family.family_for(hf)
        return family, family.config_from_hf(hf)
    except (OSError, ValueError) as e:
        raise ConfigError(f"Config field 'model.pretrained' ({path!r}): {e}") from e


def _adapted(module: nnx.Module, cfg: RunConfig) -> nnx.Module:
    """``module`` with ``model.lora``'s adapters (drawn from ``seed``), if any."""
    lora = lora_config(cfg)
    if lora is None:
        return module
    try:
        return add_lora(module, lora, rngs=nnx.Rngs(cfg.seed))
    except ValueError as e:
        raise ConfigError(f"Config field 'model.lora': {e}") from None


def pretrained_model(
    cfg: RunConfig, strategy: Any, say: Callable[[str], None] = lambda _: None
) -> tuple[Callable[..., jax.Array], Any, Base]:
    """Reads ``model.pretrained`` into ``strategy``'s layout and adds ``model.lora``.

    Args:
      cfg: the run config (``model.pretrained`` set).
      strategy: where the parameters live (its layout rules apply to ``params/...``).
      say: where the one line naming the base goes.

    Returns:
      ``(apply_fn, params, base)``: params a plain nested dict (adapters included),
      ``base`` the base model's hash and path, for ``TrainState.base``.

    Raises:
      ConfigError: a directory that cannot be read as a model (the reason named),
        ``model.kwargs`` that ``from_pretrained`` does not take, LoRA targets that
        match no layer or a rank above a layer's width.
    """
    from distrain._src.models.hub import from_pretrained
    from distrain._src.models.peft_format import base_sha256
    from distrain._src.train.model_fn import check_call as _check_call
    from distrain._src.train.model_fn import split_model as _split_model

    path = str(cfg.model.pretrained)
    _register_families()
    _check_call(
        from_pretrained, "model", PRETRAINED_FN, path, strategy=strategy, **cfg.model.kwargs
    )
    try:
        model = from_pretrained(path, strategy=strategy, **cfg.model.kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"Config field 'model.pretrained' ({path!r}): {e}") from e
    base = Base(sha256=base_sha256(model.params), path=path)
    say(f"model.pretrained: {path} ({model.family.name}, sha256 {base.sha256[:12]}...)")
    found: dict[str, Any] = {}

    def init(params: Any) -> Any:
        found["apply_fn"], out = _split_model(_adapted(nnx.merge(model.graphdef, params), cfg))
        return out

    # One compiled call (add_lora's draws alone would compile a program per layer); the
    # base's buffers are donated: it is never held twice.
    params = jax.jit(init, donate_argnums=0)(model.params)
    return found["apply_fn"], params, base


def abstract_model(cfg: RunConfig) -> tuple[Callable[..., jax.Array], Any]:
    """``model.pretrained``'s model and ``model.lora``'s adapters as shapes and dtypes,
    from ``config.json`` and the safetensors headers (no weight is read): the
    ``(apply_fn, params)`` of :func:`pretrained_model`, for ``distrain plan``. A local
    directory only (a hub name is not downloaded to plan).

    Raises:
      ConfigError: a directory without a readable ``config.json`` or safetensors, an
        unsupported model, LoRA targets that match no layer.
    """
    import numpy as np

    from distrain._src.models import safetensors_io as io
    from distrain._src.train.model_fn import split_model as _split_model

    path = str(cfg.model.pretrained)
    family, config = _read_config(path)
    try:
        weights = io.Weights(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"Config field 'model.pretrained' ({path!r}): {e}") from e
    weights.add_prefix(family.prefix)
    names = {t.path: t.names[0] for t in family.tensors(config)}
    module = nnx.eval_shape(lambda: _adapted(family.build(config, nnx.Rngs(0)), cfg))
    apply_fn, params = _split_model(module)
    wanted = cfg.model.kwargs.get("dtype")

    def as_read(p: Any, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = names.get(leaf_path(p))  # None: an adapter (float32, as add_lora makes it)
        if name is None:
            return x
        return jax.ShapeDtypeStruct(x.shape, np.dtype(wanted or weights.dtype(name)))

    return apply_fn, jax.tree_util.tree_map_with_path(as_read, params)


def new_state(
    cfg: RunConfig, tx: Any, base: Base | None = None
) -> Callable[[Any, jax.Array], TrainState]:
    """``(params, rng) -> TrainState`` as the config says (policy, ``optimizer.trainable``)
    with ``base`` recorded, for ``jax.jit`` or ``jax.eval_shape``.

    Raises (when called):
      ConfigError: ``optimizer.trainable`` is not a regex, or matches no parameter
        (some parameter paths are named).
    """
    trainable = trainable_of(cfg)
    if trainable is not None:
        try:
            re.compile(trainable)
        except re.error as e:
            raise ConfigError(
                f"Config field 'optimizer.trainable' must be a regular expression. Received: "
                f"{trainable!r} ({e})."
            ) from None

    def create(params: Any, rng: jax.Array) -> TrainState:
        paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        if trainable is not None and not any(re.search(trainable, p) for p in paths):
            raise ConfigError(
                f"Config field 'optimizer.trainable' ({trainable!r}) matches no parameter, so "
                f"nothing would train. Parameter paths look like {paths[:4]}; give a regex one "
                "of them contains (null: all train, or the adapters with model.lora)."
            )
        state = TrainState.create(
            params=params, tx=tx, rng=rng, policy=cfg.train.policy, trainable=trainable
        )
        return state.replace(base=base)

    return create


def with_lora_dropout(step: Callable[..., Any], cfg: RunConfig) -> Callable[..., Any]:
    """``step`` inside ``dt.models.lora_dropout`` with a key of the state's rng, step and
    replica (new masks every step and replica; the same after a resume), when
    ``model.lora.dropout`` is above 0; else ``step`` itself."""
    from distrain._src.context import get_replica_context
    from distrain._src.models.lora import lora_dropout

    if cfg.model.lora is None or not cfg.model.lora.dropout:
        return step

    @functools.wraps(step)
    def dropped(state: TrainState, batch: Any, **kwargs: Any) -> Any:
        if state.rng is None:
            raise ValueError(
                "model.lora.dropout draws its masks from the state's rng, and the state has "
                "none: create it with TrainState.create(rng=...) (distrain train does)."
            )
        key = jax.random.fold_in(state.rng, state.step)
        replica = get_replica_context()
        if replica is not None:
            key = jax.random.fold_in(key, replica.replica_id_in_sync_group)
        with lora_dropout(key):
            return step(state, batch, **kwargs)

    return dropped
