"""The state of the Tinker-compatible service, without HTTP: tenants (one per API key) and their models,
samplers and saved states, and the futures the SDK polls. Every request runs to completion when it
arrives, one at a time, and its result waits under a request id; a request retried with the same
idempotency key gets the first answer back instead of running again."""

from __future__ import annotations

import dataclasses
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from posttrain.tinker.model import LOSS_INPUTS, TrainedModel, UserError, check_datum, latest_state
from posttrain.tinker.wire import (
    forward_backward_output,
    parse_forward_backward,
    prompt_tokens,
    sample_response,
)
from posttrain.workers.generation.config import GenerationConfig
from posttrain.workers.generation.hf_worker import HFGenerationWorker
from posttrain.workers.generation.openai_server import Batcher, Sampling

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclasses.dataclass
class TinkerServiceConfig:
    """The `posttrain serve-tinker` settings (its YAML file)."""

    base_model: str
    """Model directory (or Hugging Face name) every training client starts from."""
    states_dir: str = "tinker_states"
    """Directory of saved states: <states_dir>/<tenant>/<name>/step_N/ (posttrain checkpoints)."""
    allow_full_weights: bool = False
    """Serve training clients without LoRA (all weights trained, a copy of the model each)."""
    lora_alpha: float = 32.0
    """LoRA alpha; the adapter's update is (alpha / rank) * B @ A."""
    max_tokens_per_datum: int = 2048
    """Longest datum (and prompt) accepted; a longer one is a user error."""
    max_models: int = 8
    """Training clients held at once, over all tenants."""
    seed: int = 0
    """Seed of a LoRA adapter's initialisation when the request gives none."""

    def validate(self) -> None:
        if self.max_tokens_per_datum < 1 or self.max_models < 1:
            raise ValueError("max_tokens_per_datum and max_models must be >= 1")


class TinkerService:
    """What the server routes call; `tenant` is the caller's API key (a tenant sees only its own things)."""

    def __init__(self, cfg: TinkerServiceConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()  # one computation at a time
        self.models: dict[str, tuple[str, TrainedModel]] = {}
        self.samplers: dict[str, tuple[str, Any]] = {}  # model path -> (tenant, refit payload or None)
        self.results: dict[str, tuple[str, Any]] = {}  # request id -> (tenant, result)
        self.answers: dict[tuple[str, str], Any] = {}  # (tenant, idempotency key) -> the first answer
        self.sessions: dict[str, str] = {}  # sampling session id -> model path
        self.workers: dict[str, HFGenerationWorker] = {}  # sampler path -> its generation worker

    def tenant_dir(self, tenant: str) -> Path:
        return Path(self.cfg.states_dir) / uuid.uuid5(uuid.NAMESPACE_URL, tenant).hex

    def run(self, tenant: str, key: str | None, action: Any, *args: Any) -> dict[str, Any]:
        """Run `action(tenant, *args)` as a future: its result (or its user error) is kept under a new
        request id; the same `key` again returns the first answer."""
        with self.lock:
            if key is not None and (tenant, key) in self.answers:
                return self.answers[(tenant, key)]
            try:
                result = action(tenant, *args)
            except UserError as error:
                result = {"error": str(error), "category": "user"}
            request_id = uuid.uuid4().hex
            self.results[request_id] = (tenant, result)
            answer: dict[str, Any] = {"request_id": request_id}
            if action == self.sample:  # each sampled sequence is named (the SDK requires the names)
                num_samples = int(args[0].get("num_samples", 1))
                answer["sample_sequence_ids"] = [f"{request_id}-{index}" for index in range(num_samples)]
            if key is not None:
                self.answers[(tenant, key)] = answer
            return answer

    def retrieve(self, tenant: str, body: dict[str, Any]) -> Any:
        """The result kept under `body["request_id"]`, for its tenant only."""
        request_id = body["request_id"]
        owner, result = self.results.get(request_id, (None, None))
        if owner != tenant:
            return {"error": f"unknown request {request_id}", "category": "user"}
        return result

    def model(self, tenant: str, model_id: str) -> TrainedModel:
        owner, model = self.models.get(model_id, (None, None))
        if owner != tenant or model is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return model

    def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        lora = body.get("lora_config")
        if lora is None and not self.cfg.allow_full_weights:
            raise UserError("this server trains LoRA adapters only (allow_full_weights is off); give a rank")
        rank = None if lora is None else int(lora["rank"])
        seed = self.cfg.seed if lora is None or lora.get("seed") is None else int(lora["seed"])
        model_id = uuid.uuid4().hex
        self.add_model(tenant, model_id, TrainedModel(self.cfg.base_model, rank, self.cfg.lora_alpha, seed))
        return {"model_id": model_id, "type": "create_model"}

    def add_model(self, tenant: str, model_id: str, model: TrainedModel) -> None:
        if len(self.models) >= self.cfg.max_models:
            raise UserError(f"the server holds {self.cfg.max_models} models already")
        if model_id in self.models:
            raise UserError(f"model_id {model_id!r} exists already")
        self.models[model_id] = (tenant, model)

    def forward_backward(self, tenant: str, body: bytes) -> bytes:
        msg, data = parse_forward_backward(body)
        model = self.model(tenant, msg.model_id)
        if msg.loss_fn not in LOSS_INPUTS:
            raise UserError(f"loss_fn {msg.loss_fn!r} is not served; served: {sorted(LOSS_INPUTS)}")
        if not data:
            raise UserError("forward_backward needs at least one datum")
        for datum in data:  # forward only: the loss inputs it lacks count as zeros
            check_datum(datum, None if msg.forward_only else msg.loss_fn, self.cfg.max_tokens_per_datum)
            for name in LOSS_INPUTS[msg.loss_fn]:
                datum.inputs.setdefault(name, torch.zeros(len(datum.tokens)))
        config = {key: float(value) for key, value in msg.loss_fn_config.items()}
        outputs, metrics = model.forward_backward(data, msg.loss_fn, config, backward=not msg.forward_only)
        return forward_backward_output(outputs, metrics)

    def optim_step(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("adam_params") or body.get("optim_params")
        if params is None or params.get("type", "adam") not in ("adam", "adamw"):
            raise UserError("only Adam parameters (adam_params) are served")
        metrics = self.model(tenant, body["model_id"]).optim_step(params)
        return {"metrics": metrics, "type": "optim_step"}

    def state_path(self, tenant: str, body: dict[str, Any], kind: str) -> tuple[str, str]:
        name = body.get("path") or f"{kind}-{uuid.uuid4().hex[:8]}"
        if not NAME_PATTERN.match(name):
            raise UserError(f"a name is letters, digits, '_', '.', '-' (at most 128), got {name!r}")
        return name, f"tinker://{body['model_id']}/{kind}/{name}"

    def save_state(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.model(tenant, body["model_id"])
        name, path = self.state_path(tenant, body, "weights")
        model.save_state(self.tenant_dir(tenant) / name)
        return {"path": path, "type": "save_weights"}

    def load_state(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """Load a saved state into a model; without a model_id, into a new model (the SDK's
        create_training_client_from_state), named as the SDK names it: <session>:train:<seq>."""
        name = str(body["path"]).rstrip("/").rsplit("/", 1)[-1]
        directory = self.tenant_dir(tenant) / name
        if not NAME_PATTERN.match(name) or not directory.is_dir():
            raise UserError(f"no saved state {body['path']!r}")
        model_id = body.get("model_id")
        if model_id is None:
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
            rank = latest_state(directory)[1].get("lora_rank")
            self.add_model(tenant, model_id, TrainedModel(self.cfg.base_model, rank, self.cfg.lora_alpha, 0))
        self.model(tenant, model_id).load_state(directory, with_optimizer=bool(body.get("optimizer")))
        return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

    def save_for_sampler(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.model(tenant, body["model_id"])
        _, path = self.state_path(tenant, body, "sampler_weights")
        self.samplers[path] = (tenant, model.sampler_weights())
        self.workers.pop(path, None)  # a path saved again has new weights
        answer = {"path": path, "type": "save_weights_for_sampler"}
        if body.get("path") is None:  # an unnamed save: the SDK samples it through a session at once
            answer = self.create_sampling_session(tenant, {"model_path": path}) | answer  # its type stays
        return answer

    def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if path is None:
            base = body.get("base_model")
            if base not in (None, self.cfg.base_model):
                raise UserError(f"unknown base_model {base!r}; this server serves {self.cfg.base_model!r}")
        elif self.samplers.get(path, (None,))[0] != tenant:
            raise UserError(f"unknown model_path {path!r}")
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = path or ""
        return {"sampling_session_id": session_id, "type": "create_sampling_session"}

    def sample(self, tenant: str, body: dict[str, Any]) -> bytes:
        path = body.get("model_path") or self.sessions.get(body.get("sampling_session_id") or "", "")
        if path and self.samplers.get(path, (None,))[0] != tenant:
            raise UserError(f"unknown model_path {path!r}")
        prompt = prompt_tokens(body.get("prompt"))
        if not prompt or len(prompt) > self.cfg.max_tokens_per_datum:
            raise UserError(
                f"the prompt has {len(prompt)} tokens; 1 to {self.cfg.max_tokens_per_datum} served"
            )
        params = body.get("sampling_params") or {}
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(item, str) for item in stop):
            raise UserError("stop token ids are not served; give stop strings")
        if params.get("top_k", -1) not in (-1, None) or body.get("topk_prompt_logprobs"):
            raise UserError("top_k and top-k logprobs are not served")
        worker = self.sampler(path)
        temperature = float(params.get("temperature", 1.0))
        sampling = Sampling(
            max(temperature, 1e-6),
            float(params.get("top_p", 1.0)),
            int(params.get("max_tokens") or 16),
            temperature == 0.0,
            params.get("seed"),
        )
        batcher = Batcher(worker, worker.pad_id, batch_wait_s=0.0)
        futures = batcher.submit([prompt] * int(body.get("num_samples", 1)), stop, sampling)
        sequences = [future.result() for future in futures]
        batcher.decoder.shutdown()
        prompt_logprobs = self.prompt_logprobs(worker, prompt) if body.get("prompt_logprobs") else None
        return sample_response(sequences, prompt_logprobs)

    def sampler(self, path: str) -> HFGenerationWorker:
        """The generation worker of a sampler path ("": the base model), its weights loaded once; the
        last few are kept."""
        if path not in self.workers:
            if len(self.workers) >= 4:
                self.workers.pop(next(iter(self.workers)))
            worker = HFGenerationWorker(GenerationConfig(top_k=None), self.cfg.base_model)
            if path:
                worker.update_weights(self.samplers[path][1])
            self.workers[path] = worker
        return self.workers[path]

    @staticmethod
    def prompt_logprobs(worker: HFGenerationWorker, prompt: list[int]) -> list[float]:
        """Each prompt token's logprob given the tokens before it; NaN (None to the SDK) for the first."""
        with torch.no_grad():
            logits = worker.model(input_ids=torch.tensor([prompt])).logits[0].float()  # [T, V]
        logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1))
        return [float("nan")] + logprobs.squeeze(-1).tolist()
