"""A ``data.fn`` whose final evaluation is SIGKILLed once (issue 51: a kill there).

``distrain train --config configs/quickstart.yaml data.validation_split=null
data.fn=tests.scripts.killed_in_evaluation:digits data.kwargs.kill_once=MARKER``
trains on the quickstart's digits; the test split is read only by the final
evaluation, and the first time it is (no ``MARKER`` file yet) process
``data.kwargs.process`` creates ``MARKER`` and SIGKILLs itself (or sends itself
``data.kwargs.signal_name``, e.g. SIGINT: a Ctrl-C). Running the same command again
(or ``distrain launch``'s restart) evaluates undisturbed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

from distrain._src.data.pipeline import ArrayPipeline
from distrain._src.padding import MASK_KEY
from examples.classification import digits as quickstart_digits


class _KilledOnFirstRead:
    """Global batches of the test split; the first read by ``process`` kills it."""

    def __init__(self, batches: Iterable[Any], marker: str, process: int, sig: str) -> None:
        self.batches, self.marker, self.process, self.sig = batches, marker, process, sig

    def __iter__(self) -> Iterator[Any]:
        me = int(os.environ.get("DISTRAIN_PROCESS_ID", "0"))
        if me == self.process and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            print(f"sending {self.sig} to process {me} in the final evaluation", flush=True)
            signal.raise_signal(getattr(signal, self.sig))
        return iter(self.batches)


def digits(*, kill_once: str, process: int = 0, signal_name: str = "SIGKILL") -> dict[str, Any]:
    """The quickstart's splits, the test split as batches of 64 that kill once."""
    splits = quickstart_digits()
    test = ArrayPipeline(  # whole global batches: each process takes its slice of them
        splits["test"],
        global_batch_size=64,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        mask_key=MASK_KEY,
        process_index=0,
        process_count=1,
    )
    killed = _KilledOnFirstRead(test, kill_once, process, signal_name)
    return {"train": splits["train"], "test": killed}
