"""dt.TPUStrategy and dt.initialize_tpu_system on CPU: the one error where there are no
TPUs, TF's device assignment and logical devices, multislice replicas, and the strategy
itself over the 8 CPU devices standing in for a slice's chips.

What needs a chip (the TPU runtime, ICI collectives, a slice of several hosts) cannot run
here; everything around it does. The strategy's body is tested by replacing the two TPU
probes (``check_tpu_available``, ``tpu_devices``) with the CPU devices: the rest (the
resolver, the device assignment, the mesh, run/reduce) is the code a TPU runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrain as dt
from distrain._src.cluster import tpu_system
from distrain._src.strategy import tpu_strategy as tpu_strategy
from distrain._src.strategy.tpu_strategy import (
    check_num_replicas,
    check_slices,
    devices_per_replica_from,
    split_spec,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DeviceAssignment:
    """The two attributes of TF's tf.tpu.experimental.DeviceAssignment that matter here."""

    def __init__(self, num_cores_per_replica, num_replicas=None):
        self.num_cores_per_replica = num_cores_per_replica
        if num_replicas is not None:
            self.num_replicas = num_replicas


# ------------------------------------------------------------- no TPUs: one clear error
NO_TPU = (
    r"dt\.TPUStrategy needs TPU devices, and this process has none: {}.*On CPUs and GPUs use "
    r"dt\.MirroredStrategy\(\) .* or dt\.MultiWorkerMirroredStrategy\(\) .*install "
    r"distrain\[tpu\]"
)


def test_no_tpus_after_jax_started(devices):
    with pytest.raises(
        RuntimeError,
        match=NO_TPU.format(
            r"JAX has already started, and its devices are \['cpu'\] \(no TPU among them\)"
        ),
    ):
        dt.TPUStrategy()
    with pytest.raises(RuntimeError, match=r"dt\.initialize_tpu_system needs TPU devices"):
        dt.initialize_tpu_system()
    assert not jax.distributed.is_initialized()


def test_no_tpus_before_anything_starts_in_a_fresh_process(tmp_path):
    """In a fresh process, with a GKE TPU pod's variables: the error comes before the
    resolver is read, the cluster joined or JAX's backend started."""
    if tpu_system.count_tpu_chips():
        pytest.skip("this machine has TPU chips: 'no TPUs' cannot be shown here")
    code = (
        "import jax, distrain as dt\n"
        "from jax._src import xla_bridge\n"
        "try:\n"
        "    dt.TPUStrategy()\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
        "print('backend started:', xla_bridge.backends_are_initialized())\n"
        "print('joined:', jax.distributed.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES="t-0.t,t-1.t", PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "ERROR dt.TPUStrategy needs TPU devices, and this process has none: no TPU chip on "
        "this machine's PCI bus" in done.stdout
    )
    assert "backend started: False" in done.stdout and "joined: False" in done.stdout


@pytest.mark.parametrize(
    "facts, reason",
    [
        (dict(started=["tpu"]), None),
        (dict(started=["cpu"]), r"JAX has already started, and its devices are \['cpu'\]"),
        (dict(requested="cpu", chips=4), r"JAX_PLATFORMS='cpu' leaves TPUs out"),
        (dict(requested="tpu,cpu", chips=4), None),
        (
            dict(chips=0),
            r"no TPU chip on this machine's PCI bus \(/sys/bus/pci/devices: no device "
            r"with Google's vendor id 0x1ae0",
        ),
        (dict(chips=0, force=True), None),  # JAX_FORCE_TPU_INIT, as in JAX
        (
            dict(chips=4, libtpu=False),
            r"4 TPU chips are attached, but JAX's TPU runtime "
            r"\(libtpu\) is not installed: pip install 'distrain\[tpu\]'",
        ),
        (dict(chips=4), None),
    ],
)
def test_whether_jax_will_run_on_tpus(facts, reason):
    given = dict(started=None, requested="", force=False, chips=0, libtpu=True) | facts
    found = tpu_system.absent_reason(**given)
    if reason is None:
        assert found is None
    else:
        assert found is not None and re.search(reason, found), found


def _pci_device(root, name, vendor, device):
    path = root / name
    path.mkdir()
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")


def test_tpu_chips_are_counted_on_the_pci_bus(tmp_path):
    _pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # Google's gVNIC: not a TPU
    _pci_device(tmp_path, "0000:00:05.0", "0x1af4", "0x1000")  # virtio
    assert tpu_system.count_tpu_chips(str(tmp_path)) == 0
    for i in range(4):  # a v4 host: four chips
        _pci_device(tmp_path, f"0000:00:0{6 + i}.0", "0x1ae0", "0x005e")
    assert tpu_system.count_tpu_chips(str(tmp_path)) == 4
    assert tpu_system.count_tpu_chips(str(tmp_path / "missing")) == 0


def test_chips_without_libtpu_name_the_extra_in_a_fresh_process(tmp_path):
    if tpu_system.importlib.util.find_spec("libtpu"):
        pytest.skip("libtpu is installed here: its absence cannot be shown")
    for i in range(4):
        _pci_device(tmp_path, f"0000:00:0{i}.0", "0x1ae0", "0x0063")  # a v5e host
    code = (
        "from distrain._src.cluster import tpu_system\n"
        f"tpu_system.PCI_DEVICES = {str(tmp_path)!r}\n"
        "import distrain as dt\n"
        "try:\n"
        "    dt.TPUStrategy()\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "4 TPU chips are attached, but JAX's TPU runtime (libtpu) is not installed: pip "
        "install 'distrain[tpu]'" in done.stdout
    ), done.stdout


def test_the_pci_table_is_jaxs():
    hardware = pytest.importorskip("jax._src.hardware_utils")
    table = getattr(hardware, "_TPU_PCI_DEVICE_IDS", None)
    assert table is not None, "jax renamed its TPU PCI table: compare tpu_system's by hand"
    # Every chip this jax detects (newer tables add ids: jax 0.12 has tpu8i/tpu8t).
    assert set(table) <= set(tpu_system.TPU_PCI_DEVICE_IDS)
    assert hardware._GOOGLE_PCI_VENDOR_ID == tpu_system.GOOGLE_PCI_VENDOR


def test_initialize_tpu_system_checks_its_argument():
    with pytest.raises(TypeError, match=r"cluster_resolver must be a dt\.ClusterResolver"):
        dt.initialize_tpu_system("local")


# ---------------------------------------------- TF's device assignment and logical devices
def test_device_assignment_maps_onto_devices_per_replica():
    assert devices_per_replica_from(None, None) == 1
    assert devices_per_replica_from(None, {"fsdp": 4}) == {"fsdp": 4}
    assert devices_per_replica_from(DeviceAssignment(2, 4), None) == 2
    with pytest.raises(ValueError, match=r"Give the devices of a replica once.*Received both"):
        devices_per_replica_from(DeviceAssignment(2), 2)
    with pytest.raises(
        TypeError,
        match=r"must be a tf\.tpu\.experimental\.DeviceAssignment.*"
        r"Received: int 2\. The distrain way: devices_per_replica=k",
    ):
        devices_per_replica_from(2, None)
    with pytest.raises(ValueError, match=r"num_cores_per_replica must be >= 1\. Received: 0"):
        devices_per_replica_from(DeviceAssignment(0), None)
    check_num_replicas(DeviceAssignment(2, 4), 8)
    check_num_replicas(DeviceAssignment(2), 8)  # no num_replicas: nothing to check
    with pytest.raises(
        ValueError,
        match=r"covers num_replicas x num_cores_per_replica = 2 x 2 = 4 "
        r"TPU devices, but the slice has 8.*expected num_replicas=4",
    ):
        check_num_replicas(DeviceAssignment(2, 2), 8)


def test_partition_dimensions_map_onto_inner_axes():
    assert split_spec([1, 4], {"model": 4}) == P(None, "model")
    assert split_spec([4, 1, 1], {"fsdp": 2, "tensor": 2}) == P(("fsdp", "tensor"), None, None)
    assert split_spec([2, 1, 2], {"fsdp": 2, "tensor": 2}) == P("fsdp", None, "tensor")
    assert split_spec([1, 1], {}) == P(None, None)
    with pytest.raises(
        ValueError,
        match=r"must multiply to the devices of a replica \(4, "
        r"devices_per_replica=\{'model': 4\}\)\. Received: \[1, 2\]",
    ):
        split_spec([1, 2], {"model": 4})
    with pytest.raises(
        ValueError,
        match=r"splits 2 dimensions, but the replica's inner axes are "
        r"\{'model': 4\}.*devices_per_replica=\{'rows': 2, 'cols': 2\}",
    ):
        split_spec([2, 2], {"model": 4})


def test_replicas_stay_inside_slices():
    def slices(n_slices, per_slice):
        return [
            types.SimpleNamespace(slice_index=s) for s in range(n_slices) for _ in range(per_slice)
        ]

    assert check_slices(jax.devices(), 8) == 1  # CPU devices have no slice_index
    assert check_slices(slices(2, 4), 2) == 2  # inside a slice
    assert check_slices(slices(2, 4), 8) == 2  # whole slices
    with pytest.raises(
        ValueError,
        match=r"A replica of 3 devices would cut across slices of 4 "
        r"devices.*dividing 4 \(a replica inside a slice\) or a multiple of it",
    ):
        check_slices(slices(2, 4), 3)
    uneven = slices(1, 4) + [types.SimpleNamespace(slice_index=1)]
    with pytest.raises(ValueError, match=r"same number of TPU devices\. Received: \{0: 4, 1: 1\}"):
        check_slices(uneven, 1)


# ------------------------------------- the strategy, over CPU devices standing in for chips
@pytest.fixture
def chips(devices, monkeypatch):
    """The 8 CPU devices in the role of a slice's chips (the only two TPU probes replaced)."""
    monkeypatch.setattr(tpu_system, "check_tpu_available", lambda what="": None)
    monkeypatch.setattr(tpu_system, "tpu_devices", lambda: list(devices))
    monkeypatch.setattr(tpu_system, "_system", None)
    return devices


ONE_HOST = dt.SimpleClusterResolver(None, 1, 0)


def test_strategy_over_every_chip_like_multi_worker_mirrored(chips):
    tpu = dt.TPUStrategy(ONE_HOST)
    assert tpu.num_replicas_in_sync == 8 and tpu.devices_per_replica == 1
    assert tpu.cluster_resolver is ONE_HOST and tpu.num_slices == 1
    assert (tpu.is_chief, tpu.num_processes, tpu.process_id) == (True, 1, 0)
    assert repr(tpu).startswith("TPUStrategy(num_replicas_in_sync=8, devices_per_replica=1")
    mirrored = dt.MirroredStrategy()

    def train(strategy):
        def step(state, batch):
            def loss(p):
                return dt.compute_average_loss((batch["x"] @ p["w"] - batch["y"]) ** 2)

            grads = jax.grad(loss)(state.params)
            return state.apply_gradients(grads=grads), loss(state.params)

        params = {"w": np.zeros((3,), np.float32)}
        state = strategy.put_replicated(dt.TrainState.create(params=params, tx=optax.sgd(0.1)))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 3)).astype(np.float32)
        data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
        state, loss = strategy.run(step, args=(state, strategy.distribute_batch(data)))
        return np.asarray(state.params["w"]), float(strategy.reduce("sum", loss))

    w_tpu, loss_tpu = train(tpu)
    w_ref, loss_ref = train(mirrored)
    np.testing.assert_allclose(w_tpu, w_ref, rtol=1e-6)
    assert loss_tpu == pytest.approx(loss_ref)


def test_tf_spellings_of_the_strategy(chips):
    s = dt.TPUStrategy(tpu_cluster_resolver=ONE_HOST, device_assignment=DeviceAssignment(2, 4))
    assert (s.num_replicas_in_sync, s.inner_axes) == (4, {"model": 2})
    s = dt.TPUStrategy(ONE_HOST, DeviceAssignment(4), True)  # experimental_spmd_xla_partitioning
    assert s.num_replicas_in_sync == 2
    s = dt.TPUStrategy(ONE_HOST, devices_per_replica={"fsdp": 2, "tensor": 2})
    assert s.inner_axes == {"fsdp": 2, "tensor": 2}
    with pytest.raises(
        TypeError,
        match=r"Give cluster_resolver once: TensorFlow's keyword "
        r"tpu_cluster_resolver",
    ):
        dt.TPUStrategy(ONE_HOST, tpu_cluster_resolver=ONE_HOST)
    with pytest.raises(TypeError, match=r"keyword device_assignment"):
        dt.TPUStrategy(ONE_HOST, DeviceAssignment(2), device_assignment=DeviceAssignment(2))
    with pytest.raises(
        TypeError,
        match=r"cluster_resolver must be a dt\.ClusterResolver.*"
        r"Received: str",
    ):
        dt.TPUStrategy("local")
    with pytest.raises(TypeError, match=r"experimental_spmd_xla_partitioning must be a bool"):
        dt.TPUStrategy(ONE_HOST, None, "yes")
    with pytest.raises(ValueError, match=r"2 x 2 = 4 TPU devices, but the slice has 8"):
        dt.TPUStrategy(ONE_HOST, DeviceAssignment(2, 2))


def test_logical_devices_inside_a_replica(chips, monkeypatch):
    strategy = dt.TPUStrategy(ONE_HOST, DeviceAssignment(2, 4))
    constraints = []
    real = jax.lax.with_sharding_constraint

    def recording(x, spec):
        constraints.append(spec)
        return real(x, spec)

    monkeypatch.setattr(jax.lax, "with_sharding_constraint", recording)

    def step(x):
        y = strategy.experimental_split_to_logical_devices(x * 2.0, [1, 2])
        return strategy.experimental_replicate_to_logical_devices(y + 1.0)

    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = strategy.run(step, args=(strategy.distribute_batch(x),))
    np.testing.assert_allclose(np.concatenate(strategy.experimental_local_results(out)), x * 2 + 1)
    assert P(None, "model") in constraints and P() in constraints
    with pytest.raises(RuntimeError, match=r"call it in the function given to strategy\.run"):
        strategy.experimental_split_to_logical_devices(jnp.ones((2, 2)), [1, 2])
    with pytest.raises(
        ValueError,
        match=r"one positive int per dimension of the tensor \(shape "
        r"\(2, 2\)\)\. Received: \[2\]",
    ):
        strategy.experimental_split_to_logical_devices(jnp.ones((2, 2)), [2])
    with pytest.raises(
        NotImplementedError,
        match=r"A JAX replica runs one SPMD program.*use "
        r"experimental_split_to_logical_devices",
    ):
        strategy.experimental_assign_to_logical_device(jnp.ones(2), 1)


def test_the_tpu_module_probes_are_what_the_strategy_calls():
    # The fixture above replaces these two names: the strategy must reach them through the
    # module, or the fixture would test nothing.
    import inspect

    source = inspect.getsource(tpu_strategy.TPUStrategy.__init__)
    assert "tpu_system.check_tpu_available(" in source and "tpu_system.tpu_devices()" in source


# ------------------------------------------------------------------- in a config, by the CLI
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


def test_a_config_trains_on_the_tpu_strategy(chips):
    """Issue 51: the README lists TPUStrategy first, and `strategy.name=tpu` was refused.
    A config trains on it (the 8 CPU devices as the slice's chips) through run_config,
    and the config's layout fields reach it."""
    from distrain._src.train.run import run_config
    from distrain._src.train.strategy_from_config import build_strategy

    cfg = dt.config.load_config(
        QUICKSTART, ["strategy.name=tpu", "train.epochs=null", "train.steps=3"]
    )
    result = run_config(cfg, progress_bar=False, print_fn=None)
    assert int(result.state.step) == 3 and np.isfinite(result.test_metrics["loss"])
    assert isinstance(result.state.params, dict)
    tpu = build_strategy(
        dt.config.load_config(
            QUICKSTART, ["strategy.name=tpu", "strategy.devices_per_replica={fsdp: 2}"]
        ).strategy
    )
    assert isinstance(tpu, dt.TPUStrategy) and tpu.inner_axes == {"fsdp": 2}


def test_the_tpu_strategy_in_a_config_without_tpus_is_one_config_error(devices):
    from distrain._src.train.strategy_from_config import build_strategy

    cfg = dt.config.load_config(QUICKSTART, ["strategy.name=tpu"])
    with pytest.raises(
        dt.config.ConfigError,
        match=r"^strategy.name=tpu \(dt.TPUStrategy\) needs TPU devices, and this process has "
        r"none: .* In a config: strategy.name=mirrored \(this machine's devices\) or "
        r"multi_worker_mirrored \(several machines\).$",
    ):
        build_strategy(cfg.strategy)
    with pytest.raises(
        dt.config.ConfigError,
        match=r"strategy.devices does not apply to strategy.name=tpu \(it takes every chip of "
        r"the slice\). Received: strategy.devices=\['cpu:0'\]",
    ):
        dt.config.load_config(QUICKSTART, ["strategy.name=tpu", "strategy.devices=[cpu:0]"])
