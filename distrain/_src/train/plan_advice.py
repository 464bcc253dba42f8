"""What ``distrain plan`` says beyond its figures: where the batch's rows go, whether the
step's peak fits ``--device-memory``, and what to change when it does not.

Every sentence names numbers the plan computed and, where a config field would change
them, the override to type (``data.global_batch_size=256``). The suggestions are
directions, not promises: each changes the program, so plan again with it.
"""

from __future__ import annotations

import math
import sys
from typing import Any

# Above this share of --device-memory a plan that fits says it has little to spare:
# a GPU compiler and allocator (fusion, workspaces, fragmentation) differ from XLA:CPU's
# estimate by more than that.
MARGIN = 0.9

# LMConfig.remat's policies from the least recomputation to the most (examples/lm).
_REMAT_ORDER = ("none", "dots_saveable", "nothing_saveable")
# The LM (distrain.models.LMConfig) whose blocks scan_layers stacks.
_LM = "distrain.models:transformer"


def flow(axes: dict[str, int]) -> str:
    """``{fsdp: 8, tensor: 2}``: a mapping of axes as a YAML override spells it."""
    return "{" + ", ".join(f"{a}: {n}" for a, n in axes.items()) + "}"


def gib(n: float) -> str:
    """Bytes in the largest binary unit they reach, two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def batch_split(strategy: Any, rows: int) -> dict[str, Any]:
    """How a global batch of ``rows`` rows lies on ``strategy``'s devices.

    Returns ``{"rows", "replicas", "rows_per_replica", "row_axes", "splits",
    "rows_per_device"}``: ``row_axes`` are the inner axes a replica's rows split over
    (its model axes, ``"tensor"``, keep them whole), ``splits`` whether the rows per
    replica divide over them; when they do not, every device of the replica holds all
    of its rows (``strategy.batch_sharding``).
    """
    replicas = strategy.num_replicas_in_sync
    inner = strategy.inner_axes
    per_replica = rows // replicas
    row_axes: dict[str, int] = {}
    if inner:
        # A batch that divides by every inner axis shows which axes the rows split over.
        spec = strategy.batch_sharding(replicas * math.prod(inner.values())).spec
        first = spec[0] if len(spec) else None
        names = first if isinstance(first, tuple) else (first,)
        row_axes = {a: inner[a] for a in names if a in inner}
    k = math.prod(row_axes.values())
    splits = per_replica % k == 0
    return {
        "rows": rows,
        "replicas": replicas,
        "rows_per_replica": per_replica,
        "row_axes": row_axes,
        "splits": splits,
        "rows_per_device": per_replica // k if splits else per_replica,
    }


def problems_and_advice(plan: dict[str, Any], cfg: Any) -> tuple[list[str], list[str]]:
    """The plan's problems (the batch repeated over devices, a peak over the device's
    memory, little to spare) and what to change, as one-line sentences."""
    batch = plan["batch"]
    rows, replicas = batch["rows"], batch["replicas"]
    per_replica, row_axes = batch["rows_per_replica"], batch["row_axes"]
    k = math.prod(row_axes.values())
    problems: list[str] = []
    advice: list[str] = []
    if not batch["splits"]:
        step = replicas * k
        target = -(-rows // step) * step
        problems.append(
            f"the batch does not split over a replica's devices: its {per_replica} rows "
            f"per replica (data.global_batch_size={rows} over {replicas} replica(s)) do "
            f"not divide over the {k} devices of its batch axes {flow(row_axes)}, so each "
            f"of those devices holds all {per_replica} rows and computes their activations "
            f"({k} copies of the same work)."
        )
        advice.append(
            f"data.global_batch_size={target} ({target // step} row(s) per device; a "
            f"multiple of {step} = {replicas} replica(s) x {k} batch devices)."
        )
        inner = plan["devices_per_replica"] if isinstance(plan["devices_per_replica"], dict) else {}
        fsdp_axis = "fsdp" if "fsdp" in row_axes else next(iter(row_axes))
        t = next(
            (
                t
                for t in (2, 4, 8)
                if "tensor" not in inner
                and _tensor_rules(cfg) is not None
                and row_axes[fsdp_axis] % t == 0
                and per_replica % (k // t) == 0
            ),
            None,
        )
        if t is not None:
            axes = {a: n for a, n in inner.items() if a != fsdp_axis}
            axes = {"fsdp": row_axes[fsdp_axis] // t, **axes, "tensor": t}
            advice.append(
                f"or the same devices with fewer of them on the batch: a tensor axis, "
                f"'strategy.devices_per_replica={flow(axes)}' with {_tensor_rules(cfg)} "
                f"(the rows split over the other axes, {per_replica // (k // t)} per device; "
                f"each layer's heads and MLP columns over 'tensor')."
            )
    memory = plan["device_memory_bytes"]
    peak = plan["peak_bytes_per_device"]
    if memory is None:
        return problems, advice
    if peak <= memory:
        if peak > MARGIN * memory:
            problems.append(
                f"the step's peak per device ({gib(peak)}) fits --device-memory "
                f"({gib(memory)}) with {gib(memory - peak)} to spare: less than the "
                f"{1 - MARGIN:.0%} margin a GPU's compiler and allocator need (XLA:CPU's "
                "estimate is not theirs)."
            )
            advice.extend(_to_fit(plan, cfg, k))
        return problems, advice
    state = plan["state_bytes_per_device"]
    temp = plan["memory_analysis"].get("temp_bytes", 0)
    problems.append(
        f"the step's peak per device ({gib(peak)}) exceeds --device-memory "
        f"({gib(memory)}) by {gib(peak - memory)}: the state is {gib(state)} of it, "
        f"activations, gradients and workspace {gib(temp)}."
    )
    advice.extend(_to_fit(plan, cfg, k))
    return problems, advice


def _tensor_rules(cfg: Any) -> str | None:
    """The layout rules to name for a tensor axis: the model module's own
    ``TENSOR_PARALLEL_LAYOUT`` where it has one (the LM example's), else a pointer;
    ``None`` when the config has layout rules of its own (an experts' layout): naming
    other rules would replace them, a change that does not plan."""
    strategy = getattr(cfg, "strategy", None)
    if getattr(strategy, "layout", None) is not None:
        return None
    module = str(cfg.model.fn).partition(":")[0]
    if hasattr(sys.modules.get(module), "TENSOR_PARALLEL_LAYOUT"):
        return f"strategy.layout={module}:TENSOR_PARALLEL_LAYOUT"
    return "layout rules that split the weights over 'tensor' (strategy.layout, docs/scaling.md)"


def _to_fit(plan: dict[str, Any], cfg: Any, k: int) -> list[str]:
    """Changes that lower the peak, the cheapest first."""
    batch = plan["batch"]
    rows, replicas, per_replica = batch["rows"], batch["replicas"], batch["rows_per_replica"]
    inner = plan["devices_per_replica"] if isinstance(plan["devices_per_replica"], dict) else {}
    out: list[str] = []
    memory = plan["device_memory_bytes"]
    if plan["state_bytes_per_device"] >= memory:
        out.append(
            f"the state alone ({gib(plan['state_bytes_per_device'])} per device) does not "
            "fit: split it over more devices (more devices per replica, e.g. a larger "
            "'fsdp' axis in strategy.devices_per_replica, with --devices to match)."
        )
    accum = cfg.train.grad_accum_steps
    if batch["splits"] and batch["rows_per_device"] >= 2:
        if (per_replica // (2 * accum)) % k == 0 and per_replica % (2 * accum) == 0:
            out.append(
                f"train.grad_accum_steps={2 * accum}: the same update in micro-batches of "
                "half the rows, whose activations are alive one at a time."
            )
        half = rows // 2
        if half % (replicas * k) == 0:
            out.append(
                f"data.global_batch_size={half}: half the rows per device, half the "
                "activations (and a different update)."
            )
    remat = cfg.model.kwargs.get("remat") if isinstance(cfg.model.kwargs, dict) else None
    if isinstance(remat, str) and remat in _REMAT_ORDER[:-1]:
        stronger = _REMAT_ORDER[_REMAT_ORDER.index(remat) + 1]
        out.append(
            f"model.kwargs.remat={stronger}: the backward pass recomputes what the blocks "
            f"no longer keep (model.kwargs.remat is {remat!r} now; XLA:CPU's estimate may "
            "not show the saving a GPU's memory-aware scheduler makes, docs/lm.md)."
        )
    elif remat is None:
        out.append(
            "rematerialization: wrap the model's blocks in jax.checkpoint (nnx.remat) with "
            "a policy, so the backward pass recomputes activations instead of keeping them "
            "(XLA:CPU's estimate may not show the saving a GPU's memory-aware scheduler "
            "makes, docs/lm.md)."
        )
    if (
        str(cfg.model.fn) == _LM  # the LM whose blocks can be scanned
        and isinstance(remat, str)
        and remat != "none"
        and not cfg.model.kwargs.get("scan_layers")
        and cfg.model.kwargs.get("n_layers", 2) > 1
        and cfg.model.kwargs.get("pipeline_microbatches") is None
    ):
        out.append(
            "model.kwargs.scan_layers=true: the blocks stacked and run by one scan, so "
            "the backward pass keeps only each block's input (unrolled, XLA:CPU's "
            "schedule keeps every recomputed block's temporaries alive; layout rules of "
            "block leaves then need a leading null for the layer dimension)."
        )
    out.extend(_expert_capacity(cfg, inner))
    rules = _tensor_rules(cfg)
    if (
        batch["splits"]
        and batch["rows_per_device"] == 1
        and "tensor" not in inner
        and inner
        and rules is not None
    ):
        t = 8 if plan["devices"] >= 64 else 2
        axes = {"fsdp" if a == "model" else a: n for a, n in inner.items()}
        axes["tensor"] = t
        out.append(
            f"one row per device is the fewest the batch gives: to split each row, a tensor "
            f"axis on {t} times the devices, --devices {plan['devices'] * t} "
            f"'strategy.devices_per_replica={flow(axes)}' with {rules} (the "
            "same rows per batch device; each layer's heads and MLP columns split "
            f"{t} ways). On the same devices a tensor axis puts more rows on each."
        )
    return out


def _expert_capacity(cfg: Any, inner: dict[str, int]) -> list[str]:
    """For a mixture of experts on an ``"expert"`` axis without a per-device capacity:
    the capacity that bounds its exchange buffers (``dt.nn.moe``'s ``capacity_group``)."""
    kwargs = cfg.model.kwargs if isinstance(cfg.model.kwargs, dict) else {}
    if not kwargs.get("moe_experts") or inner.get("expert", 1) == 1:
        return []
    if kwargs.get("moe_capacity_group", "call") == "device" and kwargs.get("moe_capacity_factor"):
        return []
    factor = kwargs.get("moe_capacity_factor") or 1.25
    return [
        f"model.kwargs.moe_capacity_factor={factor} model.kwargs.moe_capacity_group=device: "
        f"each expert takes at most {factor}x its even share of each device's choices, so "
        "the exchange's buffers hold that many rows instead of 'expert' times every choice "
        "(the rest are dropped: training logs the share as moe_dropped)."
    ]
