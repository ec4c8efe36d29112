"""JSON over HTTP POST for the clients that reach a network service (`remote`, `judge`): a total deadline
`deadline_s` for the whole call (connect, send, headers, body, retries), which shuts the connection when
it passes, so a server that drips one byte a second cannot hold the caller; a cap on the answer's size
(`max_response_bytes`); retries only when the request provably did not arrive (the connection could not
be opened) or the server answered a status the caller names as safe (`retry_statuses`, e.g. 429/503)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class HTTPCallError(RuntimeError):
    """The call got no usable answer; the message says why (and whether the request was sent)."""


class _NotSent(HTTPCallError):
    """The connection could not be opened: the server never saw the request, so a retry is safe."""


@dataclass
class HTTPReply:
    """A complete answer: its status and its body (at most the caller's cap)."""

    status: int
    body: bytes


@dataclass
class JSONClient:
    """POSTs JSON with one set of limits (`retries` `backoff_s` apart); `headers` go with every call."""

    deadline_s: float
    max_response_bytes: int
    retries: int = 0
    backoff_s: float = 0.5
    retry_statuses: frozenset[int] = frozenset()
    headers: dict[str, str] = field(default_factory=dict)

    def call(self, url: str, payload: Any, headers: dict[str, str] | None = None) -> dict[str, Any]:
        """The JSON object `url` answers with status 200 to `payload`; HTTPCallError naming `url` for
        anything else (deadline, lost connection, oversized or incomplete answer, once retries are spent)."""
        deadline = time.monotonic() + self.deadline_s
        data = json.dumps(payload).encode()
        all_headers = {"Content-Type": "application/json", **self.headers, **(headers or {})}
        problem, reply = "no try fitted in the deadline", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(max(0.0, min(self.backoff_s, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
            try:
                reply = self._post_once(url, data, all_headers, deadline)
            except _NotSent as error:
                problem = str(error)
                continue
            except HTTPCallError as error:
                raise HTTPCallError(f"{url}: {error}") from error
            if reply.status not in self.retry_statuses:
                break
            problem, reply = f"HTTP {reply.status}: {reply.body[:200]!r}", None
        if reply is None:
            raise HTTPCallError(f"{url}: {problem} ({attempt + 1} tries within {self.deadline_s} s)")
        if reply.status != 200:
            raise HTTPCallError(f"{url}: HTTP {reply.status}: {reply.body[:200]!r}")
        try:
            answer = json.loads(reply.body)
        except RecursionError:
            raise HTTPCallError(f"{url}: not JSON: the answer's JSON is nested too deeply") from None
        except ValueError as error:
            raise HTTPCallError(f"{url}: not JSON: {error}") from error
        if not isinstance(answer, dict):
            raise HTTPCallError(f"{url}: the answer is not a JSON object")
        return answer

    def _post_once(self, url: str, data: bytes, headers: dict[str, str], deadline: float) -> HTTPReply:
        """One try: connect (a failure is _NotSent), then send and read under a watchdog that shuts the
        socket at the deadline."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HTTPCallError(f"not an http(s) URL: {url!r}")
        remaining = deadline - time.monotonic()
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=remaining, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=remaining)
        try:
            try:
                conn.connect()
            except OSError as error:
                raise _NotSent(f"cannot connect: {error}") from error
            return self._exchange(conn, parts.path or "/", data, headers, deadline)
        finally:
            conn.close()

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        path: str,
        data: bytes,
        headers: dict[str, str],
        deadline: float,
    ) -> HTTPReply:
        """Send the request on an open connection and read the whole answer; the watchdog holds the socket
        itself, as http.client lets go of `conn.sock` once the answer is underway."""
        sock, expired, max_response_bytes = conn.sock, threading.Event(), self.max_response_bytes

        def cut() -> None:
            expired.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", path, body=data, headers=headers)
            response = conn.getresponse()
            declared = response.getheader("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_response_bytes:
                raise HTTPCallError(f"the answer is {declared} bytes, over the cap of {max_response_bytes}")
            body = response.read(max_response_bytes + 1)
            if expired.is_set():
                raise HTTPCallError("no complete answer before the deadline")
            if len(body) > max_response_bytes:
                raise HTTPCallError(f"the answer is over the cap of {max_response_bytes} bytes")
            if declared is not None and declared.isdigit() and len(body) < int(declared):
                raise HTTPCallError(f"the answer ended after {len(body)} of its {declared} bytes")
            return HTTPReply(response.status, body)
        except (OSError, http.client.HTTPException) as error:
            # the socket's own timeout (the time left at connect) can fire before the watchdog thread runs
            if expired.is_set() or isinstance(error, TimeoutError) or time.monotonic() >= deadline:
                raise HTTPCallError("no complete answer before the deadline") from error
            raise HTTPCallError(f"the connection failed after the request was sent: {error!r}") from error
        finally:
            watchdog.cancel()
