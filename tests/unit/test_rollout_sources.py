"""GRPO's rollout collection and synchronous rollout source, in this process (no Ray): a tiny model's real
generation, the built-in arithmetic prompts and an environment that pays for replies of odd length. DAPO
dynamic sampling keeps the groups whose rewards differ first, generates more rounds while the step is
short, and fills the rest with groups without signal."""

import pytest
import torch

from posttrain.algorithms.grpo_config import DynamicSamplingConfig, GRPOLoopConfig
from posttrain.algorithms.grpo_rollouts import RolloutCollector, SyncRollouts
from posttrain.data import DataConfig, StatefulDataLoader, load_datasets
from posttrain.environments.interface import EnvironmentReturn
from posttrain.models.build import ModelFromConfig, build_model_dir, load_tokenizer
from posttrain.utils.timer import Timer
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.refit import Refit

PROMPTS, GROUP = 4, 4


class OddLengthEnvironment:
    """Reward 1 for a reply with an odd number of characters: about half of all replies, so some groups
    of four agree and some do not."""

    def step(self, message_logs, metadata):
        rewards = torch.tensor([float(len(log[-1]["content"]) % 2) for log in message_logs])
        n = len(message_logs)
        return EnvironmentReturn(
            [{"role": "environment", "content": ""}] * n,
            list(metadata),
            [None] * n,
            rewards,
            torch.ones(n, dtype=torch.bool),
            [None] * n,
        )


class LoopOnlyPolicy:
    """Refit's view of a policy that never trained: nothing is sent, nothing moves."""

    def get_weights(self, only_changed=True, dtype=None):
        return {}

    def last_weights_bytes(self):
        return 0


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    spec = ModelFromConfig(
        architecture="qwen2",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        seed=5,
    )
    model_dir = str(build_model_dir(spec, tmp_path_factory.mktemp("rollout_model")))
    tokenizer = load_tokenizer(model_dir)
    records, _, _ = load_datasets(DataConfig(dataset="arithmetic", seed=3), tokenizer)
    generation = HFGenerationWorker(GenerationConfig(max_new_tokens=6, temperature=1.0), model_dir)
    return tokenizer, records, generation


def collector(parts, dynamic: bool, max_rounds: int = 4) -> RolloutCollector:
    tokenizer, records, generation = parts
    cfg = GRPOLoopConfig(
        num_prompts_per_step=PROMPTS,
        num_generations_per_prompt=GROUP,
        max_seq_len=256,
        dynamic_sampling=DynamicSamplingConfig(enabled=dynamic, max_num_gen_batches=max_rounds),
    )
    loader = StatefulDataLoader(records, PROMPTS, shuffle=False)
    return RolloutCollector(cfg, generation, loader, tokenizer, {"arithmetic": OddLengthEnvironment()}, 6)


def group_has_signal(rewards: torch.Tensor) -> list[bool]:
    return [bool(group.max() > group.min()) for group in rewards.view(-1, GROUP)]


def test_without_dynamic_sampling_one_round_fills_the_step(parts):
    source = collector(parts, dynamic=False)
    rollouts, metrics = source.collect(step=1)
    assert rollouts.size == PROMPTS * GROUP and metrics["num_generation_rounds"] == 1.0
    assert torch.equal(rollouts["rewards"], rollouts["total_reward"])
    expected = torch.tensor([float(len(log[-1]["content"]) % 2) for log in rollouts["message_log"]])
    assert torch.equal(rollouts["rewards"], expected)


def test_dynamic_sampling_puts_groups_with_signal_first_and_counts_rounds(parts):
    source = collector(parts, dynamic=True)
    rollouts, metrics = source.collect(step=1)
    rounds = int(metrics["num_generation_rounds"])
    with_signal = int(metrics["dynamic_sampling/samples_with_signal"])
    filled = int(metrics["dynamic_sampling/filled_without_signal"])
    assert rollouts.size == PROMPTS * GROUP == with_signal + filled
    signal = group_has_signal(rollouts["rewards"])
    assert signal == [True] * (with_signal // GROUP) + [False] * (filled // GROUP)
    assert 1 <= rounds <= 4 and (filled == 0 or rounds == 4)  # short after the last round only
    one_round = collector(parts, dynamic=False).collect(step=1)[0]
    first_round_signal = sum(group_has_signal(one_round["rewards"]))
    assert (rounds == 1) == (first_round_signal == PROMPTS)  # a full first round needs no second


def test_a_step_short_of_signal_after_the_last_round_is_filled_without_signal(parts):
    """One round allowed: the groups that agree fill the step after those that do not."""
    source = collector(parts, dynamic=True, max_rounds=1)
    rollouts, metrics = source.collect(step=2)
    signal = group_has_signal(rollouts["rewards"])
    assert metrics["num_generation_rounds"] == 1.0
    assert 0 < sum(signal) < PROMPTS  # this seed's round has groups of both kinds
    assert signal == sorted(signal, reverse=True)
    assert metrics["dynamic_sampling/samples_with_signal"] == GROUP * sum(signal)


def test_sync_source_batches_carry_the_step_and_refit_only_after_an_update(parts):
    tokenizer, records, generation = parts
    refit = Refit(LoopOnlyPolicy(), generation, "float32", shared_memory=False, move_memory=False)
    source = SyncRollouts(collector(parts, dynamic=False), refit)
    timer = Timer()
    batch, extra = source.next_batch(step=3, timer=timer)
    assert (batch.index, batch.policy_version, extra) == (4, 3, {})
    assert "refit" not in timer.get_timing_metrics() and "generation" in timer.get_timing_metrics()
    source.after_update(step=3)
    assert refit.stale
    source.next_batch(step=4, timer=timer)
    assert not refit.stale and "refit" in timer.get_timing_metrics()
    assert source.loader_state() == source.collector.loader.state_dict()


def test_the_same_step_collects_the_same_rollouts(parts):
    """Seeds derive from the step: a resumed run regenerates what the interrupted one did."""
    first = collector(parts, dynamic=False).collect(step=7)[0]
    again = collector(parts, dynamic=False).collect(step=7)[0]
    other = collector(parts, dynamic=False).collect(step=8)[0]
    texts = [log[-1]["content"] for log in first["message_log"]]
    assert texts == [log[-1]["content"] for log in again["message_log"]]
    assert texts != [log[-1]["content"] for log in other["message_log"]]
