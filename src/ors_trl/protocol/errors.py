"""Every error ors-trl raises, in one hierarchy under `ORSError`, in the order below; each one a caller may expect as a
builtin is one too (`ConfigurationError` a ValueError, `UsageError` a RuntimeError, `EnvironmentNotFoundError` a
LookupError, `ORSTimeoutError` a TimeoutError). Messages never hold API keys or secrets.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["APIStatusError", "AuthenticationError", "BadRequestError", "ConfigurationError", "ContextLengthExceeded",
           "EnvironmentNotFoundError", "ImageError", "MissingAPIKeyError", "NotFoundError", "ORSError",
           "ORSTimeoutError", "PaymentRequiredError", "PolicyError", "ProtocolError", "RateLimitError",
           "ServerError", "ServiceUnavailableError", "SessionExpiredError", "StreamInterruptedError", "ToolError",
           "ToolFailedError", "ToolRefusedError", "TransportError", "UsageError", "status_error"]


class ORSError(Exception):
    """Base class of every ors-trl error. `kind` is a short, stable label (metrics, records); `retryable` says that the
    client retries it by itself (seeing one means the retries are spent)."""

    retryable: ClassVar[bool] = False
    kind: ClassVar[str] = "error"


class ConfigurationError(ORSError, ValueError):
    """The arguments cannot work; fix them before anything is sent."""
    kind = "configuration"


class MissingAPIKeyError(ConfigurationError):
    """A catalog environment was requested without an API key."""


class UsageError(ORSError, RuntimeError):
    """An object was used in a state where that cannot work (closed, not reset, wrong loop or process)."""
    kind = "usage"


class EnvironmentNotFoundError(ORSError, LookupError):
    """The server does not host the requested environment.

    Args:
        message (`str`):
            What went wrong and what to do.
        available (`list[str]`, *optional*):
            The environments the server hosts (the attribute `available`).
    """

    kind = "not_found"

    def __init__(self, message: str, *, available: list[str] | None = None) -> None:
        super().__init__(message)
        self.available = list(available or [])


class APIStatusError(ORSError):
    """The server answered an HTTP error status; the keyword arguments are kept as attributes.

    Args:
        message (`str`):
            What went wrong and what to do.
        status_code (`int`):
            The HTTP status.
        detail (`str`, *optional*, defaults to `""`):
            The server's own message (its JSON `detail`, or the body).
        path (`str`, *optional*, defaults to `""`):
            The request path (never the query).
    """

    kind = "http"

    def __init__(self, message: str, *, status_code: int, detail: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail
        self.path = path


class BadRequestError(APIStatusError):
    """400 / 422: the request was invalid (unknown split, index out of range, bad body)."""


class AuthenticationError(APIStatusError):
    """401 / 403: the API key is missing or wrong."""
    kind = "auth"


class PaymentRequiredError(APIStatusError):
    """402: the platform account has no credits left."""
    kind = "auth"


class NotFoundError(APIStatusError):
    """404: no such route, environment or session."""


class SessionExpiredError(NotFoundError):
    """The session no longer exists on the server (reaped when idle, deleted, or the server restarted)."""
    kind = "expired"


class RateLimitError(APIStatusError):
    """429: too many requests. Retried with backoff before it reaches you."""
    retryable = True


class ServerError(APIStatusError):
    """500: the environment's own code raised. Not retried: it would fail the same way."""


class ServiceUnavailableError(APIStatusError):
    """502 / 503 / 504: a gateway or a starting backend. Retried with backoff before it reaches you."""
    retryable = True


class ToolError(ORSError):
    """A tool call did not produce an output.

    Args:
        message (`str`):
            What went wrong.
        tool (`str`, *optional*, defaults to `""`):
            The tool called (the attribute `tool`).
    """

    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool


class ToolRefusedError(ToolError):
    """The server refused the call without running the tool.

    Args:
        message (`str`):
            What went wrong.
        tool (`str`, *optional*, defaults to `""`):
            The tool called.
        reason (`str`, *optional*):
            The server's reason (the attribute `reason`): `"not_found"`, `"input_validation"`, `"name_collision"`,
            `"episode_finished"`, or `None` when an older server did not say.
    """

    kind = "refused"

    def __init__(self, message: str, *, tool: str = "", reason: str | None = None) -> None:
        super().__init__(message, tool=tool)
        self.reason = reason


class ToolFailedError(ToolError):
    """The tool raised inside the environment (an SSE `error` event)."""
    kind = "failed"


class TransportError(ORSError):
    """The network failed: connection refused or reset, DNS, TLS (retried where safe)."""
    retryable = True
    kind = "transport"


class ORSTimeoutError(TransportError, TimeoutError):
    """A configured deadline passed."""
    kind = "timeout"


class StreamInterruptedError(TransportError):
    """A tool-call stream broke before the server sent the call's task id: the tool may have started, and is not
    re-run (no tool ever runs twice because of the client)."""

    retryable = False


class ProtocolError(ORSError):
    """The server's answer does not follow the protocol (invalid JSON, missing fields, bad types)."""
    kind = "protocol"


class ImageError(ProtocolError):
    """An image block ors-trl will not show a model (not an image, undecodable, past a bound): the model reads a
    placeholder instead; the rest of the answer stands."""

    kind = "image"


class PolicyError(ORSError):
    """The policy could not produce a reply (an endpoint's error answer, a generation failure)."""
    kind = "policy"


class ContextLengthExceeded(PolicyError):
    """The conversation no longer fits the model's context: the episode ends (`end_reason="context_length"`)."""
    kind = "context_length"


def status_error(status: int, detail: str, path: str, *, session_scoped: bool) -> ORSError:
    """An ORS server's HTTP error status as our exception, with a message that says what to do."""
    where = f"{path}: " if path else ""
    if status == 404 and "unknown environment" in detail.lower():
        return EnvironmentNotFoundError(f"{where}{detail}")
    cls: type[APIStatusError] = APIStatusError
    text = f"unexpected status {status}: {detail}"
    if status in (400, 422):
        cls, text = BadRequestError, f"bad request ({status}): {detail}"
    elif status in (401, 403):
        cls, text = AuthenticationError, (f"the server rejected the credentials ({status}): {detail}. Check "
                                          "OPENREWARD_API_KEY or the api_key= you passed.")
    elif status == 402:
        cls, text = PaymentRequiredError, (f"payment required (402): {detail}. The OpenReward account has no credits "
                                           "left; top up at https://openreward.ai.")
    elif status == 410 or (status == 404 and session_scoped):
        cls, text = SessionExpiredError, (f"the session no longer exists on the server ({status}: {detail}); it was "
                                          "deleted, reaped after being idle, or the server restarted.")
    elif status == 404:
        cls, text = NotFoundError, f"not found (404): {detail}"
    elif status == 429:
        cls, text = RateLimitError, f"rate limited (429): {detail}"
    elif status in (502, 503, 504):
        cls, text = ServiceUnavailableError, f"service unavailable ({status}): {detail}"
    elif status >= 500:
        cls, text = ServerError, f"the environment failed ({status}): {detail}"
    return cls(where + text, status_code=status, detail=detail, path=path)
