"""Checkpoints of the parameter servers, with orbax.

One checkpoint step holds, for every server, its pieces of the params, its
optax state and its version, plus a JSON record of the layout (which piece
of which variable lives where) so that a checkpoint is only restored into
the same variables on the same number of servers. The step number is server
0's version: the number of optimizer updates applied.

Example:
    >>> step = coordinator.save("/tmp/ps_ckpt")           # after join()
    >>> # ... a parameter server died; build everything again:
    >>> coordinator = ClusterCoordinator(new_strategy)    # variables created as before
    >>> coordinator.restore("/tmp/ps_ckpt") == step
    True
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from distrain._src import verbosity
from distrain._src.ps.servers import ServerGroup


def _meta(group: ServerGroup) -> dict[str, Any]:
    layout = group.layout
    return {
        "num_ps": layout.num_ps,
        "pieces": [
            [path, shard, list(rows) if rows else None] for path, shard, rows in layout.describe()
        ],
        "shapes": {
            path: list(shape) for path, shape in zip(layout.paths, layout.shapes, strict=True)
        },
    }


def save(group: ServerGroup, directory: str) -> int:
    """Writes every server's state; returns the step (server 0's version)."""
    states = group.get_state()
    step = int(states[0]["version"])
    directory = os.path.abspath(directory)
    verbosity.quiet_orbax()
    with ocp.CheckpointManager(directory) as manager:
        if step in manager.all_steps():
            return step  # nothing was applied since that save
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"servers": states}),
                meta=ocp.args.JsonSave(_meta(group)),
            ),
        )
        manager.wait_until_finished()
    return step


def restore(group: ServerGroup, directory: str, step: int | None = None) -> int:
    """Loads every server's state from ``directory`` (latest step by default)."""
    directory = os.path.abspath(directory)
    verbosity.quiet_orbax()
    with ocp.CheckpointManager(directory) as manager:
        steps = manager.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"No parameter-server checkpoint in {directory}. Expected a directory written "
                "by ClusterCoordinator.save."
            )
        if step is None:
            step = manager.latest_step()
        elif step not in steps:
            raise FileNotFoundError(
                f"No checkpoint step {step} in {directory}. Available steps: {sorted(steps)}."
            )
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        expected = _meta(group)
        if meta != expected:
            raise ValueError(
                f"The checkpoint in {directory} (step {step}) was written for other variables or "
                f"another number of parameter servers. Expected the layout {expected}; the "
                f"checkpoint has {meta}. Create the variables with the same params structure, "
                "num_ps and variable_partitioner as when it was saved."
            )
        template = {"servers": group.get_state()}
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))
        ).state
    group.set_state(restored["servers"])
    return int(step)
