"""Refit across nodes: the time and bytes of moving a policy's new weights into its generation workers, on
one node and across nodes of a Ray cluster.

Layouts, each with a 2-worker FSDP2 policy and Hugging Face generation workers:
- `1 node, shared memory`: colocated on one node; rank 0 writes its weights into a memfd the generation
  workers map (one in-place copy per refit, no bytes through the object store);
- `1 node, object store`: the same placement, weights through Ray's object store;
- `2 nodes, colocated`: one policy worker and one generation worker on each of two nodes (object store);
- `2 nodes, generation apart`: the policy on two nodes, one generation worker on a third (object store).
The multi-node layouts run on `ray.cluster_utils.Cluster` (a head and worker nodes of 1 CPU each, every one
its own raylet and object store, all on this machine): bytes between nodes travel through the object
managers over TCP on the machine's address, not between machines. Each refit follows one optimizer step
(so the weights changed) and times gathering the weights on the policy side plus loading them on every
generation worker. Prints a table, writes JSON.

Run: .venv/bin/python benchmarks/refit_nodes.py [--refits 5] [--out benchmarks/reference/refit_nodes_cpu.json]
     [--model DIR]  (a Hugging Face model directory instead of the tiny from-config model)
     [--machine-note "shared with other jobs"]  (appended to the machine's description in the JSON)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config import validate_config
from posttrain.distributed import BatchedDataDict, ClusterConfig, RayVirtualCluster
from posttrain.distributed.virtual_cluster import start_local_ray
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.generation import GenerationConfig, make_generation
from posttrain.workers.policy import Policy, PolicyConfig
from posttrain.workers.refit import Refit

TINY = dict(architecture="llama", hidden_size=128, num_layers=4, num_attention_heads=4, intermediate_size=512)


def train_batch() -> BatchedDataDict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 100, (8, 16), generator=generator)
    token_mask = torch.ones_like(input_ids)
    token_mask[:, 0] = 0
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=torch.full((8,), 16),
        token_mask=token_mask,
        sample_mask=torch.ones(8),
    )


def measure(model_dir: Path, cluster_cfg: ClusterConfig, colocated: bool, shared_memory: bool, refits: int):
    """Median seconds and bytes of `refits` refits, each after one optimizer step; the nodes used."""
    policy_cfg = validate_config(
        PolicyConfig,
        dict(model_name=str(model_dir), train_global_batch_size=8, train_micro_batch_size=4, seed=0),
    )
    gen_cfg = validate_config(GenerationConfig, dict(backend="hf", num_workers=1, num_cpus_per_worker=1))
    cluster = RayVirtualCluster(cluster_cfg)
    policy = Policy(cluster, policy_cfg)
    generation = make_generation(cluster if colocated else None, gen_cfg, str(model_dir))
    refit = Refit(policy, generation, "float32", shared_memory, move_memory=False)
    seconds, weight_bytes = [], []
    try:
        for _ in range(refits):
            policy.train(train_batch(), NLLLoss())
            start = time.perf_counter()
            generation.update_weights(refit.weights())
            seconds.append(time.perf_counter() - start)
            weight_bytes.append(policy.last_weights_bytes())
        nodes = {info["node_id"] for info in policy.worker_group.info + generation.worker_group.info}
        return {
            "refit_median_s": statistics.median(seconds),
            "refit_min_s": min(seconds),
            "weight_bytes_per_refit": int(statistics.median(weight_bytes)),
            "object_store_bytes_per_refit": 0 if shared_memory else int(statistics.median(weight_bytes)),
            "nodes": len(nodes),
        }
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def describe_model(model_dir: Path, name: str) -> str:
    """`name (N.NM parameters, fp32)`, the count read from the directory's safetensors files."""
    from safetensors import safe_open

    count = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            count += sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())
    return f"{name} ({count / 1e6:.1f}M parameters, fp32)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refits", type=int, default=5, help="refits per layout (median reported)")
    parser.add_argument("--out", default="results/refit_nodes.json", help="JSON output file")
    parser.add_argument("--model", default=None, help="a Hugging Face model directory (default: a tiny one)")
    parser.add_argument("--machine-note", default="", help="appended to the machine's description")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
            model = describe_model(model_dir, model_dir.name)
        else:
            model_dir = build_model_dir(ModelFromConfig(**TINY), Path(tmp) / "tiny")
            model = "sft_tiny (1.1M parameters, fp32)"
        start_local_ray(4, log_to_driver=False)
        one_node = ClusterConfig(workers_per_node=2, num_cpus_per_worker=1)
        for shared in (True, False):
            name = "1 node, shared memory" if shared else "1 node, object store"
            rows.append({"layout": name, **measure(model_dir, one_node, True, shared, args.refits)})
        ray.shutdown()

        from ray.cluster_utils import Cluster

        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(3):
            nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False)
        two_nodes = ClusterConfig(address=nodes.address, num_nodes=2, num_cpus_per_worker=1)
        rows.append(
            {"layout": "2 nodes, colocated", **measure(model_dir, two_nodes, True, False, args.refits)}
        )
        rows.append(
            {
                "layout": "2 nodes, generation apart",
                **measure(model_dir, two_nodes, False, False, args.refits),
            }
        )
        ray.shutdown()
        nodes.shutdown()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{machine}, {args.machine_note}" if args.machine_note else machine,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "model": model,
        "refits_per_layout": args.refits,
        "rows": rows,
    }
    for row in rows:
        print(
            f"{row['layout']:28s} {row['refit_median_s'] * 1000:8.1f} ms  "
            f"{row['object_store_bytes_per_refit']:>10,} B  ({row['nodes']} nodes)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
