"""A JSON-over-HTTP transport small enough to fake in tests.

The engine clients (`VLLMClient`, `CoordinatorClient`) talk to their servers only
through a `Transport`: one method that sends a JSON body and returns the status and
the decoded JSON. The real one uses the standard library (`urllib`) so the core gains
no dependency; tests pass a `FakeTransport` that records every request and answers
from a table, so the lifecycle → engine mapping is tested without a server.

Errors are split by what the caller should do about them:
- `EngineUnavailableError`: nothing answered (connection refused, timeout, DNS). The
  engine may come back; lifecycle hints are dropped with a log line.
- `EngineRequestError`: the server answered with a 4xx/5xx. The message carries the
  method, URL, status and the server's own words.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineError(RuntimeError):
    """Base of every error raised while talking to a served engine."""


class EngineUnavailableError(EngineError):
    """The server did not answer (refused, timed out, unreachable).

    Attributes:
        refused: the connection was refused or dropped (nothing listens, or the server
            went away mid-request: it is down), as opposed to a timeout (it may only be
            slow). A fleet marks a refusing engine down at once, a timing-out one after
            `engine.down_after_failures`.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class EngineRequestError(EngineError):
    """The server answered with an error status.

    Attributes:
        status: the HTTP status code.
        body: the decoded response body (JSON when it was JSON, else the text).
    """

    def __init__(self, message: str, *, status: int, body: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Response:
    """What a transport returns: the status and the decoded body (JSON, or text when not JSON)."""

    status: int
    body: Any


class Transport(Protocol):
    """Sends one request; raises `EngineUnavailableError` when nothing answers."""

    def request(self, method: str, url: str, body: Any | None, timeout: float) -> Response:
        """Send `body` (JSON-encoded when not None) and return the status and decoded body."""
        ...


def _decode(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return text


class UrllibTransport:
    """The real transport: `urllib.request`, JSON in and out, no dependency."""

    def request(self, method: str, url: str, body: Any | None, timeout: float) -> Response:
        """Send the request; an error status is returned as a `Response`, not raised."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (URL from config)
                return Response(int(resp.status), _decode(resp.read()))
        except urllib.error.HTTPError as e:
            return Response(int(e.code), _decode(e.read() or b""))
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            msg = f"{method} {url}: no answer within {timeout:g} s ({reason})"
            raise EngineUnavailableError(
                msg, refused=isinstance(reason, ConnectionError | http.client.HTTPException)
            ) from e


def checked_endpoint(url: str, what: str, timeout: float) -> str:
    """`url` without a trailing slash, once it and `timeout` are valid (ValueError naming `what` if not)."""
    if not url.startswith(("http://", "https://")):
        msg = f"{what} url: expected http:// or https://, got {url!r}"
        raise ValueError(msg)
    if timeout <= 0:
        msg = f"timeout: expected > 0 seconds, got {timeout!r}"
        raise ValueError(msg)
    return url.rstrip("/")


def call(transport: Transport, method: str, url: str, body: Any | None, timeout: float) -> Any:
    """Send a request and return the decoded body; raise `EngineRequestError` on 4xx/5xx."""
    response = transport.request(method, url, body, timeout)
    if response.status >= 400:
        detail = response.body
        if isinstance(detail, dict) and "detail" in detail:
            detail = detail["detail"]
        msg = f"{method} {url}: HTTP {response.status}: {str(detail)[:500]}"
        raise EngineRequestError(msg, status=response.status, body=response.body)
    return response.body


Handler = Callable[[str, str, Any], Response | Any]
"""A fake route: `(method, path, body) -> Response` (or a plain body, meaning status 200)."""


@dataclass
class FakeTransport:
    """A transport that records requests and answers from `routes` (tests and dry runs).

    `routes` maps `"METHOD /path"` (path without the host) to a handler or a fixed body.
    A request with no route gets a 404 like a real server; `down=True` makes every
    request fail as if the server were not running.
    """

    routes: dict[str, Handler | Any] = field(default_factory=dict)
    down: bool = False
    requests: list[tuple[str, str, Any]] = field(default_factory=list)

    def request(self, method: str, url: str, body: Any | None, timeout: float) -> Response:
        """Record the request and answer it from the routes table."""
        path = "/" + url.split("://", 1)[-1].split("/", 1)[-1] if "/" in url.split("://", 1)[-1] else "/"
        self.requests.append((method, path, body))
        if self.down:
            msg = f"{method} {url}: no answer within {timeout:g} s (connection refused)"
            raise EngineUnavailableError(msg, refused=True)
        route = self.routes.get(f"{method} {path}")
        if route is None:
            route = next(
                (h for key, h in self.routes.items() if _prefix_match(key, method, path)),
                None,
            )
        if route is None:
            return Response(404, {"detail": "Not Found"})
        answer = route(method, path, body) if callable(route) else route
        return answer if isinstance(answer, Response) else Response(200, answer)

    def sent(self, method: str, path_prefix: str) -> list[Any]:
        """Bodies of the recorded requests with this method whose path starts with `path_prefix`."""
        return [b for m, p, b in self.requests if m == method and p.startswith(path_prefix)]


def _prefix_match(key: str, method: str, path: str) -> bool:
    """`"GET /a/*"` matches any path under `/a/`."""
    key_method, _, key_path = key.partition(" ")
    return key_method == method and key_path.endswith("*") and path.startswith(key_path[:-1])
