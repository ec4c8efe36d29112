"""An MoE policy with router losses and router replay trains alike on one and on two data-parallel workers
(FSDP2 over gloo, real Ray actors): losses, gradient norms, the logged router losses and expert load, and
the parameters after 3 steps agree to 1e-5. Micro-batches hold the same rows in both layouts
(length_bucketing off), as the per-micro-batch router losses require for equality."""

import pytest
import torch
from test_policy import NUM_ROWS, SEQ_LEN, Run, assert_same_training, make_train_data

from posttrain.models.build import ModelFromConfig, build_model_dir

pytestmark = pytest.mark.slow  # two policies on real Ray workers

MOE = {"load_balancing_coef": 0.1, "z_loss_coef": 0.01, "router_replay": True}


@pytest.fixture(scope="module")
def moe_runs(ray_session, tmp_path_factory):
    cfg = ModelFromConfig(
        architecture="qwen3_moe", hidden_size=32, num_layers=2, num_attention_heads=2, num_experts=4
    )
    model_dir = build_model_dir(cfg, tmp_path_factory.mktemp("tiny_moe"))
    data = make_train_data()
    routed = torch.randint(0, 4, (NUM_ROWS, SEQ_LEN, 2, 2), generator=torch.Generator().manual_seed(2))
    routed[..., 1] = (routed[..., 0] + 1) % 4  # two distinct experts per token
    routed[:, :4] = -1  # the first positions: not recorded, the router chooses
    data["routed_experts"] = routed.to(torch.int16)
    runs = {n: Run(model_dir, n, length_bucketing=False, moe=MOE) for n in (1, 2)}
    for run in runs.values():
        run.data = data
        run.train(ray_session)
    yield runs
    for run in runs.values():
        run.shutdown()


def test_one_and_two_workers_train_an_moe_alike_with_router_losses_and_replay(moe_runs):
    one, two = moe_runs[1], moe_runs[2]
    assert_same_training(two, one)
    for name in ("moe_load_balancing_loss", "moe_z_loss", "moe_replayed_tokens", "moe_expert_share_max"):
        assert [s[name][0] for s in two.steps] == pytest.approx([s[name][0] for s in one.steps], abs=1e-5)
    assert one.steps[0]["moe_replayed_tokens"][0] > 0
    assert one.losses[2] < one.losses[0]
