"""The Megatron Core backend (`policy.backend: megatron`) on real Ray actors over gloo, through its CPU shim:
at TP 2, PP 2 and DP 2 (distributed optimizer) it gives the DTensor backend's logprobs, SFT losses and GRPO
losses on the same HF model, exports that model back, and a checkpoint saved at TP 2 resumes at PP 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # learning runs and multi-worker runs: make test, not make test-fast

pytest.importorskip("megatron.core", reason="policy.backend=megatron needs posttrain[megatron]")

from test_grpo import run_grpo  # noqa: E402
from test_policy import make_train_data, policy_config  # noqa: E402
from test_sft import run_sft  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from posttrain.algorithms.loss import ClippedPGLoss, NLLLoss  # noqa: E402
from posttrain.algorithms.preference_loss import BradleyTerryLoss  # noqa: E402
from posttrain.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from posttrain.distributed.virtual_cluster import ClusterConfig, RayVirtualCluster  # noqa: E402
from posttrain.models.build import ModelFromConfig, build_model_dir  # noqa: E402
from posttrain.workers.policy.handle import Policy  # noqa: E402

NUM_STEPS = 3
LAYOUTS = {  # name -> policy overrides (2 workers each)
    "tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {"distributed_optimizer": True},
}


def grpo_data(data: BatchedDataDict, prev_logprobs: torch.Tensor) -> BatchedDataDict:
    """The SFT rows with seeded per-token advantages and the policy's logprobs as prev_logprobs."""
    generator = torch.Generator().manual_seed(2)
    rows = BatchedDataDict(dict(data))
    rows["advantages"] = torch.randn(data["input_ids"].shape, generator=generator)  # [B, T]
    rows["prev_logprobs"] = prev_logprobs
    return rows


class Trained:
    """A policy on its own 1- or 2-worker cluster after: logprobs, one SFT step, a checkpoint (optional),
    two more SFT steps, then three GRPO steps; keeps every number the tests compare."""

    def __init__(self, model_dir, num_workers: int, checkpoint_dir=None, **overrides):
        self.cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
        self.policy = Policy(self.cluster, policy_config(model_dir, **overrides))
        data = make_train_data()
        self.initial_logprobs = self.policy.get_logprobs(data)["logprobs"]
        self.sft = []
        for step in range(NUM_STEPS):
            self.sft.append(self.policy.train(data, NLLLoss()))
            if step == 0 and checkpoint_dir is not None:
                self.policy.save_checkpoint(checkpoint_dir)
        rows = grpo_data(data, self.policy.get_logprobs(data)["logprobs"])
        self.grpo = [self.policy.train(rows, ClippedPGLoss()) for _ in range(NUM_STEPS)]

    def shutdown(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


def megatron_overrides(**megatron) -> dict:
    return {"backend": "megatron", "megatron": megatron}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with grouped-query attention (4 heads, 2 kv heads) and tied embeddings."""
    cfg = ModelFromConfig(
        architecture="llama",
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return build_model_dir(cfg, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def runs(ray_session, model_dir, tmp_path_factory):
    """The DTensor baseline on one worker and each Megatron layout on two; the TP 2 run checkpoints after
    its first SFT step. One policy at a time (each is shut down after its numbers are kept)."""
    checkpoint_dir = tmp_path_factory.mktemp("megatron_ckpt") / "step_1"
    built = {}
    for name, overrides in [("dtensor", {}), *((n, megatron_overrides(**o)) for n, o in LAYOUTS.items())]:
        run = Trained(
            model_dir,
            1 if name == "dtensor" else 2,
            checkpoint_dir=checkpoint_dir if name == "tp2" else None,
            **overrides,
        )
        if name == "pp2":  # resume the TP 2 checkpoint at PP 2 and redo SFT steps 2 and 3
            run.policy.load_checkpoint(checkpoint_dir)
            run.checkpoint_dir = checkpoint_dir
            run.checkpoint_weights = ray_session.get(run.policy.get_weights(only_changed=False))
            data = make_train_data()
            run.resumed = [run.policy.train(data, NLLLoss()) for _ in range(NUM_STEPS - 1)]
            run.export_dir = tmp_path_factory.mktemp("megatron_export")
            run.policy.export_hf(run.export_dir)
            run.weights = ray_session.get(run.policy.get_weights(only_changed=False))
        if name == "dp2":  # the distributed optimizer's own checkpoint: one more step, twice
            run.policy.save_checkpoint(checkpoint_dir.parent / "dp2")
            run.after_save = run.policy.train(make_train_data(), NLLLoss())
            run.policy.load_checkpoint(checkpoint_dir.parent / "dp2")
            run.after_load = run.policy.train(make_train_data(), NLLLoss())
        run.shutdown()
        built[name] = run
    return built


def values(steps: list[dict], key: str) -> list[float]:
    return [step[key][0] for step in steps]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_layout_gives_dtensor_logprobs_and_losses(runs, layout):
    baseline, run = runs["dtensor"], runs[layout]
    torch.testing.assert_close(run.initial_logprobs, baseline.initial_logprobs, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "num_valid_tokens"):
        assert values(run.sft, key) == pytest.approx(values(baseline.sft, key), abs=1e-5), key
    for key in ("loss", "grad_norm", "kl_penalty"):
        assert values(run.grpo, key) == pytest.approx(values(baseline.grpo, key), abs=1e-5), key
    assert values(baseline.sft, "loss")[2] < values(baseline.sft, "loss")[0]  # it did learn


def test_checkpoint_saved_at_tp2_resumes_at_pp2_with_uninterrupted_losses(runs):
    uninterrupted, resumed = runs["tp2"], runs["pp2"].resumed
    for key in ("loss", "grad_norm", "lr"):
        assert values(resumed, key) == pytest.approx(values(uninterrupted.sft, key)[1:], abs=1e-5), key


def test_export_and_refit_weights_load_into_hugging_face(runs):
    """The exported directory and the refit weights are the same model, and it has trained away from the
    initial one (the resumed PP 2 run's weights after SFT step 3)."""
    run = runs["pp2"]
    exported = AutoModelForCausalLM.from_pretrained(run.export_dir, dtype=torch.float32)
    state = exported.state_dict()
    assert set(run.weights) == set(state)
    for name, tensor in run.weights.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)


def test_distributed_optimizer_checkpoint_reloads_to_the_same_next_step(runs):
    run = runs["dp2"]
    for key in ("loss", "grad_norm"):
        assert run.after_load[key] == pytest.approx(run.after_save[key], abs=1e-6), key


def test_posttrain_export_converts_a_megatron_checkpoint(runs, tmp_path):
    """`posttrain export` of the TP 2 checkpoint (one process, resharded to TP 1) gives the weights that the
    PP 2 policy had right after loading it."""
    run = runs["pp2"]
    subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "export", str(run.checkpoint_dir), str(tmp_path / "hf")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert set(state) == set(run.checkpoint_weights)
    for name, tensor in run.checkpoint_weights.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)


def megatron_round_trip(model_dir: str) -> dict[str, float]:
    """In a fresh 1-rank process: HF -> Megatron GPTModel -> HF; the largest logit differences of Megatron
    and of the HF model rebuilt from Megatron's weights against the original."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from posttrain.workers.policy import megatron_convert as mc
    from posttrain.workers.policy.base import ensure_process_group
    from posttrain.workers.policy.megatron import causal_mask
    from posttrain.workers.policy.megatron_cpu_shim import cpu_shim

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ensure_process_group()
    with cpu_shim(), torch.no_grad():
        parallel_state.initialize_model_parallel(1, 1)
        parallel = {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": False,
        }
        model = mc.build_gpt_model(
            hf_model.config, mc.transformer_config(hf_model.config, parallel, False), True, True
        )
        layout = mc.gpt_layout(hf_model.config, 1)
        names = [name for name, _ in model.named_parameters()]
        for name, tensor in mc.hf_to_megatron(hf_model.state_dict(), names, 0, layout, 0, 1).items():
            model.get_parameter(name).copy_(tensor)
        input_ids = torch.randint(0, layout.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(11).expand(3, 11)
        megatron_logits = model(input_ids, positions, causal_mask(11, torch.device("cpu")))[
            ..., : layout.vocab_size
        ]
        expected = hf_model(input_ids).logits
        rebuilt = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32)
        rebuilt.load_state_dict(mc.megatron_to_hf({n: p for n, p in model.named_parameters()}, 0, layout))
        rebuilt_logits = rebuilt(input_ids).logits
    dist.destroy_process_group()
    return {
        "megatron": float((megatron_logits - expected).abs().max()),
        "rebuilt": float((rebuilt_logits - expected).abs().max()),
    }


def test_qwen2_to_megatron_and_back_keeps_logits(ray_session, tmp_path):
    """Qwen2 with q/k/v biases, untied embeddings and GQA (Llama with tied embeddings is the model of the
    tests above). Runs in a one-off Ray worker process: the CPU shim patches torch.cuda process-wide."""
    cfg = ModelFromConfig(
        architecture="qwen2",
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    model_dir = str(build_model_dir(cfg, tmp_path / "qwen2"))
    task = ray_session.remote(num_cpus=0.5, max_calls=1)(megatron_round_trip)
    differences = ray_session.get(task.remote(model_dir))
    assert differences["megatron"] < 1e-5
    assert differences["rebuilt"] == 0.0


def test_sft_loop_on_megatron_pipeline_gives_the_default_losses_and_exports(ray_session, tmp_path):
    """`posttrain sft` with policy.backend=megatron (2 pipeline stages) against the default backend on one
    worker: the same losses for 3 steps, and the final Hugging Face export loads."""
    settings = {"sft.max_num_steps": 3, "sft.val_period": 3, "checkpointing.enabled": "false"}
    default = run_sft(tmp_path / "dtensor", **settings, **{"sft.export_final_model": "false"})
    megatron = run_sft(
        tmp_path / "megatron",
        **settings,
        **{
            "policy.backend": "megatron",
            "policy.megatron.pipeline_model_parallel_size": 2,
            "cluster.workers_per_node": 2,
        },
    )
    assert list(megatron) == [1, 2, 3]
    for step, loss in default.items():
        assert megatron[step] == pytest.approx(loss, abs=1e-5)
    AutoModelForCausalLM.from_pretrained(tmp_path / "megatron" / "hf_model")


def test_grpo_loop_on_megatron_refits_generation_with_matching_logprobs(ray_session, tmp_path):
    """`posttrain grpo` at TP 2: before and after the first refit (step 2) the generation workers' logprobs
    match the Megatron trainer's (token_mult_prob_error ~ 1), and a native checkpoint is written."""
    steps = run_grpo(
        tmp_path,
        **{
            "grpo.max_num_steps": 2,
            "policy.train_global_batch_size": 16,
            "policy.backend": "megatron",
            "policy.megatron.tensor_model_parallel_size": 2,
            "cluster.workers_per_node": 2,
        },
    )
    assert "timing/refit" in steps[2]
    for step in (1, 2):
        assert 1.0 <= steps[step]["train/token_mult_prob_error"] <= 1.01
    assert (tmp_path / "checkpoints" / "step_2" / "policy" / "megatron").is_dir()


def reward_model_run(model_dir, num_workers: int, **overrides) -> tuple[torch.Tensor, list[float]]:
    """Scores of the test rows, then the Bradley-Terry losses of 3 steps on pairs (2i, 2i+1)."""
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=num_workers, num_cpus_per_worker=0.5))
    policy = Policy(cluster, policy_config(model_dir, model_kind="reward_model", **overrides))
    try:
        data = make_train_data()
        data["sample_mask"] = torch.ones(data.size)
        scores = policy.get_scores(data)["scores"]  # [B]
        return scores, [policy.train(data, BradleyTerryLoss())["loss"][0] for _ in range(NUM_STEPS)]
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_reward_model_at_tp2_gives_dtensor_scores_and_losses(ray_session, model_dir):
    """The score head ([1, H], replicated over TP ranks) sees the whole sequence under sequence
    parallelism."""
    scores, losses = reward_model_run(model_dir, 1)
    megatron_scores, megatron_losses = reward_model_run(
        model_dir, 2, **megatron_overrides(tensor_model_parallel_size=2, sequence_parallel=True)
    )
    torch.testing.assert_close(megatron_scores, scores, atol=1e-5, rtol=0)
    assert megatron_losses == pytest.approx(losses, abs=1e-5)
    assert losses[-1] < losses[0]
