"""A flax NNX model trained through its own sharding annotations. Kept short: the logic
is in train.py.

python -m examples.nnx_partitioning.main      # 8 virtual CPU devices, bundled digits
"""

from examples.cpu_devices import use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)
    from examples.nnx_partitioning.train import annotated_strategy, train

    strategy = annotated_strategy()
    state, losses = train(strategy, steps=30)
    print(f"{strategy!r}: loss {losses[0]:.3f} -> {losses[-1]:.3f} (30 steps)")
    for name in ("d1", "d2", "out"):
        print(f"  {name}/kernel: {state.params[name]['kernel'].sharding.spec}")
