"""TensorFlow-2.x names and input idioms that ported code relies on."""

import distrain as dt


def test_experimental_multi_worker_mirrored_strategy_is_the_same_class():
    # TF 2.x code spells it tf.distribute.experimental.MultiWorkerMirroredStrategy.
    assert dt.experimental.MultiWorkerMirroredStrategy is dt.MultiWorkerMirroredStrategy
    assert "MultiWorkerMirroredStrategy" in dt.experimental.__all__
