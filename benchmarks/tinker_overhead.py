"""What serving costs: one training step (forward_backward + optim_step, LoRA rank 8) through the Tinker SDK
over loopback against `posttrain serve-tinker`, beside the same step on the service's model called in-process
(`TrainedModel.forward_backward` and `optim_step`: the computation without HTTP, protobuf or the SDK's
futures). Both models start equal and take the same batches, alternately, so machine noise hits both;
medians over the repeats. The target: at most 50 ms extra per step. Prints a table, writes JSON.

Run: .venv/bin/python benchmarks/tinker_overhead.py [--out benchmarks/reference/tinker_overhead_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone

import numpy as np
import tinker
import torch
from tinker import types

from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.tinker.model import Datum, TrainedModel
from posttrain.tinker.server import TinkerServer
from posttrain.tinker.service import TinkerService, TinkerServiceConfig


def batches(num_steps: int, batch_size: int, length: int, vocab: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, vocab, (batch_size, length + 1), generator=generator).tolist()
        for _ in range(num_steps)
    ]


def sdk_datum(tokens: list[int]) -> types.Datum:
    targets = {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=targets)


def direct_datum(tokens: list[int]) -> Datum:
    return Datum(
        tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="tinker_overhead_")
    spec = ModelFromConfig(architecture="llama", hidden_size=128, num_layers=4, num_attention_heads=4, seed=0)
    model_dir = str(build_model_dir(spec, f"{work}/model"))
    server = TinkerServer(
        TinkerService(TinkerServiceConfig(base_model=model_dir, states_dir=f"{work}/states"))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
    served = client.create_lora_training_client(base_model=model_dir, rank=8, seed=0).result()
    direct = TrainedModel(model_dir, 8, 32.0, 0)
    adam = types.AdamParams(learning_rate=1e-3)
    served_ms, direct_ms, gaps = [], [], []
    for batch in batches(args.steps + 2, args.batch_size, args.length, direct.vocab_size):
        start = time.perf_counter()
        out = served.forward_backward([sdk_datum(tokens) for tokens in batch], "cross_entropy").result()
        served.optim_step(adam).result()
        served_ms.append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        _, metrics = direct.forward_backward(
            [direct_datum(tokens) for tokens in batch], "cross_entropy", {}, True
        )
        direct.optim_step(adam.model_dump())
        direct_ms.append(1000 * (time.perf_counter() - start))
        gaps.append(abs(out.metrics["loss:sum"] - metrics["loss:sum"]) / metrics["loss:sum"])
    served_ms, direct_ms = served_ms[2:], direct_ms[2:]  # the first steps warm up both
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "batch": f"{args.batch_size} datums x {args.length} tokens, LoRA rank 8, {args.steps} steps",
        "direct_step_ms": statistics.median(direct_ms),
        "loopback_step_ms": statistics.median(served_ms),
        "overhead_ms": statistics.median(s - d for s, d in zip(served_ms, direct_ms)),
        "max_relative_loss_gap": max(gaps),
        "notes": [
            "model: llama, hidden 128, 4 layers, as configs/sft_tiny.yaml; one torch thread",
            "overhead: median over steps of (SDK over loopback) - (in-process) step time; target <= 50 ms",
            "max_relative_loss_gap: the two runs' losses agree (same model, same batches)",
        ],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    server.shutdown()


if __name__ == "__main__":
    main()
