"""A tiny Qwen2-VL through the training backend: image batches (rows with and without images, images of
different sizes) give the same logprobs and updates on 1 and 2 workers and with micro-batches of 2 and of
the whole batch; logprobs follow the contract (position t = log p(token t | < t)) of a plain forward; a
checkpoint and an HF export reproduce them; HF generation with images matches the trainer after a refit."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_model import TINY
from transformers import AutoModelForImageTextToText

from posttrain.algorithms.loss import NLLLoss, token_mult_prob_error
from posttrain.config import validate_config
from posttrain.data.message_log import message_log_to_flat, tokenize_message_log
from posttrain.distributed.batched_data_dict import BatchedDataDict
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster
from posttrain.experience.rollouts import build_generation_input
from posttrain.models.build import ModelFromConfig, build_model_dir
from posttrain.models.vlm import load_processor
from posttrain.utils.native_checkpoint import export_checkpoint_to_hf
from posttrain.workers.generation import GenerationConfig, HFGeneration, make_generation
from posttrain.workers.policy.config import PolicyConfig
from posttrain.workers.policy.handle import Policy

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

NUM_ROWS, NUM_STEPS = 8, 2
# Rows 0-3 go to rank 0 and 4-7 to rank 1 on two workers: with micro-batches of 2, rank 1's second
# micro-batch (rows 6, 7) has no image while rank 0's (rows 2, 3) has one.
IMAGE_SIZES = {0: (32, 32), 1: (24, 40), 2: (16, 16), 5: (40, 24)}


def conversation(row: int) -> list[dict]:
    color = (40 * row % 255, 200, 90)
    text = f"Row {row}: what colour?"
    content = text
    if row in IMAGE_SIZES:
        content = [
            {"type": "image", "image": Image.new("RGB", IMAGE_SIZES[row], color)},
            {"type": "text", "text": text},
        ]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": f"green {row}"}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    cfg = ModelFromConfig(architecture="qwen2_vl", **TINY)
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="module")
def image_batch(vlm_dir):
    processor = load_processor(vlm_dir)
    logs = [
        tokenize_message_log(conversation(row), processor.tokenizer, processor=processor)
        for row in range(NUM_ROWS)
    ]
    return message_log_to_flat(logs, processor.tokenizer.pad_token_id)


def direct_logprobs(vlm_dir, data) -> torch.Tensor:
    """The contract from one plain forward of the whole batch (Hugging Face computes the M-RoPE positions)."""
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    input_ids, lengths = data["input_ids"], data["input_lengths"]
    real = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, T]
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            attention_mask=real,
            pixel_values=torch.cat([p for p in data["pixel_values"] if p.numel()]),
            image_grid_thw=torch.cat(data["image_grid_thw"]),
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
        ).logits  # [B, T, V]
    expected = torch.zeros(input_ids.shape)
    for row in range(input_ids.shape[0]):
        for t in range(1, int(lengths[row])):
            expected[row, t] = torch.log_softmax(logits[row, t - 1], dim=-1)[input_ids[row, t]]
    return expected


class Run:
    def __init__(self, vlm_dir, num_workers: int, micro_batch_size: int):
        self.cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
        cfg = validate_config(
            PolicyConfig,
            dict(
                model_name=str(vlm_dir),
                train_global_batch_size=NUM_ROWS,
                train_micro_batch_size=micro_batch_size,
                logprob_batch_size=micro_batch_size,
                max_grad_norm=1.0,
                seed=0,
                optimizer={"name": "AdamW", "kwargs": {"lr": 1e-2}},
            ),
        )
        self.policy = Policy(self.cluster, cfg)

    def train(self, ray_session, data) -> Run:
        self.initial_logprobs = self.policy.get_logprobs(data)["logprobs"]
        self.losses = [self.policy.train(data, NLLLoss())["loss"][0] for _ in range(NUM_STEPS)]
        self.weights = ray_session.get(self.policy.get_weights(only_changed=False))
        return self

    def shutdown(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def runs(ray_session, vlm_dir, image_batch):
    built = {
        "one_worker_2": Run(vlm_dir, 1, 2),
        "two_workers_2": Run(vlm_dir, 2, 2),
        "one_worker_all": Run(vlm_dir, 1, 8),
    }
    for run in built.values():
        run.train(ray_session, image_batch)
    yield built
    for run in built.values():
        run.shutdown()


def test_image_batch_keeps_patches_with_their_rows(image_batch):
    """Rows without images carry no patches; a 32x32 image is 8x8 patches of 4x4 pixels (16 image tokens)."""
    grids = image_batch["image_grid_thw"]
    assert [g.shape[0] for g in grids] == [1, 1, 1, 0, 0, 1, 0, 0]
    assert grids[0].tolist() == [[1, 8, 8]] and image_batch["pixel_values"][0].shape[0] == 64
    picked = image_batch.select_indices([5, 0])
    assert torch.equal(picked["pixel_values"][0], image_batch["pixel_values"][5])
    shards = image_batch.shard_by_batch_size(2)
    assert torch.equal(shards[1]["image_grid_thw"][1], image_batch["image_grid_thw"][5])


def test_vlm_logprobs_follow_contract(runs, vlm_dir, image_batch):
    """Compared where the batch trains (the worker leaves logprobs before the first trained position 0)."""
    expected = direct_logprobs(vlm_dir, image_batch) * image_batch["token_mask"]
    got = runs["one_worker_2"].initial_logprobs * image_batch["token_mask"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["two_workers_2", "one_worker_all"])
def test_vlm_splits_give_same_logprobs_losses_and_weights(runs, image_batch, name):
    """Logprobs compared where the batch trains (before a micro-batch's first trained position the worker
    leaves them 0, and that position depends on the micro-batch's rows)."""
    baseline, run = runs["one_worker_2"], runs[name]
    mask = image_batch["token_mask"]
    torch.testing.assert_close(
        run.initial_logprobs * mask, baseline.initial_logprobs * mask, atol=1e-5, rtol=0
    )
    assert run.losses == pytest.approx(baseline.losses, abs=1e-5)
    assert baseline.losses[1] < baseline.losses[0]
    for key, tensor in baseline.weights.items():
        torch.testing.assert_close(run.weights[key], tensor, atol=1e-5, rtol=0, msg=key)
    assert any(".visual." in key for key in baseline.weights)  # the vision tower is trained and compared too


def prompt_batch(vlm_dir):
    """The user turns of the conversations (with the assistant generation prompt), images included."""
    processor = load_processor(vlm_dir)
    logs = [
        tokenize_message_log(
            conversation(row)[:1], processor.tokenizer, add_generation_prompt=True, processor=processor
        )
        for row in range(NUM_ROWS)
    ]
    return build_generation_input(logs, [None] * NUM_ROWS, processor.tokenizer.pad_token_id)


def test_vlm_generation_after_refit_matches_training_logprobs(ray_session, runs, vlm_dir):
    """HF generation with images, refit with the trained policy's weights: the policy's logprobs of the
    sampled
    tokens match the generation's (token_mult_prob_error <= 1.01), and they differ from the untrained model's.
    Two workers decode halves of the batch (rows with and without images on each)."""
    prompts = prompt_batch(vlm_dir)
    cfg = GenerationConfig(
        max_new_tokens=6, temperature=1.0, top_k=None, top_p=1.0, colocated=False, num_workers=2
    )
    generation = HFGeneration(None, cfg, str(vlm_dir))
    try:
        untrained = generation.generate(prompts, seed=3)
        policy = runs["one_worker_2"].policy
        generation.update_weights(policy.get_weights(only_changed=False))
        out = generation.generate(prompts, seed=3)
    finally:
        generation.shutdown()
    lengths = out["unpadded_sequence_lengths"]
    positions = torch.arange(out["output_ids"].shape[1]).unsqueeze(0)
    token_mask = (
        (positions >= prompts["input_lengths"].unsqueeze(1)) & (positions < lengths.unsqueeze(1))
    ).float()
    data = BatchedDataDict(
        input_ids=out["output_ids"],
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(NUM_ROWS),
        pixel_values=prompts["pixel_values"],
        image_grid_thw=prompts["image_grid_thw"],
    )
    train_logprobs = policy.get_logprobs(data)["logprobs"]
    error = float(
        (token_mult_prob_error(train_logprobs, out["logprobs"]) * token_mask).sum() / token_mask.sum()
    )
    assert 1.0 <= error <= 1.01
    assert (
        float(((out["logprobs"] - untrained["logprobs"]).abs() * token_mask).max()) > 1e-3
    )  # the refit took


def test_vllm_backend_refuses_a_vision_language_model(ray_session, vlm_dir):
    with pytest.raises(ValueError, match="vision-language model.*generation.backend=hf"):
        make_generation(None, GenerationConfig(backend="vllm", colocated=False), str(vlm_dir))


def test_vlm_checkpoint_and_hf_exports_reproduce_the_trained_logprobs(
    ray_session, runs, vlm_dir, image_batch, tmp_path
):
    """The trained policy's logprobs = those of its HF export (written by the workers) and of the offline
    export of its checkpoint (`posttrain export`), both loaded by AutoModelForImageTextToText; the exports
    carry the image processor."""
    policy, mask = runs["one_worker_all"].policy, image_batch["token_mask"]
    trained = policy.get_logprobs(image_batch)["logprobs"] * mask
    policy.export_hf(str(tmp_path / "hf"))
    policy.save_checkpoint(str(tmp_path / "checkpoint"))
    export_checkpoint_to_hf(tmp_path / "checkpoint", tmp_path / "from_checkpoint")
    for exported in (tmp_path / "hf", tmp_path / "from_checkpoint"):
        assert (exported / "preprocessor_config.json").is_file()
        torch.testing.assert_close(direct_logprobs(exported, image_batch) * mask, trained, atol=1e-5, rtol=0)
    assert float((direct_logprobs(vlm_dir, image_batch) * mask - trained).abs().max()) > 1e-2  # it did train
