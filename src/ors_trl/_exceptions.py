"""Every error ors-trl raises, in one hierarchy.

    ORSError
    ├── ConfigurationError        bad input caught before any request (also a ValueError)
    │   └── MissingAPIKeyError    a catalog name with no OPENREWARD_API_KEY / api_key
    ├── EnvironmentNotFoundError  the server has no such environment (also a LookupError)
    ├── APIStatusError            the server answered with an error status (.status_code, .detail)
    │   ├── BadRequestError       400 / 422: invalid split, index, body
    │   ├── AuthenticationError   401 / 403: missing or wrong API key
    │   ├── PaymentRequiredError  402: the account has no credits
    │   ├── NotFoundError         404
    │   │   └── SessionExpiredError   the session is gone (reaped, deleted, server restarted)
    │   ├── RateLimitError        429                                    [retried]
    │   ├── ServerError           500: the environment's own code failed
    │   └── ServiceUnavailableError  502 / 503 / 504                     [retried]
    ├── ToolError                 a tool call produced no output
    │   ├── ToolRefusedError      the server refused the call (.reason: not_found, input_validation,
    │   │                         name_collision, episode_finished)
    │   └── ToolFailedError       the tool raised inside the environment
    ├── TransportError            the network failed                     [retried where safe]
    │   ├── ORSTimeoutError       a deadline passed (also a TimeoutError)
    │   └── StreamInterruptedError  a tool-call stream broke before the server named the call;
    │                              not retried, since the tool may already be running
    └── ProtocolError             the server's answer was malformed (bad JSON, missing fields)

`retryable` on each class says whether the client retries it by itself; a caller that sees one
of the retryable errors has already waited out the retry budget. Messages never contain API keys
or secrets.
"""

from __future__ import annotations

__all__ = [
    "APIStatusError",
    "AuthenticationError",
    "BadRequestError",
    "ConfigurationError",
    "EnvironmentNotFoundError",
    "MissingAPIKeyError",
    "NotFoundError",
    "ORSError",
    "ORSTimeoutError",
    "PaymentRequiredError",
    "ProtocolError",
    "RateLimitError",
    "ServerError",
    "ServiceUnavailableError",
    "SessionExpiredError",
    "StreamInterruptedError",
    "ToolError",
    "ToolFailedError",
    "ToolRefusedError",
    "TransportError",
]


class ORSError(Exception):
    """Base class of every ors-trl error."""

    retryable: bool = False

    @property
    def kind(self) -> str:
        """A short, stable label for metrics ("refused", "failed", "expired", "transport", ...)."""
        return "error"


class ConfigurationError(ORSError, ValueError):
    """The arguments cannot work; fix them before anything is sent."""

    @property
    def kind(self) -> str:
        return "configuration"


class MissingAPIKeyError(ConfigurationError):
    """A catalog environment was requested without an API key."""


class EnvironmentNotFoundError(ORSError, LookupError):
    """The server does not host the requested environment."""

    def __init__(self, message: str, *, available: list[str] | None = None) -> None:
        super().__init__(message)
        self.available = list(available or [])

    @property
    def kind(self) -> str:
        return "not_found"


class APIStatusError(ORSError):
    """The server answered an HTTP error status.

    Attributes:
        status_code: the HTTP status.
        detail: the server's own message (its JSON `detail`, or the body text).
        path: the request path (never the query, never headers).
    """

    def __init__(self, message: str, *, status_code: int, detail: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail
        self.path = path

    @property
    def kind(self) -> str:
        return "http"


class BadRequestError(APIStatusError):
    """400 / 422: the request was invalid (unknown split, index out of range, bad body)."""


class AuthenticationError(APIStatusError):
    """401 / 403: the API key is missing or wrong."""

    @property
    def kind(self) -> str:
        return "auth"


class PaymentRequiredError(APIStatusError):
    """402: the platform account has no credits left."""

    @property
    def kind(self) -> str:
        return "auth"


class NotFoundError(APIStatusError):
    """404: no such route, environment or session."""


class SessionExpiredError(NotFoundError):
    """The session no longer exists on the server (reaped when idle, deleted, or the server restarted)."""

    @property
    def kind(self) -> str:
        return "expired"


class RateLimitError(APIStatusError):
    """429: too many requests. Retried with backoff before it reaches you."""

    retryable = True


class ServerError(APIStatusError):
    """500: the environment's own code raised. Not retried: it would fail the same way."""


class ServiceUnavailableError(APIStatusError):
    """502 / 503 / 504: a gateway or a starting backend. Retried with backoff before it reaches you."""

    retryable = True


class ToolError(ORSError):
    """A tool call did not produce an output."""

    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool


class ToolRefusedError(ToolError):
    """The server refused the call without running the tool.

    `reason` is the server's discriminator: "not_found", "input_validation", "name_collision",
    "episode_finished", or None when an older server did not say.
    """

    def __init__(self, message: str, *, tool: str = "", reason: str | None = None) -> None:
        super().__init__(message, tool=tool)
        self.reason = reason

    @property
    def kind(self) -> str:
        return "refused"


class ToolFailedError(ToolError):
    """The tool raised inside the environment (an SSE `error` event)."""

    @property
    def kind(self) -> str:
        return "failed"


class TransportError(ORSError):
    """The network failed: connection refused or reset, DNS, TLS."""

    retryable = True

    @property
    def kind(self) -> str:
        return "transport"


class ORSTimeoutError(TransportError, TimeoutError):
    """A configured deadline passed."""

    @property
    def kind(self) -> str:
        return "timeout"


class StreamInterruptedError(TransportError):
    """A tool-call stream broke before the server sent the call's task id.

    The tool may or may not have started; it is not re-run, so that no tool ever runs twice
    because of the client.
    """

    retryable = False


class ProtocolError(ORSError):
    """The server's answer does not follow the protocol (invalid JSON, missing fields, bad types)."""

    @property
    def kind(self) -> str:
        return "protocol"
