"""A Hugging Face generation worker that dies once, mid-generate: the first time a worker that decodes a
shard starting past sample 0 (rank 1 of 2) reaches its `on_call`-th generate call, and no marker file
exists yet, it writes the marker and kills its own process (as its node's loss would). Its replacement
finds the marker and decodes."""

import os
import signal
from pathlib import Path

from posttrain.workers.generation.hf_worker import HFGenerationWorker


def dies_once_worker(marker: Path, on_call: int) -> type:
    """The worker class; defined here, in a function, so that Ray ships it (and `marker`) by value."""

    class DiesOnceWorker(HFGenerationWorker):
        num_generate_calls = 0

        def generate(self, data, greedy=False, seed=0, sample_offset=0):
            self.num_generate_calls += 1
            if sample_offset > 0 and self.num_generate_calls == on_call and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return HFGenerationWorker.generate(self, data, greedy, seed, sample_offset)

    return DiesOnceWorker
