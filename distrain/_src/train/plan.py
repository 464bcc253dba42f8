"""``distrain plan``: will a config's training step fit, on a cluster that is not here?

``distrain plan --config X.yaml --devices N`` starts a subprocess with ``N`` virtual CPU
devices, builds the config's strategy, its train state *abstractly* (``jax.eval_shape``
of the model and optimizer: nothing is allocated) laid out as ``put_replicated`` would,
an abstract global batch, and compiles the config's ``train_step`` with
``strategy.memory_analysis``. It prints, per device, the state's bytes and the compiled
step's peak (argument + output + temp - alias), and whether that fits
``--device-memory``; then where the batch's rows go and, in ``problem:`` and ``to
change:`` lines, what a user would otherwise have to work out (``plan_advice.py``).

The batch comes from ``data.abstract`` (``{leaf: {shape: [...], dtype: ...}}``, the shape
of one row) when the config has it, else from the rows of the ``train`` split that
``data.fn`` returns (host memory only).

What XLA:CPU's estimate is not: a GPU compiler fuses differently (fewer or other
temporaries), cuDNN attention needs workspaces, XLA:GPU may rematerialize, and the
allocator fragments; the input pipeline's prefetched batches and other arrays of the
process are outside the program. Treat the figure as the program's own need, and keep
a margin (``docs/scaling.md``, "Will it fit?").

Example:
  $ distrain plan --config configs/lm_7b.yaml --devices 64 --device-memory 80GiB
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from distrain._src.train.plan_advice import flow, gib

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IUNITS = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"16G"``, ``"1024"`` as a number of bytes.

    Raises:
      ValueError: anything else, naming the accepted forms.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(
            f"--device-memory must be a size such as 80GiB, 80GB, 16G or 1073741824. "
            f"Received: {text!r}."
        )
    unit = (m.group(2) or "").lower()
    scale = _IUNITS.get(unit) or _UNITS[unit]
    return int(float(m.group(1)) * scale)


def _check_processes(strategy_cfg: Any, devices: int, processes: int) -> None:
    """The layout's process rules, on ``processes`` of ``devices // processes`` each."""
    from distrain._src.strategy.replica_mesh import resolve_inner_axes

    if processes < 1 or devices % processes:
        raise ValueError(
            f"--processes ({processes}) must be a positive divisor of --devices ({devices}): "
            "every process has the same number of devices."
        )
    _check_devices(strategy_cfg.devices_per_replica, devices)
    per = devices // processes
    records = [SimpleNamespace(process_index=i // per) for i in range(devices)]
    resolve_inner_axes(strategy_cfg.devices_per_replica, records, "replica")


def _check_devices(value: Any, devices: int) -> None:
    """``--devices`` must be a multiple of the config's devices per replica; the error
    names the override that plans the same layout on ``devices``."""
    from distrain._src.train.config_errors import ConfigError

    if isinstance(value, dict) and value and all(isinstance(n, int) for n in value.values()):
        axes = dict(value)
    elif isinstance(value, int) and not isinstance(value, bool) and value > 1:
        axes = {"model": value}
    else:
        return  # 1, "process" or a value resolve_inner_axes reports
    k = math.prod(axes.values())
    if devices % k == 0:
        return
    first = next(iter(axes))
    others = math.prod(n for a, n in axes.items() if a != first)
    fitted = {a: (devices // others if a == first else n) for a, n in axes.items()}
    if devices % others:
        fitted = {first: devices}
    override = (
        f"strategy.devices_per_replica={devices if list(fitted) == ['model'] else flow(fitted)}"
    )
    shown = value if isinstance(value, int) else flow(axes)
    raise ConfigError(
        f"--devices {devices} does not fit the config's strategy.devices_per_replica={shown}: "
        f"it needs {k} devices per replica, which must divide the number of devices "
        f"({devices}). To plan this config on {devices} devices, add the override "
        f"'{override}' ({devices // math.prod(fitted.values())} replica(s) of "
        f"{math.prod(fitted.values())}), or pass --devices a multiple of {k}."
    )


def _abstract_batch(cfg: Any) -> Any:
    import jax
    import numpy as np

    from distrain._src.train.config_errors import ConfigError
    from distrain._src.train.data_from_config import load_data as _load_data
    from distrain._src.train.import_paths import resolve_callable

    rows = cfg.data.global_batch_size
    if cfg.data.abstract is not None:
        return {
            k: jax.ShapeDtypeStruct((rows, *leaf.shape), jax.numpy.dtype(leaf.dtype))
            for k, leaf in cfg.data.abstract.items()
        }
    splits = _load_data(cfg, resolve_callable(cfg.data.fn, "data.fn"))
    train = splits.get("train") if isinstance(splits, dict) else None
    if not isinstance(train, dict):
        raise ConfigError(
            "distrain plan needs the batch's shapes: give data.abstract (e.g. {tokens: "
            "{shape: [1025], dtype: int32}}), or a data.fn whose 'train' split is a dict "
            f"of arrays. {cfg.data.fn}'s is a {type(train).__name__}."
        )
    return {
        k: jax.ShapeDtypeStruct((rows, *np.shape(v)[1:]), np.asarray(v).dtype)
        for k, v in train.items()
    }


def abstract_state(cfg: Any) -> SimpleNamespace:
    """``cfg``'s strategy on this process's devices and its train state, abstract
    (``jax.eval_shape``: nothing allocated) and placed as ``put_replicated`` would place
    it, every layout rule and logical name checked.

    Returns:
      ``SimpleNamespace(strategy, state, placed, apply_fn)``.

    Raises:
      ValueError: a layout rule that matches no leaf, a logical name no spec uses, a
        spec its axes cannot split (the strategy's own errors).
    """
    import jax

    from distrain._src.train.import_paths import resolve_callable
    from distrain._src.train.model_fn import check_call as _check_call
    from distrain._src.train.model_fn import split_model as _split_model
    from distrain._src.train.optimizer import build_optimizer
    from distrain._src.train.pretrained import abstract_model, new_state
    from distrain._src.train.strategy_from_config import build_strategy

    strategy = build_strategy(cfg.strategy)
    found: dict[str, Any] = {}
    if cfg.model.pretrained is not None:  # config.json and the files' headers: no weights
        found["apply_fn"], params = abstract_model(cfg)
    else:
        model_fn = resolve_callable(cfg.model.fn, "model.fn")
        key = jax.random.key(cfg.seed)
        _check_call(model_fn, "model", cfg.model.fn, key=key, **cfg.model.kwargs)

        def init(k: jax.Array) -> Any:
            found["apply_fn"], params = _split_model(model_fn(key=k, **cfg.model.kwargs))
            return params

        params = jax.eval_shape(init, key)
    tx, _ = build_optimizer(cfg.optimizer, run_steps=cfg.train.steps)
    state = jax.eval_shape(new_state(cfg, tx), params, jax.random.PRNGKey(cfg.seed + 1))
    placed = strategy.put_replicated(state)  # abstract in, abstract out
    return SimpleNamespace(
        strategy=strategy, state=state, placed=placed, apply_fn=found["apply_fn"]
    )


def plan_config(cfg: Any, device_memory: int | None = None) -> dict[str, Any]:
    """The plan of ``cfg`` on this process's devices (see the module docstring)."""
    import jax

    from distrain._src.train.accumulation import accumulate_gradients
    from distrain._src.train.import_paths import resolve_callable
    from distrain._src.train.plan_advice import batch_split, problems_and_advice

    start = time.perf_counter()
    built = abstract_state(cfg)
    strategy, placed = built.strategy, built.placed
    total = per_device = 0
    for x in jax.tree.leaves(placed):
        total += math.prod(x.shape) * x.dtype.itemsize
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        per_device += math.prod(shard) * x.dtype.itemsize
    # The optimizer's state is the trainable parameters' only (optimizer.trainable); read
    # from the TrainState before placement (a strategy may wrap it: DiLoCo's islands).
    one = built.state
    opt_bytes, trainable_bytes, param_bytes = (
        sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
        for tree in (one.opt_state, one.select_trainable(one.params), one.params)
    )

    bind = dict(apply_fn=built.apply_fn, **cfg.train.step_kwargs)
    train_fn = resolve_callable(cfg.train.train_step, "train.train_step")
    step: Any = functools.partial(train_fn, **bind)
    if cfg.train.grad_accum_steps > 1:
        step = accumulate_gradients(step, cfg.train.grad_accum_steps)
    batch = strategy.distribute_batch(_abstract_batch(cfg))
    with strategy.scope():
        # The Trainer donates the state to each step: the new state reuses its buffers.
        memory = strategy.memory_analysis(step, args=(placed, batch), donate_argnums=0)
    peak = memory["peak_bytes"]
    plan = {
        "config": cfg.name,
        "devices": len(strategy.devices),
        "replicas": strategy.num_replicas_in_sync,
        "devices_per_replica": strategy.inner_axes or 1,
        "state_bytes_total": total,
        "state_bytes_per_device": per_device,
        "opt_state_bytes_total": opt_bytes,
        "trainable_param_bytes_total": trainable_bytes,
        "param_bytes_total": param_bytes,
        "peak_bytes_per_device": peak,
        "memory_analysis": memory,
        "device_memory_bytes": device_memory,
        "fits": None if device_memory is None else peak <= device_memory,
        "batch": batch_split(strategy, cfg.data.global_batch_size),
    }
    plan["problems"], plan["advice"] = problems_and_advice(plan, cfg)
    plan["seconds"] = round(time.perf_counter() - start, 1)
    return plan


def _report(plan: dict[str, Any], processes: int) -> str:
    lines = [
        f"distrain plan: {plan['config']} on {plan['devices']} devices "
        f"({plan['replicas']} replica(s) x {plan['devices_per_replica']})",
        f"  state, total:            {gib(plan['state_bytes_total'])}",
        f"  state per device:        {gib(plan['state_bytes_per_device'])}",
        f"  optimizer state, total:  {gib(plan['opt_state_bytes_total'])} (for "
        f"{gib(plan['trainable_param_bytes_total'])} of {gib(plan['param_bytes_total'])} "
        "parameters that train)",
        f"  state per process:       {gib(plan['state_bytes_per_process'])} "
        f"({processes} process(es))",
        f"  step peak per device:    {gib(plan['peak_bytes_per_device'])} "
        "(XLA:CPU's compiled estimate: arguments + outputs + temporaries - aliased)",
    ]
    if plan["device_memory_bytes"] is not None:
        verdict = "fits" if plan["fits"] else "does NOT fit"
        lines.append(f"  device memory:           {gib(plan['device_memory_bytes'])}: {verdict}")
    batch = plan["batch"]
    where = (
        f"split over {flow(batch['row_axes'])}"
        if batch["row_axes"] and batch["splits"]
        else "whole on every device of a replica"
        if batch["row_axes"]
        else "one replica per device"
    )
    lines.append(
        f"  batch rows per device:   {batch['rows_per_device']} "
        f"({batch['rows']} rows, {batch['rows_per_replica']} per replica, {where})"
    )
    lines += [f"  problem: {p}" for p in plan["problems"]]
    lines += [f"  to change: {a}" for a in plan["advice"]]
    lines.append(f"  planned in {plan['seconds']} s")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distrain plan",
        description="Will a config's training step fit? Compiles it for N virtual CPU "
        "devices from abstract shapes (nothing is allocated) and prints per-device bytes.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="the YAML run config")
    p.add_argument("--devices", type=int, required=True, metavar="N", help="devices in all")
    p.add_argument(
        "--processes", type=int, default=1, metavar="P", help="processes (hosts) the devices are in"
    )
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="e.g. 80GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def child_main(argv: Sequence[str]) -> int:
    """The subprocess: JAX already sees ``--devices`` CPU devices."""
    from distrain._src.train.config import load_config

    args = _parser().parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    device_memory = None if args.device_memory is None else parse_bytes(args.device_memory)
    _check_processes(cfg.strategy, args.devices, args.processes)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    plan = plan_config(cfg, device_memory)
    plan["processes"] = args.processes
    plan["state_bytes_per_process"] = plan["state_bytes_per_device"] * (
        args.devices // args.processes
    )
    print(json.dumps(plan) if args.json else _report(plan, args.processes), flush=True)
    return 0


def main(argv: Sequence[str]) -> int:
    """``distrain plan``: checks the arguments, then runs :func:`child_main` in a
    subprocess with ``--devices`` virtual CPU devices; returns its exit status."""
    args = _parser().parse_intermixed_args(argv)
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1. Received: {args.devices}.")
    if args.device_memory is not None:
        parse_bytes(args.device_memory)
    if args.processes < 1 or args.devices % args.processes:
        raise ValueError(
            f"--processes ({args.processes}) must be a positive divisor of --devices "
            f"({args.devices}): every process has the same number of devices."
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTRAIN_")}
    env.pop("TF_CONFIG", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    cmd = [sys.executable, "-m", "distrain._src.train.plan", *argv]
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    from distrain._src.command_errors import run_reporting_errors

    sys.exit(run_reporting_errors("plan", lambda: child_main(sys.argv[1:])))
