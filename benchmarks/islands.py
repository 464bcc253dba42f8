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
  ``cross_island_bytes_per_sync``, by replicas per island (1, 2, 4: 8, 4, 2 islands on 8
  devices), what one island puts on the slow link per outer step, whatever the
  algorithm: for each collective of the outer step whose groups cross islands, the
  bytes each device contributes (an all-reduce's buffer, an all-gather's input: its
  output over the group's size) times the island's devices that take part; float32
  with the hierarchical outer step (``outer_sync="hierarchical"``, the default; target:
  ``param_bytes``, one copy of the model) and ``..._before`` with
  ``outer_sync="flat"`` (R copies), the same with int4 outer gradients
  (``..._int4``, target ``int4_payload_bytes``); not with ``--toy``.
* **Quality**: a character-level transformer (the LM example's model) on
  TinyShakespeare (``../shared/data/``, or ``--data``), 4 islands at H=10 and H=50
  against synchronous data parallelism with the same global batches (the same tokens),
  inner optimizer (AdamW) and schedule, three seeds each; held-out loss at the end
  (``loss_gap_h10``, ``loss_gap_h50``: DiLoCo minus data parallel, mean over seeds;
  ``seed_spread``: the data-parallel runs' max - min) and every evaluation for the plot.
  The variants at H=10, against the same data-parallel runs and seeds: int8 and int4
  outer gradients (``loss_gap_int8_h10``, ``loss_gap_int4_h10``) and Streaming DiLoCo
  with 2 fragments and a delay of 1 step (``loss_gap_streaming_h10``). Each gap is
  compared with ``quality_target``, ``max(3 x seed_spread, 2 % of the data-parallel
  loss)`` (``within_target_*``).

``--arms`` runs some arms only and merges them into the existing ``--json``: every
field kept, those arms' runs and gaps replaced, the gaps taken against the file's
data-parallel runs (unless ``data_parallel`` is among the arms), the command appended
to ``merged_commands``.

``--toy`` runs both parts at smoke-test size (a small MLP, random tokens, a few steps).

``--communication-only`` recomputes the communication part alone and merges it into
``--json`` (every other field kept, the command appended to ``merged_commands``).

Example::

    python -m benchmarks.islands --json benchmarks/results/islands.json
    python -m benchmarks.islands --arms diloco_h10_int8 diloco_h10_int4 diloco_h10_streaming
    python -m benchmarks.islands --toy --json /tmp/islands.json
    python -m benchmarks.islands --communication-only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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

    @property
    def input_per_device(self) -> float:
        """Bytes each device puts in: the buffer, or an all-gather's share of its output,
        or a reduce-scatter's input."""
        g = max(len(x) for x in self.groups) if self.groups else 1
        if self.op == "all-gather":
            return self.bytes / g
        if self.op == "reduce-scatter":
            return self.bytes * g
        return self.bytes


def cross_island_bytes(found: list[Collective], island_of: Callable[[int], int]) -> float:
    """What island 0 puts on the cross-island link per outer step: for each collective in
    the outer step whose groups cross islands, each device's input times island 0's
    devices in its groups (the algorithm's own factors, ring or tree, left out)."""
    total = 0.0
    for c in found:
        if c.in_branch and c.crosses:
            ours = {d for g in c.groups for d in g if island_of(d) == 0}
            total += c.input_per_device * len(ours)
    return total


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
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(v) for v in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(v) for v in iota.group(4).split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(count, size))
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:  # XLA >= jax 0.12: groups over named axes of the program's mesh
        axes = re.findall(r"'([^']+)'=(\d+)", named.group(1))
        names, sizes = [a for a, _ in axes], [int(v) for _, v in axes]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", named.group(2))]
        rest = [i for i in range(len(names)) if i not in over]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + over)
        size = math.prod(sizes[i] for i in over)
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(-1, size))
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


# --- the runs ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is importable from the repository root
CONFIG = ROOT / "configs" / "shakespeare_char.yaml"
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
OUT = ROOT / "benchmarks" / "results" / "islands.json"
TOY = ["model.kwargs.d_model=32", "model.kwargs.n_layers=1", "model.kwargs.n_heads=2"]


class Recipe:
    """The config's model and inner optimizer (its schedule over ``steps``), the text's
    splits, and the per-replica step."""

    def __init__(self, overrides: list[str], steps: int, data: Path, rows_per_replica: int):
        import jax

        from distrain._src.train.import_paths import resolve_callable
        from distrain._src.train.optimizer import build_optimizer
        from distrain._src.train.run import _init_model
        from distrain.config import load_config
        from examples.lm import data as lm_data
        from examples.lm import train as lm_train

        schedule = [
            f"optimizer.schedule.kwargs.decay_steps={steps}",
            f"optimizer.schedule.kwargs.warmup_steps={max(1, steps // 20)}",
        ]
        self.cfg = load_config(CONFIG, [*overrides, *schedule, f"train.steps={steps}"])
        kw = self.cfg.model.kwargs
        self.seq_len = int(kw["seq_len"])
        self.rows_per_replica = rows_per_replica
        model_fn = resolve_callable(self.cfg.model.fn, "model.fn")
        self.apply_fn, self.params = _init_model(model_fn, jax.random.key(0), **kw)
        self.tx, _ = build_optimizer(self.cfg.optimizer, run_steps=steps)
        self.step = functools.partial(lm_train.train_step, apply_fn=self.apply_fn)
        # TinyShakespeare's hash is checked; another text (--data, e.g. the smoke
        # test's) is taken as given.
        if not data.is_file():
            raise SystemExit(
                f"benchmarks/islands.py: no text at {data} (TinyShakespeare ships in "
                "../shared/data/ beside the repository). Pass --data FILE."
            )
        digest = None if data.resolve() == DATA.resolve() else _sha256(data)
        with tempfile.TemporaryDirectory() as cache:
            shutil.copy(data, Path(cache) / "tinyshakespeare.txt")
            kwargs = {} if digest is None else {"sha256": digest}
            text = lm_data.load_tinyshakespeare(cache_dir=cache, **kwargs)
        self.train = np.frombuffer(text["train"], np.uint8)
        self.test = lm_data.pack([text["test"]], self.seq_len)

    def batches(self, seed: int, steps: int, rows: int) -> list[np.ndarray]:
        """``steps`` global batches of ``rows`` random windows of the training text."""
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(self.train) - self.seq_len - 1, (steps, rows))
        window = np.arange(self.seq_len + 1)
        return [self.train[s[:, None] + window] for s in starts]

    def heldout_loss(self, params: Any, rows: int) -> float:
        """Mean next-byte cross-entropy over the first ``rows`` held-out rows."""
        import jax
        import jax.numpy as jnp
        import optax

        @jax.jit
        def loss(p: Any, tokens: Any) -> Any:
            tokens = tokens.astype(jnp.int32)
            logits = self.apply_fn(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return float(np.mean([loss(params, self.test[i : i + 64]) for i in range(0, rows, 64)]))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(
    recipe: Recipe, strategy: Any, seed: int, steps: int, eval_every: int, eval_rows: int
) -> dict[str, Any]:
    """``steps`` steps of ``strategy.run`` on seed ``seed``'s batches; held-out loss of the
    (global) model every ``eval_every`` steps and at the end."""
    import jax

    import distrain as dt

    rows = recipe.rows_per_replica * strategy.num_replicas_in_sync
    state = strategy.put_replicated(
        dt.TrainState.create(params=recipe.params, tx=recipe.tx, rng=jax.random.key(seed))
    )
    view = getattr(strategy, "global_view", lambda s: s)
    curve: list[tuple[int, float]] = []
    start = time.perf_counter()
    for i, batch in enumerate(recipe.batches(seed, steps, rows), start=1):
        batch = strategy.distribute_batch({"tokens": batch})
        state, loss = strategy.run(recipe.step, args=(state, batch), donate_argnums=0)
        # One step at a time: with two in flight, XLA:CPU aborted in the islands' outer
        # all-reduce under load ("Expected 4 threads to join the rendezvous, but only 3
        # of them arrived"; twice in the suite). The figures are losses, not speed.
        jax.block_until_ready(loss)
        if i % eval_every == 0 or i == steps:
            curve.append((i, recipe.heldout_loss(view(state).params, eval_rows)))
            print(f"  step {i}: held-out loss {curve[-1][1]:.4f}", flush=True)
    return {"curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - start}


def communication(recipe: Recipe, islands: int, toy: bool = False) -> dict[str, Any]:
    """Collectives of the compiled steps: DiLoCo (per outer_dtype) and data parallel."""
    import jax
    import optax

    import distrain as dt

    n = jax.device_count()
    per_island = n // islands
    rows = recipe.rows_per_replica * n
    batch = {"tokens": recipe.batches(0, 1, rows)[0]}
    state = dt.TrainState.create(params=recipe.params, tx=recipe.tx)
    out: dict[str, Any] = {"bytes_per_sync": {}, "inner_cross_island_collectives": {}}
    for dtype in ("float32", "bfloat16", "int4"):
        strategy = dt.experimental.DiLoCoStrategy(
            islands=islands, sync_every=10, outer_optimizer=NESTEROV(optax), outer_dtype=dtype
        )
        placed = strategy.put_replicated(state)
        compiled = strategy.compile(recipe.step, (placed, strategy.distribute_batch(batch)))
        found = collectives(compiled.as_text(), lambda d: d // per_island, n)
        out["inner_cross_island_collectives"][dtype] = sum(
            c.crosses for c in found if not c.in_branch
        )
        out["bytes_per_sync"][dtype] = sum(
            c.sent_per_device for c in found if c.in_branch and c.crosses
        )
    mirrored = dt.MirroredStrategy()
    placed = mirrored.put_replicated(state)
    compiled = mirrored.compile(recipe.step, (placed, mirrored.distribute_batch(batch)))
    out["dp_bytes_per_step"] = sum(
        c.sent_per_device for c in collectives(compiled.as_text(), lambda d: 0, n)
    )
    out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(recipe.params))
    if not toy:  # 12 more compilations: the smoke test's budget has no room for them
        out.update(cross_island(recipe))
    return out


def cross_island(
    recipe: Recipe,
    dtypes: tuple[str, ...] = ("float32", "int4"),
    replicas: tuple[int, ...] = (1, 2, 4),
) -> dict[str, Any]:
    """``cross_island_bytes_per_sync[_<dtype>][_before]`` by replicas per island, read
    from the compiled steps (``outer_sync`` "hierarchical" and, before, "flat"), and each
    codec's payload (``<dtype>_payload_bytes``: one island's encoding)."""
    import jax
    import optax

    import distrain as dt
    from distrain._src.islands.codecs import payload_bytes

    n = jax.device_count()
    batch = {"tokens": recipe.batches(0, 1, recipe.rows_per_replica * n)[0]}
    state = dt.TrainState.create(params=recipe.params, tx=recipe.tx)
    out: dict[str, Any] = {}
    for dtype in dtypes:
        suffix = "" if dtype == "float32" else f"_{dtype}"
        for outer_sync, arm in (("hierarchical", ""), ("flat", "_before")):
            found = {}
            for per_island in replicas:
                strategy = dt.experimental.DiLoCoStrategy(
                    islands=n // per_island,
                    sync_every=10,
                    outer_optimizer=NESTEROV(optax),
                    outer_dtype=dtype,
                    outer_sync=outer_sync,
                )
                placed = strategy.put_replicated(state)
                compiled = strategy.compile(recipe.step, (placed, strategy.distribute_batch(batch)))
                island_of = lambda d, k=per_island: d // k  # noqa: E731
                hlo = collectives(compiled.as_text(), island_of, n)
                found[str(per_island)] = cross_island_bytes(hlo, island_of)
            out[f"cross_island_bytes_per_sync{suffix}{arm}"] = found
        if dtype != "float32":
            out[f"{dtype}_payload_bytes"] = sum(
                payload_bytes(x.shape, dtype) for x in jax.tree.leaves(recipe.params)
            )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Held-out loss against training tokens: each configuration's mean over seeds,
    with its seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = result["global_batch_rows"] * result["seq_len"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, runs in result["runs"].items():
        steps = [s for s, _ in runs[0]["curve"]]
        losses = np.array([[v for _, v in r["curve"]] for r in runs])
        x = np.array(steps) * tokens / 1e6
        label = (
            "data parallel"
            if name == "data_parallel"
            else name.replace("diloco_h", "DiLoCo, H = ")
            .replace("_streaming", ", streaming F = 2, d = 1")
            .replace("_", ", ")
        )
        ax.plot(x, losses.mean(0), label=label)
        ax.fill_between(x, losses.min(0), losses.max(0), alpha=0.2)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("held-out loss (nats per byte)")
    seeds = len(result["runs"]["data_parallel"])
    ax.set_title(f"TinyShakespeare, {result['islands']} islands, up to {seeds} seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def NESTEROV(optax: Any) -> Any:  # noqa: N802 - DiLoCo's outer optimizer
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


# An arm's name says what it trains: "data_parallel", or "diloco_h<H>" with a variant:
# "_int8" / "_int4" (the outer gradients' codec) or "_streaming" (Streaming DiLoCo, 2
# fragments, the exchange applied 1 step after its snapshot).
_ARM = re.compile(r"diloco_h(\d+)(?:_(int8|int4|streaming))?")
VARIANTS = ("int8", "int4", "streaming")


def strategy_of(arm: str, islands: int) -> Any:
    """The strategy an arm's name describes."""
    import optax

    import distrain as dt

    if arm == "data_parallel":
        return dt.MirroredStrategy()
    m = _ARM.fullmatch(arm)
    if m is None:
        raise SystemExit(
            f"benchmarks/islands.py: unknown arm {arm!r}; an arm is data_parallel or "
            "diloco_h<H> with an optional _int8, _int4 or _streaming (e.g. diloco_h10_int4)."
        )
    variant = m.group(2)
    kwargs: dict[str, Any] = {}
    if variant in ("int8", "int4"):
        kwargs["outer_dtype"] = variant
    elif variant == "streaming":
        kwargs.update(fragments=2, fragment_sync_delay=1)
    return dt.experimental.DiLoCoStrategy(
        islands=islands, sync_every=int(m.group(1)), outer_optimizer=NESTEROV(optax), **kwargs
    )


def gap_suffix(arm: str) -> str:
    """The suffix of an arm's result fields: ``h10`` (diloco_h10), ``int8_h10``."""
    m = _ARM.fullmatch(arm)
    assert m is not None, arm
    return f"{m.group(2)}_h{m.group(1)}" if m.group(2) else f"h{m.group(1)}"


def score(result: dict[str, Any]) -> None:
    """Fills ``seed_spread``, ``quality_target`` and each DiLoCo arm's ``loss_gap_*``
    (mean over its seeds of DiLoCo minus data parallel, seed by seed) and
    ``within_target_*``."""
    dp = [r["final"] for r in result["runs"]["data_parallel"]]
    result["seed_spread"] = max(dp) - min(dp)
    target = max(3 * result["seed_spread"], 0.02 * float(np.mean(dp)))
    result["quality_target"] = target
    for arm, runs in result["runs"].items():
        if arm == "data_parallel":
            continue
        gaps = [d["final"] - p for d, p in zip(runs, dp[: len(runs)], strict=True)]
        suffix = gap_suffix(arm)
        result[f"loss_gap_{suffix}"] = float(np.mean(gaps))
        result[f"within_target_{suffix}"] = abs(result[f"loss_gap_{suffix}"]) <= target


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toy", action="store_true", help="smoke-test size")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--sync-every", type=int, nargs="+", default=[10, 50])
    parser.add_argument(
        "--arms", nargs="+", default=None, help="run these arms only, merged into --json"
    )
    parser.add_argument("--rows-per-replica", type=int, default=4)
    parser.add_argument("--eval-rows", type=int, default=512)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=OUT)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the curves")
    parser.add_argument("--replot", action="store_true", help="only redraw --plot from --json")
    parser.add_argument(
        "--communication-only",
        action="store_true",
        help="only recompute the compiled programs' figures, merged into --json",
    )
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.json.read_text()), args.plot)
        return {}
    if args.toy:
        args.steps, args.seeds, args.sync_every, args.eval_rows = 10, 1, [5], 64
    arms = args.arms or [
        "data_parallel",
        *(f"diloco_h{h}" for h in args.sync_every),
        *([] if args.toy else [f"diloco_h10_{v}" for v in VARIANTS]),
    ]
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    command = "python -m benchmarks.islands " + " ".join(argv if argv is not None else sys.argv[1:])
    recipe = Recipe(TOY if args.toy else [], args.steps, args.data, args.rows_per_replica)
    shape = {
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "islands": args.islands,
        "steps": args.steps,
        "global_batch_rows": args.rows_per_replica * jax.device_count(),
        "seq_len": recipe.seq_len,
    }
    if args.communication_only:
        _check_mergeable(args.json, shape, 0, new_dp=True)
        fields = communication(recipe, args.islands, args.toy)
        result = _merge(args.json, shape, {}, command, fields)
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        return result
    strategies = {arm: strategy_of(arm, args.islands) for arm in arms}  # names checked first
    if args.arms is not None:
        _check_mergeable(args.json, shape, args.seeds, "data_parallel" in arms)
        result: dict[str, Any] = {}
    else:
        result = {"command": command, **shape, **communication(recipe, args.islands, args.toy)}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    eval_every = max(1, args.steps // 10)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for seed in range(args.seeds):
        for arm, strategy in strategies.items():
            r = train(recipe, strategy, seed, args.steps, eval_every, args.eval_rows)
            runs[arm].append(r)
            print(f"seed {seed} {arm}: held-out loss {r['final']:.4f} ({r['seconds']:.0f} s)")
        if args.arms is not None:  # every finished seed kept: a long run may be cut short
            result = _merge(args.json, shape, runs, command)
    if args.arms is None:
        result["runs"] = runs
        score(result)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None:
        plot(result, args.plot)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return result


def _check_mergeable(path: Path, shape: dict[str, Any], seeds: int, new_dp: bool) -> None:
    """Before training: ``--arms`` can merge into ``path`` (the same runs, the
    data-parallel runs of every seed it trains)."""
    if not path.is_file():
        if new_dp:
            return
        raise SystemExit(
            f"benchmarks/islands.py --arms: no {path} to merge into, and data_parallel is not "
            "among the arms (the gaps are taken against its runs). Add data_parallel to "
            "--arms or pass the --json of a full run."
        )
    result = json.loads(path.read_text())
    differs = {k: (result.get(k), v) for k, v in shape.items() if result.get(k) != v}
    dp_seeds = len(result.get("runs", {}).get("data_parallel", []))
    if differs or (not new_dp and dp_seeds < seeds):
        raise SystemExit(
            f"benchmarks/islands.py --arms: {path} describes other runs (file, now: "
            f"{differs or {'data-parallel seeds': (dp_seeds, seeds)}}), so the arms would not "
            "share its data-parallel runs and seeds. Pass the same options as its `command` "
            "(at most its seeds), or another --json."
        )


def _merge(
    path: Path,
    shape: dict[str, Any],
    runs: dict[str, Any],
    command: str,
    fields: dict[str, Any] | None = None,
) -> dict:
    """``runs`` (and top-level ``fields``) merged into the result file at ``path`` (read
    again now, under a lock, so that invocations on other arms running at the same time
    keep theirs): its fields kept, these arms' runs and ``fields`` replaced, the gaps
    recomputed, the command appended to ``merged_commands``."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        result = json.loads(text) if text.strip() else {**shape, "runs": {}}
        result["runs"].update(runs)
        result.update(fields or {})
        if command not in result.setdefault("merged_commands", []):
            result["merged_commands"].append(command)
        if result["runs"].get("data_parallel"):
            score(result)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
