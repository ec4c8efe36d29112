"""posttrain on a Ray cluster of several nodes (`ray.cluster_utils.Cluster`: a head and worker nodes, each
its own raylet, all on this machine): one training worker per node gives the losses of the one-node run
(SFT, synchronous GRPO, DPO), and a node removed mid-run (SFT, GRPO) is survived in the same process: the
workers are rebuilt on the nodes left and training resumes from the latest checkpoint with the losses of
an uninterrupted run. A run that cannot be placed fails at once, naming the config key and the nodes' free
resources. GRPO across hosts (generation apart, asynchronous, a host lost mid-run) is
test_multihost_netns."""

import os
import time

import pytest
import ray
from test_grpo import overrides as grpo_overrides
from test_sft import tiny_overrides as sft_overrides
from tiny_model import tiny_from_config

from posttrain.algorithms import grpo, sft
from posttrain.algorithms.recovery import train_with_restarts
from posttrain.config import load_typed_config
from posttrain.distributed.placement import UnplaceableError

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes of 1 CPU each (so no node can hold two 1-CPU workers: every run below
    spans nodes); the driver joins it. The tests' local Ray instance, if running, is stopped meanwhile."""
    from conftest import start_test_ray, workers_python_path
    from ray.cluster_utils import Cluster

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = workers_python_path()  # the raylets' workers inherit it
    # Ray declares a node dead after missed health checks (~17 s at its defaults): quicker here.
    health = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": health})
    for _ in range(2):
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
        if was_running:
            start_test_ray()


def remove_worker_node(nodes, worker_group) -> str:
    """Remove (kill) the node of the group's last worker that is not on the head; returns its node id."""
    head_id = nodes.head_node.node_id
    by_id = {node.node_id: node for node in nodes.list_all_nodes()}
    node_id = next(info["node_id"] for info in reversed(worker_group.info) if info["node_id"] != head_id)
    nodes.remove_node(by_id[node_id], allow_graceful=False)
    return node_id


def restore_worker_nodes(nodes, count: int = 2) -> None:
    """Add 1-CPU worker nodes until there are `count` (a test before may have removed one)."""
    while len(nodes.worker_nodes) < count:
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()


def last_values(log_dir, key: str) -> dict[int, list[float]]:
    """Every value logged for `key` at each step (a step trained again after a recovery appears twice)."""
    import json

    values: dict[int, list[float]] = {}
    for line in open(os.path.join(log_dir, "metrics.jsonl")):
        record = json.loads(line)
        if key in record:
            values.setdefault(record["step"], []).append(record[key])
    return values


def test_sft_across_nodes_equals_one_node_and_survives_a_lost_node(cluster, tmp_path, capsys):
    """Reference: both workers on one node. Then one worker on each of two nodes, checkpoints every 2
    steps; after step 3 the second worker's node is removed. The run notices, names the node, rebuilds
    its workers on the nodes left, resumes from step 2 and trains to step 6: every logged loss, before and
    after the loss of the node, equals the one-node run's."""
    settings = {
        "sft.max_num_steps": 6,
        "sft.val_period": 1000,
        "checkpointing.save_period": 2,
        "checkpointing.keep_top_k": 10,
        "sft.export_final_model": "false",
    }
    one_node = load_typed_config(
        sft.SFTConfig,
        os.path.join(REPO, "configs", "sft_tiny.yaml"),
        sft_overrides(
            tmp_path / "one",
            **settings,
            **{"cluster.workers_per_node": 2, "cluster.num_cpus_per_worker": 0.5},
        ),
    )
    train_with_restarts(one_node, sft.setup, sft.sft_train)
    reference = last_values(tmp_path / "one", "train/loss")

    two_nodes = load_typed_config(
        sft.SFTConfig,
        os.path.join(REPO, "configs", "sft_tiny.yaml"),
        sft_overrides(
            tmp_path / "two",
            **settings,
            **{"cluster.num_nodes": 2, "cluster.num_cpus_per_worker": 1, "cluster.max_restarts": 1},
        ),
    )
    lost: dict[str, float | str] = {}

    def train(run):
        if not lost:  # the first attempt: 3 steps, then a worker's node goes away
            assert len({info["node_id"] for info in run.policy.worker_group.info}) == 2
            sft.sft_train(run, num_steps=3)
            lost["node"] = remove_worker_node(cluster, run.policy.worker_group)
            lost["at"] = time.monotonic()
        else:
            lost["recovered_after_s"] = time.monotonic() - lost["at"]
        return sft.sft_train(run)

    run, _ = train_with_restarts(two_nodes, sft.setup, train)
    assert run.step == 6
    losses = last_values(tmp_path / "two", "train/loss")
    assert sorted(losses) == list(range(1, 7))
    assert len(losses[3]) == 2  # step 3 trained before the loss, and again after resuming from step 2
    for step, values in losses.items():
        for value in values:
            assert value == pytest.approx(reference[step][0], abs=1e-5), step
    out = capsys.readouterr().out
    assert f"lost node(s): {lost['node']}" in out and "restart 1 of 1" in out
    print(f"rebuilt and resumed {lost['recovered_after_s']:.1f} s after the node was removed")
    assert lost["recovered_after_s"] < 60, lost


def test_actors_that_cannot_be_placed_fail_at_once_naming_the_key_and_the_nodes(cluster, tmp_path):
    """Environment actors of 2 CPUs fit on no node of 1 CPU: an error within seconds, before any worker
    starts, instead of a run that waits forever for them."""
    cfg = load_typed_config(
        grpo.GRPOConfig,
        os.path.join(REPO, "configs", "grpo_tiny.yaml"),
        grpo_overrides(
            tmp_path,
            **{
                "cluster.num_nodes": 2,
                "cluster.num_cpus_per_worker": 1,
                "+env.arithmetic.num_cpus": 2,
                "env.arithmetic.num_workers": 1,
            },
        ),
    )
    start = time.monotonic()
    with pytest.raises(UnplaceableError) as error:
        grpo.setup(cfg)
    assert time.monotonic() - start < 30
    message = str(error.value)
    assert message.startswith("env.arithmetic.num_workers x num_cpus asks for 1 x {CPU: 2}")
    live = [node for node in ray.nodes() if node["Alive"]]
    assert message.count("CPUs, 0 GPUs free") == len(live)  # every node, with what it has free


def test_dpo_with_one_worker_per_node_equals_the_one_node_run(cluster, tmp_path):
    """DPO (a frozen reference on every worker) on a fresh tiny model: 2 workers on one node, then one on
    each of two nodes; the losses of both steps agree."""
    from posttrain.algorithms import dpo, pairs

    def run_dpo(log_dir, **layout):
        values = {
            "logger.log_dir": log_dir,
            "logger.tensorboard_enabled": "false",
            "policy.model_name": "null",
            "policy.model.from_config": tiny_from_config(seed=3),
            "policy.train_global_batch_size": 16,
            "policy.train_micro_batch_size": 8,
            "data.num_train": 64,
            "data.num_val": 16,
            "dpo.max_val_samples": 16,
            "dpo.max_num_steps": 2,
            "dpo.val_period": 1000,
            "dpo.export_final_model": "false",
            "checkpointing.enabled": "false",
            **layout,
        }
        cfg = load_typed_config(
            dpo.DPOConfig,
            os.path.join(REPO, "configs", "dpo_tiny.yaml"),
            [f"{key}={value}" for key, value in values.items()],
        )
        train_with_restarts(cfg, pairs.setup, pairs.train)
        return last_values(log_dir, "train/loss")

    one = run_dpo(tmp_path / "one", **{"cluster.workers_per_node": 2, "cluster.num_cpus_per_worker": 0.5})
    two = run_dpo(tmp_path / "two", **{"cluster.num_nodes": 2, "cluster.num_cpus_per_worker": 1})
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step][0] == pytest.approx(one[step][0], abs=1e-5)


def test_grpo_across_nodes_equals_one_node_and_survives_a_lost_node(cluster, tmp_path, capsys):
    """Synchronous GRPO, generation colocated on the policy's workers. Reference: both workers on one
    node, 3 steps. Then one worker on each of two nodes (0.9 CPU each, so the environment's 0.1 CPU still
    fits once a node is gone), checkpoints every 2 steps; after step 2 a worker's node is removed, the run
    rebuilds on the two nodes left, resumes from step 2 and trains step 3. Every step's loss and mean
    reward (sampled, so the generated tokens agree too), before and after the loss, equals the one-node
    run's, and the trainer's logprobs of the generated tokens agree with generation's on every step."""
    restore_worker_nodes(cluster)  # the SFT test removed one
    settings = {"grpo.max_num_steps": 3, "grpo.val_period": 0, "checkpointing.keep_top_k": 10}
    one_node = load_typed_config(
        grpo.GRPOConfig,
        os.path.join(REPO, "configs", "grpo_tiny.yaml"),
        grpo_overrides(tmp_path / "one", **settings, **{"cluster.workers_per_node": 2}),
    )
    train_with_restarts(one_node, grpo.setup, grpo.grpo_train)
    reference = {key: last_values(tmp_path / "one", key) for key in ("train/loss", "train/reward_mean")}

    two_nodes = load_typed_config(
        grpo.GRPOConfig,
        os.path.join(REPO, "configs", "grpo_tiny.yaml"),
        grpo_overrides(
            tmp_path / "two",
            **settings,
            **{"cluster.num_nodes": 2, "cluster.num_cpus_per_worker": 0.9, "cluster.max_restarts": 1},
        ),
    )
    lost: dict[str, str] = {}

    def train(run):
        if not lost:  # the first attempt: 2 steps, then a worker's node goes away
            assert len({info["node_id"] for info in run.policy.worker_group.info}) == 2
            grpo.grpo_train(run, num_steps=2)
            lost["node"] = remove_worker_node(cluster, run.policy.worker_group)
        else:
            assert len({info["node_id"] for info in run.policy.worker_group.info}) == 2
        return grpo.grpo_train(run)

    run, _ = train_with_restarts(two_nodes, grpo.setup, train)
    assert run.step == 3
    for key, expected in reference.items():
        values = last_values(tmp_path / "two", key)
        assert {step: len(v) for step, v in values.items()} == {1: 1, 2: 1, 3: 1}
        for step, (value,) in values.items():
            assert value == pytest.approx(expected[step][0], abs=1e-6), (key, step)
    for step, errors in last_values(tmp_path / "two", "train/token_mult_prob_error").items():
        assert all(1.0 <= error <= 1.01 for error in errors), (step, errors)
    assert reference["train/loss"][3][0] != 0.0  # a loss that could differ
    out = capsys.readouterr().out
    assert f"lost node(s): {lost['node']}" in out and "restart 1 of 1" in out
    # The nodes share this machine's address: the driver counts nodes, not addresses.
    assert out.count("policy: 2 workers on 2 nodes: ") == 2, out[-4000:]


def test_generation_workers_whose_node_is_lost_are_replaced_on_another_node(cluster, tmp_path, capsys):
    """Two generation workers apart from the policy, on one worker node (the head's CPU is taken), hold
    new weights. Their node is removed; the next generate notices, names the node, starts both
    replacements in their bundles, which Ray has moved to the other worker node, loads them from the
    weights source and generates the batch again: the same samples as before the loss."""
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from test_hf_generation import make_prompt_batch, refit_with_scaled_weights

    from posttrain.distributed.worker_group import wait_until_marked_dead
    from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer
    from posttrain.workers.generation import GenerationConfig, HFGeneration

    restore_worker_nodes(cluster)
    head = NodeAffinitySchedulingStrategy(cluster.head_node.node_id, soft=False)
    blocker = ray.remote(num_cpus=1)(Blocker).options(scheduling_strategy=head).remote()
    ray.get(blocker.ready.remote())
    model_dir = str(build_model_dir(ModelFromConfig(hidden_size=32, num_layers=2), tmp_path / "model"))
    prompts = make_prompt_batch(load_tokenizer(model_dir), ["hello", "ab", "2+2=", "xyz"])
    cfg = GenerationConfig(max_new_tokens=8, colocated=False, num_workers=2, num_cpus_per_worker=0.5)
    generation = HFGeneration(None, cfg, model_dir, max_worker_restarts=1)
    try:
        refit_with_scaled_weights(generation, model_dir)
        first = generation.generate(prompts, seed=5)
        lost_node = remove_worker_node(cluster, generation.worker_group)
        assert wait_until_marked_dead({lost_node})  # its workers may answer a call in flight till then
        again = generation.generate(prompts, seed=5)
        nodes = {info["node_id"] for info in generation.worker_group.info}
        assert lost_node not in nodes and cluster.head_node.node_id not in nodes
        assert generation.num_worker_restarts == 1
        for key in ("output_ids", "logprobs", "generation_lengths"):
            assert torch.equal(again[key], first[key]), key
        out = capsys.readouterr().out
        assert (
            f"lost node(s): {lost_node}" in out
            and "generating samples again: [0, 2) on rank 0, [2, 4) on rank 1" in out
        )
    finally:
        generation.shutdown()
        ray.kill(blocker)


class Blocker:
    """Holds a CPU of the node it is placed on."""

    def ready(self) -> bool:
        return True
