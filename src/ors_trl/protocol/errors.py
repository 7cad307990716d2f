"""Every error ors-trl raises, in one hierarchy.

    ORSError                          .kind: a short, stable label (metrics, records)
    ├── ConfigurationError            bad input, caught before anything is sent (also a ValueError)
    │   └── MissingAPIKeyError        a catalog name with no OPENREWARD_API_KEY / api_key
    ├── UsageError                    an object used in a state that cannot work (also a RuntimeError):
    │                                 a closed client or session, a tool before reset(), the wrong event
    │                                 loop or process, after interpreter shutdown
    ├── EnvironmentNotFoundError      the server has no such environment (also a LookupError)
    ├── APIStatusError                the server answered with an error status (.status_code, .detail)
    │   ├── BadRequestError           400 / 422: invalid split, index, body
    │   ├── AuthenticationError       401 / 403: missing or wrong API key
    │   ├── PaymentRequiredError      402: the account has no credits
    │   ├── NotFoundError             404
    │   │   └── SessionExpiredError   the session is gone (reaped, deleted, server restarted)
    │   ├── RateLimitError            429                                      [retried]
    │   ├── ServerError               500: the environment's own code failed
    │   └── ServiceUnavailableError   502 / 503 / 504                          [retried]
    ├── ToolError                     a tool call produced no output
    │   ├── ToolRefusedError          refused without running (.reason: not_found, input_validation,
    │   │                             name_collision, episode_finished)
    │   └── ToolFailedError           the tool raised inside the environment
    ├── TransportError                the network failed                       [retried where safe]
    │   ├── ORSTimeoutError           a deadline passed (also a TimeoutError)
    │   └── StreamInterruptedError    a stream broke before the server named the call; not retried,
    │                                 since the tool may already be running
    ├── ProtocolError                 the server's answer was malformed (bad JSON, missing fields)
    │   └── ImageError                an image block that cannot be shown (not an image, a bomb, too large)
    └── PolicyError                   the policy (the model being evaluated) produced no reply
        └── ContextLengthExceeded     the conversation no longer fits the model's context

`retryable` says whether the client retries an error by itself: seeing a retryable one means the
retry budget is spent. Messages never contain API keys or secrets.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["APIStatusError", "AuthenticationError", "BadRequestError", "ConfigurationError", "ContextLengthExceeded",
           "EnvironmentNotFoundError", "ImageError", "MissingAPIKeyError", "NotFoundError", "ORSError",
           "ORSTimeoutError", "PaymentRequiredError", "PolicyError", "ProtocolError", "RateLimitError",
           "ServerError", "ServiceUnavailableError", "SessionExpiredError", "StreamInterruptedError", "ToolError",
           "ToolFailedError", "ToolRefusedError", "TransportError", "UsageError"]


class ORSError(Exception):
    """Base class of every ors-trl error."""

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
            The environments the server hosts; kept as the attribute `available`.
    """

    kind = "not_found"

    def __init__(self, message: str, *, available: list[str] | None = None) -> None:
        super().__init__(message)
        self.available = list(available or [])


class APIStatusError(ORSError):
    """The server answered an HTTP error status. The keyword arguments are kept as attributes of the same name.

    Args:
        message (`str`):
            What went wrong and what to do.
        status_code (`int`):
            The HTTP status.
        detail (`str`, *optional*, defaults to `""`):
            The server's own message (its JSON `detail`, or the body text).
        path (`str`, *optional*, defaults to `""`):
            The request path (never the query, never headers).
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
            The tool called; kept as the attribute `tool`.
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
            The tool called; kept as the attribute `tool`.
        reason (`str`, *optional*):
            The server's discriminator, kept as the attribute `reason`: `"not_found"`, `"input_validation"`,
            `"name_collision"`, `"episode_finished"`, or `None` when an older server did not say.
    """

    kind = "refused"

    def __init__(self, message: str, *, tool: str = "", reason: str | None = None) -> None:
        super().__init__(message, tool=tool)
        self.reason = reason


class ToolFailedError(ToolError):
    """The tool raised inside the environment (an SSE `error` event)."""

    kind = "failed"


class TransportError(ORSError):
    """The network failed: connection refused or reset, DNS, TLS."""

    retryable = True
    kind = "transport"


class ORSTimeoutError(TransportError, TimeoutError):
    """A configured deadline passed."""

    kind = "timeout"


class StreamInterruptedError(TransportError):
    """A tool-call stream broke before the server sent the call's task id.

    The tool may or may not have started; it is not re-run, so that no tool ever runs twice
    because of the client.
    """

    retryable = False


class ProtocolError(ORSError):
    """The server's answer does not follow the protocol (invalid JSON, missing fields, bad types)."""

    kind = "protocol"


class ImageError(ProtocolError):
    """An image block ors-trl will not show a model (`ors_trl.protocol.images` says why: not an image, undecodable, past a
    bound). The model reads a text placeholder for that block instead; the rest of the answer stands."""

    kind = "image"


class PolicyError(ORSError):
    """The policy could not produce a reply (an endpoint's error answer, a generation failure)."""

    kind = "policy"


class ContextLengthExceeded(PolicyError):
    """The conversation no longer fits the model's context: the episode ends (`end_reason="context_length"`)."""

    kind = "context_length"
