"""One JSON POST with a total deadline and a cap on the answer's size, for the clients that reach a
network service (the remote environment, the judge). The deadline bounds the whole call (connect, send,
headers, body, retries): when it passes, the connection is shut, so a server that drips one byte a second
cannot hold the caller. A call is retried only when the request provably did not arrive (the connection
was refused or could not be opened) or the server answered with a status the caller names as safe to
retry (e.g. 429/503, which say the request was not served)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
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

    def json(self) -> Any:
        """The body decoded as JSON; ValueError when it is not (RecursionError included)."""
        try:
            return json.loads(self.body)
        except RecursionError:
            raise ValueError("the answer's JSON is nested too deeply") from None


def post_json(
    url: str,
    payload: Any,
    *,
    deadline_s: float,
    max_response_bytes: int,
    headers: dict[str, str] | None = None,
    retries: int = 0,
    backoff_s: float = 0.5,
    retry_statuses: frozenset[int] = frozenset(),
) -> HTTPReply:
    """POST `payload` as JSON to `url`, all tries within `deadline_s` seconds. Retries (at most `retries`,
    `backoff_s` apart) a connection that could not be opened and an answer whose status is in
    `retry_statuses`; HTTPCallError on anything else that fails (deadline, lost connection, oversized or
    incomplete answer)."""
    deadline = time.monotonic() + deadline_s
    data = json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    problem = "no try fitted in the deadline"
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(max(0.0, min(backoff_s, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            break
        try:
            reply = _post_once(url, data, all_headers, deadline, max_response_bytes)
        except _NotSent as error:
            problem = str(error)
            continue
        except HTTPCallError as error:
            raise HTTPCallError(f"{url}: {error}") from error
        if reply.status not in retry_statuses:
            return reply
        problem = f"HTTP {reply.status}: {reply.body[:200]!r}"
    raise HTTPCallError(f"{url}: {problem} ({attempt + 1} tries within {deadline_s} s)")


def _post_once(
    url: str, data: bytes, headers: dict[str, str], deadline: float, max_response_bytes: int
) -> HTTPReply:
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
        return _exchange(conn, conn.sock, parts.path or "/", data, headers, deadline, max_response_bytes)
    finally:
        conn.close()


def _exchange(
    conn: http.client.HTTPConnection,
    sock: socket.socket,
    path: str,
    data: bytes,
    headers: dict[str, str],
    deadline: float,
    max_response_bytes: int,
) -> HTTPReply:
    """Send the request on an open connection (`sock`, its socket, which the watchdog shuts at the deadline:
    http.client lets go of `conn.sock` once the answer is underway) and read the whole answer."""
    expired = threading.Event()

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
