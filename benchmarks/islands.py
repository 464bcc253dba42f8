"""DiLoCo's islands: what crosses islands, and the held-out loss it costs.

Two parts, written to one JSON file:

* **Communication**, read from the compiled programs (XLA's optimized HLO of
  ``strategy.run``'s step), not timed: ``inner_cross_island_collectives``, the
  collectives outside the outer step's conditional whose replica groups join devices of
  two islands (target 0); ``bytes_per_sync``, per ``outer_dtype``, what each device
  sends in the outer step's collectives; ``dp_bytes_per_step``, what each device sends
  in a ``MirroredStrategy`` step of the same model over the same devices. Bytes sent
  per device follow the ring algorithms: all-reduce ``2 (g-1)/g`` of the buffer,
  all-gather ``(g-1)/g`` of its output, reduce-scatter ``(g-1)`` of its output,
  all-to-all ``(g-1)/g``, collective-permute the buffer (``g``: the group's size).
* **Quality**: a character-level transformer (the LM example's model) on
  TinyShakespeare (``../shared/data/``, or ``--data``), 4 islands at H=10 and H=50
  against synchronous data parallelism with the same global batches (the same tokens),
  inner optimizer (AdamW) and schedule, three seeds each; held-out loss at the end
  (``loss_gap_h10``, ``loss_gap_h50``: DiLoCo minus data parallel, mean over seeds;
  ``seed_spread``: the data-parallel runs' max - min) and every evaluation for the plot.

``--toy`` runs both parts at smoke-test size (a small MLP, random tokens, a few steps).

Example::

    python -m benchmarks.islands --json benchmarks/results/islands.json
    python -m benchmarks.islands --toy --json /tmp/islands.json
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

# --- reading collectives from optimized HLO ----------------------------------------

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_OP = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(_COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_CALLS = re.compile(
    r"(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program.

    Attributes:
      op: ``"all-reduce"``, ``"all-gather"``, ...
      bytes: the bytes of its result (all of its outputs).
      groups: the device groups it runs over (logical device ids of the program).
      in_branch: whether it is inside a branch of a conditional (the outer step).
      crosses: whether a group joins devices of two islands.
    """

    op: str
    bytes: float
    groups: tuple[tuple[int, ...], ...]
    in_branch: bool
    crosses: bool

    @property
    def sent_per_device(self) -> float:
        """Bytes one device sends, by the ring algorithm of its kind."""
        g = max(len(x) for x in self.groups) if self.groups else 1
        if g == 1:
            return 0.0
        if self.op == "all-reduce":
            return 2 * (g - 1) / g * self.bytes
        if self.op == "reduce-scatter":
            return (g - 1) * self.bytes
        if self.op == "collective-permute":
            return self.bytes
        return (g - 1) / g * self.bytes


def _groups(line: str, n_devices: int) -> tuple[tuple[int, ...], ...]:
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return tuple(
            tuple(int(v) for v in p.split(",")) for p in re.findall(r"\{(\d+,\d+)", pairs.group(0))
        )
    listed = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if listed:
        return tuple(
            tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"\{([\d, ]*)\}", listed.group(1))
        )
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        import numpy as np

        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(v) for v in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(v) for v in iota.group(4).split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(count, size))
    return (tuple(range(n_devices)),)  # replica_groups={}: every device


def _result_bytes(shape: str) -> float:
    return sum(
        _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


def collectives(hlo: str, island_of: Callable[[int], int], n_devices: int = 0) -> list[Collective]:
    """The collectives of optimized HLO text, each marked in a conditional's branch or
    not and crossing islands or not (``island_of``: logical device id -> island)."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        # A computation's header starts its line (instructions are indented).
        head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    branch_roots = set()
    for lines in bodies.values():
        for line in lines:
            for group in _BRANCHES.findall(line):
                branch_roots.update(x.strip().lstrip("%") for x in group.split(","))
            if " conditional(" in line:
                branch_roots.update(
                    re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)
                )
    in_branch, todo = set(), list(branch_roots)
    while todo:
        comp = todo.pop()
        if comp in in_branch or comp not in bodies:
            continue
        in_branch.add(comp)
        for line in bodies[comp]:
            todo += _CALLS.findall(line)
            for group in _BRANCHES.findall(line):
                todo += [x.strip().lstrip("%") for x in group.split(",")]
    out = []
    for comp, lines in bodies.items():
        for line in lines:
            m = _OP.search(line)
            if not m or "-done" in line.split("=")[1].split("(")[0]:
                continue
            groups = _groups(line, n_devices)
            crosses = any(len({island_of(d) for d in g}) > 1 for g in groups)
            out.append(
                Collective(
                    m.group("op"),
                    _result_bytes(m.group("shape")),
                    groups,
                    comp in in_branch,
                    crosses,
                )
            )
    return out
