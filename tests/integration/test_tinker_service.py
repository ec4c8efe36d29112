"""`posttrain serve-tinker` driven by the unmodified Tinker SDK on loopback, on a tiny model: accumulated
forward_backward calls equal one call on their concatenation, sampling after save_weights_for_sampler equals
posttrain's own generation from those weights, a state saved before a restart resumes bit-exactly, a
retried request runs once, tenants stay apart, and client errors reach the SDK as errors."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from posttrain.config import ConfigError  # noqa: E402
from posttrain.models.build import ModelFromConfig, build_model_dir  # noqa: E402
from posttrain.tinker.model import Datum  # noqa: E402
from posttrain.tinker.server import TinkerServer, load_config  # noqa: E402
from posttrain.tinker.service import TinkerService, TinkerServiceConfig  # noqa: E402
from posttrain.workers.generation.config import GenerationConfig  # noqa: E402
from posttrain.workers.generation.hf_worker import HFGenerationWorker  # noqa: E402

ADAM = types.AdamParams(learning_rate=0.02, eps=1e-8)
SEQUENCES = [[5, 9, 14, 3, 22, 7], [11, 4, 8, 30, 2], [17, 6, 25, 13, 19, 40, 12]]


def start(cfg: TinkerServiceConfig) -> TinkerServer:
    server = TinkerServer(TinkerService(cfg))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


CLIENTS: dict[str, list] = {}  # server URL -> the SDK clients opened against it


def stop(server: TinkerServer) -> None:
    """Close the server's SDK clients (each ends its session: no heartbeats after the test), then stop it."""
    for service in CLIENTS.pop(server.url, []):
        assert service.close("success").result(timeout=30) is None
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    spec = ModelFromConfig(architecture="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, seed=3)
    model_dir = build_model_dir(spec, tmp_path_factory.mktemp("tinker_model"))
    states = tmp_path_factory.mktemp("tinker_states")
    cfg = TinkerServiceConfig(
        base_model=str(model_dir), states_dir=str(states), max_tokens_per_datum=16, max_models=32
    )
    server = start(cfg)
    yield server, cfg
    stop(server)


def client(server: TinkerServer, key: str = "tml-alice"):
    CLIENTS.setdefault(server.url, []).append(tinker.ServiceClient(base_url=server.url, api_key=key))
    return CLIENTS[server.url][-1]


def datum(tokens: list[int]) -> types.Datum:
    """Next-token cross-entropy on every position of `tokens`."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def logprobs_of(training_client) -> list[np.ndarray]:
    out = training_client.forward([datum(tokens) for tokens in SEQUENCES], "cross_entropy").result()
    return [np.asarray(output["logprobs"].tolist()) for output in out.loss_fn_outputs]


def step(training_client, sequences: list[list[int]]) -> float:
    out = training_client.forward_backward([datum(tokens) for tokens in sequences], "cross_entropy").result()
    training_client.optim_step(ADAM).result()
    return out.metrics["loss:sum"]


def test_accumulated_forward_backward_equals_one_step_on_the_concatenated_batch(served):
    server, _ = served
    service = client(server)
    split = service.create_lora_training_client(base_model=served[1].base_model, rank=4, seed=1).result()
    joined = service.create_lora_training_client(base_model=served[1].base_model, rank=4, seed=1).result()
    before = logprobs_of(split)
    losses = [split.forward_backward([datum(tokens)], "cross_entropy").result() for tokens in SEQUENCES]
    split.optim_step(ADAM).result()
    joined_loss = step(joined, SEQUENCES)
    # the per-datum outputs are the target logprobs, and the loss is their negated sum
    first = np.asarray(losses[0].loss_fn_outputs[0]["logprobs"].tolist())
    np.testing.assert_allclose(first, before[0], atol=1e-6)
    assert losses[0].metrics["loss:sum"] == pytest.approx(-before[0].sum(), rel=1e-6)
    assert sum(out.metrics["loss:sum"] for out in losses) == pytest.approx(joined_loss, rel=1e-6)
    after_split, after_joined = logprobs_of(split), logprobs_of(joined)
    for a, b, base in zip(after_split, after_joined, before):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert np.abs(a - base).max() > 1e-3  # the step changed the model


def test_sampling_after_save_equals_posttrain_generation_from_the_same_weights(served):
    server, cfg = served
    training = client(server).create_lora_training_client(base_model=cfg.base_model, rank=4, seed=2).result()
    for _ in range(3):
        step(training, SEQUENCES)
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0, top_p=1.0)
    prompt = [5, 9, 14]
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    base = client(server).create_sampling_client(base_model=cfg.base_model).result()
    from_base = base.sample(types.ModelInput.from_ints(prompt), 2, params).result()

    model_id = training.model_id
    weights = server.service.models[model_id][1].sampler_weights()
    worker = HFGenerationWorker(GenerationConfig(top_k=None, max_new_tokens=6), cfg.base_model)
    worker.update_weights(weights)
    direct = worker.generate(
        {"input_ids": torch.tensor([prompt] * 2), "input_lengths": torch.tensor([3, 3])}, seed=7
    )
    for row, sequence in enumerate(sampled.sequences):
        end = 3 + int(direct["generation_lengths"][row])
        assert sequence.tokens == direct["output_ids"][row, 3:end].tolist()
        np.testing.assert_allclose(sequence.logprobs, direct["logprobs"][row, 3:end].numpy(), atol=1e-5)
    assert [s.logprobs for s in sampled.sequences] != [s.logprobs for s in from_base.sequences]
    # compute_logprobs scores the prompt under the trained weights: the forward's numbers
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQUENCES[0])).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], logprobs_of(training)[0], atol=1e-5)


def test_a_state_saved_before_a_restart_resumes_like_an_uninterrupted_run(served):
    server, cfg = served
    uninterrupted = (
        client(server).create_lora_training_client(base_model=cfg.base_model, rank=4, seed=3).result()
    )
    resumed = client(server).create_lora_training_client(base_model=cfg.base_model, rank=4, seed=3).result()
    step(uninterrupted, SEQUENCES[:2])
    step(uninterrupted, SEQUENCES[1:])
    step(resumed, SEQUENCES[:2])
    path = resumed.save_state("resume-test").result().path
    restarted = start(cfg)  # a new server process's state: nothing but the states directory
    try:
        training = client(restarted).create_training_client_from_state_with_optimizer(path).result()
        step(training, SEQUENCES[1:])
        for a, b in zip(logprobs_of(training), logprobs_of(uninterrupted)):
            np.testing.assert_array_equal(a, b)
        weights_only = client(restarted).create_training_client_from_state(path).result()
        step(weights_only, SEQUENCES[1:])  # a fresh Adam state takes a different step
        assert np.abs(logprobs_of(weights_only)[0] - logprobs_of(uninterrupted)[0]).max() > 1e-4
    finally:
        stop(restarted)


def test_a_retried_request_with_the_same_idempotency_key_runs_once(served):
    server, cfg = served
    once = client(server).create_lora_training_client(base_model=cfg.base_model, rank=4, seed=4).result()
    retried = client(server).create_lora_training_client(base_model=cfg.base_model, rank=4, seed=4).result()
    step(once, SEQUENCES)
    retried.forward_backward([datum(tokens) for tokens in SEQUENCES], "cross_entropy").result()
    body = {"model_id": retried.model_id, "adam_params": ADAM.model_dump(), "type": "optim_step"}
    headers = {"X-API-Key": "tml-alice", "X-Idempotency-Key": "step-1"}
    answers = [httpx.post(f"{server.url}/api/v1/optim_step", json=body, headers=headers) for _ in range(2)]
    assert answers[0].status_code == 200 and answers[0].json() == answers[1].json()
    for a, b in zip(logprobs_of(retried), logprobs_of(once)):
        np.testing.assert_array_equal(a, b)


def test_tenants_see_only_their_own_models_and_samplers(served):
    server, cfg = served
    alice = (
        client(server, "tml-alice").create_lora_training_client(base_model=cfg.base_model, rank=4).result()
    )
    bob = client(server, "tml-bob").create_lora_training_client(base_model=cfg.base_model, rank=4).result()
    bob_before = logprobs_of(bob)
    step(alice, SEQUENCES)
    path = alice.save_weights_for_sampler("alice-weights").result().path
    np.testing.assert_array_equal(logprobs_of(bob)[0], bob_before[0])  # alice's step left bob's adapter alone
    intruder = client(server, "tml-bob")
    # bob naming alice's model id gets "unknown model", as for an id that does not exist
    body = {"model_id": alice.model_id, "adam_params": ADAM.model_dump(), "type": "optim_step"}
    answer = httpx.post(f"{server.url}/api/v1/optim_step", json=body, headers={"X-API-Key": "tml-bob"}).json()
    result = httpx.post(
        f"{server.url}/api/v1/retrieve_future", json=answer, headers={"X-API-Key": "tml-bob"}
    ).json()
    assert result == {"error": f"unknown model_id {alice.model_id!r}", "category": "user"}
    with pytest.raises(Exception, match="unknown model_path"):
        intruder.create_sampling_client(model_path=path).result()


def test_client_errors_reach_the_sdk(served):
    server, cfg = served
    training = client(server).create_lora_training_client(base_model=cfg.base_model, rank=4).result()
    malformed = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4], dtype=np.int64)},
    )
    with pytest.raises(tinker.RequestFailedError, match=r"needs loss_fn_inputs\['weights'\]") as error:
        training.forward_backward([malformed], "cross_entropy").result()
    assert error.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="this server takes 1 to 16"):
        training.forward_backward([datum(list(range(1, 19)))], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        training.load_state("tinker://x/weights/never-saved").result()
    with pytest.raises(tinker.RequestFailedError, match="outside the model's vocabulary"):
        training.forward_backward([datum([1, 2, 10**6])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="not served"):
        training.forward_backward([datum(SEQUENCES[0])], "dro").result()
    # the SDK creates LoRA clients only; a create_model without lora_config asks for all weights
    headers = {"X-API-Key": "tml-alice"}
    answer = httpx.post(f"{server.url}/api/v1/create_model", json={"base_model": "m"}, headers=headers)
    full = httpx.post(f"{server.url}/api/v1/retrieve_future", json=answer.json(), headers=headers).json()
    assert full["category"] == "user" and "LoRA adapters only" in full["error"]
    not_served = httpx.post(f"{server.url}/api/v1/copy_weights", json={}, headers={"X-API-Key": "tml-alice"})
    assert not_served.status_code == 404 and "not served: /api/v1/copy_weights" in not_served.text
    bad_json = httpx.post(
        f"{server.url}/api/v1/optim_step",
        content=b"{",
        headers={"X-API-Key": "tml-alice", "Content-Type": "application/json"},
    )
    assert bad_json.status_code == 400
    no_key = httpx.post(f"{server.url}/api/v1/create_session", json={})
    assert no_key.status_code == 401


def test_the_shipped_config_loads_and_a_server_beyond_loopback_needs_keys(tmp_path):
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tinker_tiny.yaml"))
    assert cfg.base_model == "/tmp/posttrain-tiny" and not cfg.allow_full_weights
    (tmp_path / "bad.yaml").write_text("base_model: m\nlora_rank: 8\n")
    with pytest.raises(
        ConfigError,
        match=r"^lora_rank: unknown key in TinkerServiceConfig; did you mean 'lora_alpha'.*bad.yaml",
    ):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="beyond loopback"):
        TinkerServer(TinkerService(cfg), host="0.0.0.0")


def test_a_full_weight_model_trains_and_its_sampler_computes_what_it_computes(served):
    """allow_full_weights (no SDK call asks for it): a step moves every weight, and the generation worker
    loaded with the sampler weights gives the trained model's logits."""
    _, cfg = served
    service = TinkerService(TinkerServiceConfig(base_model=cfg.base_model, allow_full_weights=True))
    model_id = service.create_model("tml-alice", {"base_model": cfg.base_model})["model_id"]
    model = service.models[model_id][1]
    assert model.lora_rank is None and len(model.params) == len(list(model.model.parameters()))
    data = [
        Datum(
            tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)}
        )
        for tokens in SEQUENCES
    ]
    before, _ = model.forward_backward(data, "cross_entropy", {}, backward=True)
    model.optim_step(ADAM.model_dump())
    after, _ = model.forward_backward(data, "cross_entropy", {}, backward=False)
    assert (after[0]["logprobs"] - before[0]["logprobs"]).abs().max() > 1e-3
    worker = HFGenerationWorker(GenerationConfig(top_k=None), cfg.base_model)
    worker.update_weights(model.sampler_weights())
    ids = torch.tensor([SEQUENCES[0]])
    with torch.no_grad():
        torch.testing.assert_close(worker.model(input_ids=ids).logits, model.model(input_ids=ids).logits)
