"""`posttrain serve-tinker --config FILE`: a training service the Tinker SDK talks to (set TINKER_BASE_URL
or `ServiceClient(base_url=...)` to its URL), over serve-env's `JsonServer` and limits. Each API key is a
tenant with its own models, sampler weights and saved states; on loopback any `tml-` key is accepted,
beyond loopback only the keys in the token variable (comma-separated). Routes the SDK calls and this
server does not serve answer 404 with the route named."""

from __future__ import annotations

import argparse
import hmac
import logging
import re
import uuid
from typing import Any

from posttrain.config import load_typed_config
from posttrain.environments.server import (
    LOOPBACK_NAMES,
    BadRequest,
    EnvironmentHandler,
    JsonServer,
    ServerLimits,
    add_server_arguments,
    serve_until_interrupted,
    server_limits,
    server_token,
)
from posttrain.tinker.service import TinkerService, TinkerServiceConfig
from posttrain.tinker.wire import public_pb

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"


class TinkerServer(JsonServer):
    """The HTTP side of a `TinkerService`; `keys` (None: any key, loopback only) are the accepted API keys."""

    def __init__(
        self,
        service: TinkerService,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: list[str] | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        public_pb()  # the SDK's wire format must be importable before anything is served
        super().__init__(TinkerHandler, host, port, ",".join(keys) if keys else None, limits, "serve-tinker")
        self.service, self.keys = service, keys

    def routes(self) -> dict[str, Any]:
        """Path -> (handler(tenant, body), whether its answer is a future the SDK polls)."""
        service = self.service
        return {
            "/api/v1/create_model": (service.create_model, True),
            "/api/v1/forward_backward": (service.forward_backward, True),
            "/api/v1/optim_step": (service.optim_step, True),
            "/api/v1/save_weights": (service.save_state, True),
            "/api/v1/load_weights": (service.load_state, True),
            "/api/v1/save_weights_for_sampler": (service.save_for_sampler, True),
            "/api/v1/asample": (service.sample, True),
            "/api/v1/create_sampling_session": (service.create_sampling_session, False),
            "/api/v1/retrieve_future": (service.retrieve, False),
            "/api/v1/get_info": (self.info, False),
            "/api/v1/create_session": (lambda *_: {"session_id": uuid.uuid4().hex}, False),
            "/api/v1/session_heartbeat": (lambda *_: {"type": "session_heartbeat"}, False),
            "/api/v1/sessions/finish": (lambda *_: {}, False),  # ServiceClient.close
            "/api/v1/client/config": (lambda *_: {"use_pyqwest_transport": False}, False),
            "/api/v1/client/dynamic_config": (lambda *_: {}, False),
            "/api/v1/telemetry": (lambda *_: {"status": "accepted"}, False),
            "/api/v1/get_server_capabilities": (self.capabilities, False),
        }

    def info(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.service.model(tenant, body["model_id"])
        name = self.service.cfg.base_model
        return {
            "type": "get_info",
            "model_id": body["model_id"],
            "model_data": {"model_name": name, "tokenizer_id": name},
            "is_lora": model.lora_rank is not None,
            "lora_rank": model.lora_rank,
            "model_name": name,
        }

    def capabilities(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        cfg = self.service.cfg
        model = {"model_name": cfg.base_model, "max_context_length": cfg.max_tokens_per_datum}
        return {"supported_models": [model | {"trainable": True, "sampleable": True}]}


class TinkerHandler(EnvironmentHandler):
    """Routes the SDK's POSTs (JSON, and protobuf for forward_backward) after the host and key checks."""

    server: TinkerServer

    def do_GET(self) -> None:
        ok = self.path == "/api/v1/healthz"
        self._reply(200, {"status": "ok"}) if ok else self._reply(404, {"error": f"not served: {self.path}"})

    def do_POST(self) -> None:
        routes = self.server.routes()
        path = re.sub(r"^/api/v1/sessions/[^/]+/finish$", "/api/v1/sessions/finish", self.path)
        refusal = self._refusal() or (None if path in routes else (404, f"not served: {self.path}"))
        if refusal is not None:
            self._reply(refusal[0], {"error": refusal[1]})
            return
        handler, is_future = routes[path]
        tenant = self.headers.get("X-API-Key") or ""
        try:
            body = self._read_body() if path == "/api/v1/forward_backward" else self._read_json()
            if not isinstance(body, (bytes, dict)):
                raise BadRequest("the body must be a JSON object")
            if is_future:
                key = self.headers.get("X-Idempotency-Key")
                answer = self.server.service.run(tenant, key, handler, body)
            else:
                answer = handler(tenant, body)
        except (BadRequest, ValueError, KeyError, TypeError) as error:
            status = error.status if isinstance(error, BadRequest) else 400
            self._reply(status, {"error": f"malformed request: {error}"})
            return
        except Exception as error:  # a server fault: say so rather than drop the connection
            log.exception("serve-tinker: %s raised", self.path)
            self._reply(500, {"error": f"{type(error).__name__}: {error}"[:500]})
            return
        self._reply_bytes(answer) if isinstance(answer, bytes) else self._reply(200, answer)

    def _refusal(self) -> tuple[int, str] | None:
        """(status, reason) for a refused request: a non-loopback Host on loopback, a missing or unknown
        API key, a content type other than JSON or protobuf."""
        host = (self.headers.get("Host") or "").rpartition(":")[0] or self.headers.get("Host") or ""
        if self.server.loopback_only and host.strip("[]") not in LOOPBACK_NAMES:
            return 403, f"Host {self.headers.get('Host')!r} is not a loopback name"
        key = self.headers.get("X-API-Key") or ""
        if not key.startswith("tml-"):
            return 401, "an API key (X-API-Key, starting with 'tml-') is required"
        if self.server.keys and not any(hmac.compare_digest(key, known) for known in self.server.keys):
            return 401, "unknown API key"
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type not in ("application/json", PROTO):
            return 415, f"Content-Type must be application/json or {PROTO}, got {content_type or 'none'!r}"
        return None

    def _reply_bytes(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", PROTO)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def load_config(path: str) -> TinkerServiceConfig:
    """The service config from a YAML file, loaded and checked like every posttrain config."""
    return load_typed_config(TinkerServiceConfig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `posttrain serve-tinker` options."""
    parser.add_argument("--config", required=True, help="YAML file of the service (see docs/tinker.md)")
    add_server_arguments(parser, 8001, "POSTTRAIN_TINKER_KEYS")  # keys comma-separated


def main(args: argparse.Namespace) -> int:
    limits = server_limits(args)
    keys = server_token(args.host, args.token_env)
    if keys is not None and not all(key.startswith("tml-") for key in keys.split(",")):
        keys = ",".join(f"tml-{key}" for key in keys.split(","))  # a generated token gets the SDK's prefix
        print(f"serve-tinker: API keys: {keys}", flush=True)
    service = TinkerService(load_config(args.config))
    server = TinkerServer(service, args.host, args.port, keys.split(",") if keys else None, limits)
    print(f"serving Tinker at {server.url} (TINKER_BASE_URL; Ctrl-C stops)", flush=True)
    return serve_until_interrupted(server)
