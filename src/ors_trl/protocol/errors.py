"""Every error ors-trl raises, in one hierarchy under `ORSError`, in the order below; each one a caller may expect as a
builtin is one too (`ConfigurationError` a ValueError, `UsageError` a RuntimeError, `EnvironmentNotFoundError` a
LookupError, `ORSTimeoutError` a TimeoutError). Messages never hold API keys or secrets."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Collection, Iterable
from typing import Any, ClassVar, TypeVar

__all__ = ["APIStatusError", "AuthenticationError", "BadRequestError", "ConfigurationError", "ContextLengthExceeded",
           "EnvironmentNotFoundError", "ImageError", "MissingAPIKeyError", "MissingExtraError", "NotFoundError",
           "ORSError", "ORSTimeoutError", "PaymentRequiredError", "PolicyError", "ProtocolError", "RateLimitError",
           "ServerError", "ServiceUnavailableError", "SessionExpiredError", "StreamInterruptedError", "ToolError",
           "ToolFailedError", "ToolRefusedError", "TransportError", "UnknownKeywordError", "UsageError",
           "checked_keywords", "extra_module", "missing_extra", "require_extra", "status_error"]


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


class UnknownKeywordError(ConfigurationError, TypeError):
    """A keyword argument that does not exist (a typo); the message names the closest one. A `TypeError` too, as
    Python's own would be."""


def unknown_keywords(what: str, given: Iterable[str], names: Collection[str]) -> UnknownKeywordError | None:
    """The error for the names in `given` that are not in `names` (None if all are), each with its closest name."""
    unknown = sorted(set(given) - set(names))
    if not unknown:
        return None
    close = {u: difflib.get_close_matches(u, names, 1) for u in unknown}
    hints = ", ".join(f"{u!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for u, c in close.items())
    listed = "" if all(close.values()) else f"; the keywords are: {', '.join(sorted(names))}"
    return UnknownKeywordError(f"{what}: unknown keyword {hints}{listed}")


_F = TypeVar("_F", bound=Callable[..., Any])


def checked_keywords(func: _F) -> _F:
    """`func`, raising `UnknownKeywordError` that names the closest keyword for a mistyped one (Python's own
    TypeError names none)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [n for n, p in inspect.signature(func).parameters.items() if p.kind in kinds and n != "self"]
    what = func.__qualname__.removesuffix(".__init__") + "()"

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if error := unknown_keywords(what, kwargs, names):
            raise error
        return func(*args, **kwargs)

    return checked  # type: ignore[return-value]


class MissingExtraError(ConfigurationError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    Args:
        message (`str`):
            What needs what, and the `pip install 'ors-trl[...]'` line.
        extra (`str`):
            The extra of pyproject.toml that installs it (`trl`, `demo`, `report`, `vision`; the attribute `extra`).
        name (`str`, *optional*):
            The missing module (the attribute `name`, as `ImportError`'s).
    """

    def __init__(self, message: str, *, extra: str, name: str | None = None) -> None:
        super().__init__(message)
        self.extra, self.name = extra, name


#: What each extra of pyproject.toml installs that ors-trl imports (torch comes with TRL).
EXTRAS = {"trl": ("torch", "transformers", "trl", "datasets", "accelerate"),
          "demo": ("torch", "transformers", "trl", "datasets", "accelerate", "openreward", "tokenizers"),
          "report": ("matplotlib",), "vision": ("PIL",)}


def require_extra(extra: str, what: str, modules: Iterable[str] | None = None) -> None:
    """Raise `MissingExtraError` naming `extra` before any work when one of its modules (or of those of them that
    `what` needs) is not installed; `what` is what needs it (`"ors-trl demo"`, `"spec.rollout_func"`)."""
    missing = [m for m in (EXTRAS[extra] if modules is None else modules) if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                                f"installed: pip install 'ors-trl[{extra}]'", extra=extra, name=missing[0])


def extra_module(name: str, what: str) -> Any:
    """`import name` for `what`, or `MissingExtraError` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, what) or exc from None


def missing_extra(exc: BaseException, what: str) -> MissingExtraError | None:
    """`exc` as `MissingExtraError` when it is a missing optional dependency's `ModuleNotFoundError` (else None)."""
    if isinstance(exc, MissingExtraError):
        return exc
    top = (exc.name or "").partition(".")[0] if isinstance(exc, ModuleNotFoundError) else None
    extra = next((extra for extra, names in EXTRAS.items() if top in names), None)
    if extra is None:
        return None
    return MissingExtraError(f"{what} needs {exc.name}, which is not installed: pip install 'ors-trl[{extra}]'",
                             extra=extra, name=exc.name)


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
        self.status_code, self.detail, self.path = status_code, detail, path


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


#: The class and message of an ORS server's HTTP error status; `{s}` is the status, `{d}` the server's detail.
_STATUS_ERRORS: dict[int, tuple[type[APIStatusError], str]] = {
    **dict.fromkeys((400, 422), (BadRequestError, "bad request ({s}): {d}")),
    **dict.fromkeys((401, 403), (AuthenticationError, "the server rejected the credentials ({s}): {d}. Check "
                                 "OPENREWARD_API_KEY or the api_key= you passed.")),
    402: (PaymentRequiredError, "payment required (402): {d}. The OpenReward account has no credits left; top up at "
          "https://openreward.ai."),
    404: (NotFoundError, "not found (404): {d}"),
    410: (SessionExpiredError, "the session no longer exists on the server ({s}: {d}); it was deleted, reaped after "
          "being idle, or the server restarted."),
    429: (RateLimitError, "rate limited (429): {d}"),
    **dict.fromkeys((502, 503, 504), (ServiceUnavailableError, "service unavailable ({s}): {d}")),
}


def status_error(status: int, detail: str, path: str, *, session_scoped: bool) -> ORSError:
    """An ORS server's HTTP error status as our exception, with a message that says what to do."""
    where = f"{path}: " if path else ""
    if status == 404 and "unknown environment" in detail.lower():
        return EnvironmentNotFoundError(f"{where}{detail}")
    other = (ServerError, "the environment failed ({s}): {d}") if status >= 500 else (
        APIStatusError, "unexpected status {s}: {d}")
    cls, text = _STATUS_ERRORS.get(410 if status == 404 and session_scoped else status, other)
    return cls(where + text.format(s=status, d=detail), status_code=status, detail=detail, path=path)
