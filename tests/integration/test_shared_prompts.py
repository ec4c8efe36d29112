"""Two speed paths that must not change results, on real Ray actors and FSDP2 over gloo:
- shared-prefix rows (a group's prompt computed once) train like plain rows, on 1 and 2 workers;
- shared-memory refit: colocated CPU generation workers map the policy's weights and see every update."""

from __future__ import annotations

import pytest
import torch
from test_policy import policy_config
from tiny_model import TINY

from posttrain.algorithms.loss import NLLLoss
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.shared_weights import SharedWeights
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.workers.generation import GenerationConfig, make_generation
from posttrain.workers.policy.handle import Policy

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

NUM_STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelFromConfig(**TINY)
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_qwen2"))


def grouped_data() -> BatchedDataDict:
    """4 prompts (5-9 tokens) x 2 continuations (1-5 tokens): GRPO-shaped rows, trained on continuations."""
    generator = torch.Generator().manual_seed(3)
    rows, masks = [], []
    for _ in range(4):
        prompt = torch.randint(
            4, 100, (int(torch.randint(5, 10, (), generator=generator)),), generator=generator
        )
        for _ in range(2):
            continuation = torch.randint(
                4, 100, (int(torch.randint(1, 6, (), generator=generator)),), generator=generator
            )
            rows.append(torch.cat([prompt, continuation]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(continuation))]))
    width = max(len(row) for row in rows)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - len(t)))  # noqa: E731
    return BatchedDataDict(
        input_ids=torch.stack([pad(r) for r in rows]),
        input_lengths=torch.tensor([len(r) for r in rows]),
        token_mask=torch.stack([pad(m) for m in masks]).long(),
        sample_mask=torch.ones(len(rows)),
    )


def train(ray_session, model_dir, num_workers: int, **overrides) -> tuple[list[float], dict, torch.Tensor]:
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
    policy = Policy(cluster, policy_config(model_dir, **overrides))
    try:
        data = grouped_data()
        logprobs = policy.get_logprobs(data)["logprobs"] * data["token_mask"]
        losses = [policy.train(data, NLLLoss())["loss"][0] for _ in range(NUM_STEPS)]
        return losses, ray_session.get(policy.get_weights(only_changed=False)), logprobs
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_shared_prefix_rows_train_like_plain_rows_on_one_and_two_workers(ray_session, model_dir):
    plain_losses, plain_weights, plain_logprobs = train(
        ray_session, model_dir, 1, prefix_sharing=False, train_micro_batch_size=8
    )
    losses, weights, logprobs = train(
        ray_session, model_dir, 2, prefix_sharing=True, train_micro_batch_size=4
    )
    torch.testing.assert_close(logprobs, plain_logprobs, atol=1e-5, rtol=0)
    assert losses == pytest.approx(plain_losses, abs=1e-5)
    assert plain_losses[-1] < plain_losses[0]
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_colocated_generation_maps_the_policy_weights_and_sees_each_update(ray_session, model_dir):
    """Generation hosted in the policy's two worker processes (as GRPO places it on CPUs): no actor of its
    own; it maps the weights the policy shares, sees each update, and leaves the policy running."""
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, num_cpus_per_worker=0.5))
    policy = Policy(cluster, policy_config(model_dir))
    config = GenerationConfig(max_new_tokens=4, colocated=True)
    generation = make_generation(cluster, config, str(model_dir), host=policy.worker_group)
    try:
        assert generation.worker_group.workers == policy.worker_group.workers  # the policy's processes
        data = grouped_data()
        for step in range(2):
            handle = policy.share_weights()
            assert isinstance(handle, SharedWeights)
            generation.update_weights(handle)
            expected = ray_session.get(policy.get_weights(only_changed=False))
            for worker_weights in generation.worker_group.run_all("get_weights"):
                for name, tensor in expected.items():
                    torch.testing.assert_close(worker_weights[name], tensor, atol=0, rtol=0, msg=name)
            if step == 0:
                policy.train(data, NLLLoss())  # the next share rewrites the same file in place
                assert policy.share_weights().path == handle.path
        generation.shutdown()
        assert policy.get_logprobs(data)["logprobs"].shape == data["input_ids"].shape
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()
