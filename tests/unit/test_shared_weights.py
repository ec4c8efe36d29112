"""Shared-memory weights: aligned slots, and another process of the machine reads what the writer wrote."""

import pickle
import subprocess
import sys

import pytest
import torch

from posttrain.distributed.shared_weights import (
    ALIGNMENT,
    SharedWeightsWriter,
    map_shared_weights,
    plan_slots,
    shared_memory_supported,
)

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs memfd and /proc (Linux)")


def test_slots_are_aligned_and_sized_by_dtype():
    # 3 fp32 (12 bytes -> one 64-byte line), then 40 bf16 (80 bytes -> two lines), then 1 fp32.
    slots, size = plan_slots(
        {"a": ((3,), torch.float32), "b": ((4, 10), torch.bfloat16), "c": ((1,), torch.float32)}
    )
    assert [slots[n].offset for n in "abc"] == [0, ALIGNMENT, 3 * ALIGNMENT]
    assert slots["b"].shape == (4, 10) and slots["b"].dtype == "bfloat16"
    assert size == 4 * ALIGNMENT


def test_another_process_reads_what_the_writer_writes_in_place():
    writer = SharedWeightsWriter({"w": ((2, 3), torch.float32), "b": ((5,), torch.bfloat16)}, node_id="n1")
    try:
        writer.views["w"].copy_(torch.arange(6.0).view(2, 3))
        writer.views["b"].fill_(0.5)
        reader = (
            "import pickle, sys; from posttrain.distributed.shared_weights import map_shared_weights; "
            "v = map_shared_weights(pickle.load(sys.stdin.buffer), 'n1'); print(v['w'].flatten().tolist(), "
            "v['b'].float().tolist())"
        )

        def read():
            reply = subprocess.run(
                [sys.executable, "-c", reader],
                input=pickle.dumps(writer.handle),
                capture_output=True,
                check=True,
            )
            return reply.stdout.decode()

        assert read() == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] [0.5, 0.5, 0.5, 0.5, 0.5]\n"
        writer.views["w"].mul_(-1)  # an in-place update is what the next reader sees
        assert read().startswith("[-0.0, -1.0, -2.0, -3.0, -4.0, -5.0]")
    finally:
        writer.close()


def test_mapping_on_another_node_fails_naming_both_nodes():
    writer = SharedWeightsWriter({"w": ((2,), torch.float32)}, node_id="node-a")
    try:
        with pytest.raises(RuntimeError, match="node-a.*node-b"):
            map_shared_weights(writer.handle, "node-b")
    finally:
        writer.close()
