"""Where a target lives: a URL (with `://`) of a self-hosted server, one host, the API key sent only when passed
explicitly; or a catalog name (`owner/name`) on the OpenReward platform, its API and sessions hosts derived from
`OPENREWARD_URL` (or `OPENREWARD_API_URL` / `OPENREWARD_SESSION_URL`), its key `api_key=` or `OPENREWARD_API_KEY`."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigurationError, MissingAPIKeyError

__all__ = ["Target", "encode_secrets", "resolve_target"]

DEFAULT_PLATFORM_URL = "https://openreward.ai"
_CATALOG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HEADER_TOKEN = re.compile(r"[\x21-\x7e]+")
_EXAMPLE = "expected something like 'http://127.0.0.1:8000'."
# Domains a well-known secret may be used against inside a platform sandbox (the platform's egress proxy reads
# `allowed_domains`); self-hosted servers ignore it.
_WELL_KNOWN_SECRET_DOMAINS: dict[str, list[str]] = {
    "openai_api_key": ["api.openai.com"],
    "anthropic_api_key": ["api.anthropic.com"],
    "gemini_api_key": ["generativelanguage.googleapis.com"],
    "google_api_key": ["generativelanguage.googleapis.com"],
    "hf_token": ["huggingface.co", "api-inference.huggingface.co"],
    "huggingface_api_key": ["huggingface.co", "api-inference.huggingface.co"],
    "tavily_api_key": ["api.tavily.com"],
    "github_token": ["github.com", "api.github.com"],
}
SecretValue = str | tuple[str, Sequence[str]]


class _Secret(str):
    """A str whose repr never shows the value."""

    def __repr__(self) -> str:
        return "'***'"


@dataclass(frozen=True)
class Target:
    """A resolved target: `kind`, `name` as the user wrote it, the base URLs of session requests and of the
    platform's stateless API (the same when self-hosted), the `X-Deployment` value, and the `api_key`, sent only to
    `key_hosts`."""

    kind: Literal["url", "catalog"]
    name: str
    session_url: str
    api_url: str
    deployment: str | None = None
    api_key: str | None = field(default=None, repr=False)
    key_hosts: frozenset[str] = frozenset()

    @property
    def is_url(self) -> bool:
        return self.kind == "url"

    def key_for(self, url: str) -> str | None:
        """The API key if `url` is one of the hosts it belongs to, else None."""
        return self.api_key if self.api_key and _host_port(url) in self.key_hosts else None

    def __repr__(self) -> str:
        key = "set" if self.api_key else "none"
        return f"Target(kind={self.kind!r}, name={self.name!r}, session_url={self.session_url!r}, api_key={key})"


def _host_port(url: str) -> str:
    """`host:port` of a URL, for deciding where the API key may go; "" for a malformed one."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a non-numeric or out-of-range port, e.g. in a redirect's Location
        return ""
    return f"{(parts.hostname or '').lower()}:{port}"


def _validate_url(url: str, what: str) -> str:
    """`url` without its query, fragment and trailing `/`; a `ConfigurationError` (never showing credentials) for one
    that is not http(s) or embeds credentials."""
    parts = urlsplit(url)
    shown = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{what} {shown!r} is not a valid http(s) URL; {_EXAMPLE}")
    if parts.username or parts.password:
        raise ConfigurationError(f"{what} must not embed credentials; pass api_key= instead.")
    try:
        parts.port  # noqa: B018 - raises ValueError for a non-numeric port
    except ValueError:
        raise ConfigurationError(f"{what} {shown!r} has an invalid port; {_EXAMPLE}") from None
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _platform_url(base: str, sub: str) -> str:
    """The platform's `sub` host: `sub.` before the base host, except for loopback names and IP literals."""
    parts = urlsplit(base)
    host = (parts.hostname or "").lower()
    try:
        single = host == "localhost" or host.endswith(".localhost") or ipaddress.ip_address(host) is not None
    except ValueError:
        single = False
    return base if single else urlunsplit((parts.scheme, f"{sub}.{parts.netloc}", parts.path, "", ""))


def resolve_target(target: str, *, api_key: str | None = None, environ: Mapping[str, str] | None = None) -> Target:
    """Resolve `target` into hosts and credentials, offline; a `MissingAPIKeyError` for a catalog name with no key."""
    env = os.environ if environ is None else environ
    if not isinstance(target, str) or not target.strip():
        raise ConfigurationError("target must be a catalog name like 'Eigent/SETA' or a URL like 'http://127.0.0.1:8000'.")
    target = target.strip()
    if "://" in target:
        url = _validate_url(target, "Target URL")
        key = _Secret(check_header_value(api_key, "api_key")) if api_key else None
        return Target("url", target, url, url, api_key=key, key_hosts=frozenset({_host_port(url)} if key else ()))
    if not _CATALOG_NAME.match(target):
        raise ConfigurationError(f"{target!r} is neither a URL (it has no '://') nor a catalog name of the form "
                                 "'owner/name' (e.g. 'Eigent/SETA').")
    base = _validate_url(env.get("OPENREWARD_URL") or DEFAULT_PLATFORM_URL, "OPENREWARD_URL")
    api_url = _validate_url(env.get("OPENREWARD_API_URL") or _platform_url(base, "api"), "OPENREWARD_API_URL")
    session_url = _validate_url(env.get("OPENREWARD_SESSION_URL") or _platform_url(base, "sessions"),
                                "OPENREWARD_SESSION_URL")
    key = api_key or env.get("OPENREWARD_API_KEY")
    if not key:
        raise MissingAPIKeyError(
            f"{target!r} is an OpenReward catalog environment and needs an API key: set OPENREWARD_API_KEY "
            "or pass api_key=... (get one at https://openreward.ai/keys). To use a self-hosted server, pass "
            "its URL instead, e.g. 'http://127.0.0.1:8000'.")
    return Target("catalog", target, session_url, api_url, deployment=target,
                  api_key=_Secret(check_header_value(key, "the API key")),
                  key_hosts=frozenset({_host_port(api_url), _host_port(session_url)}))


def check_header_value(value: str, what: str) -> str:
    """`value` if it can be an HTTP header value, else a `ConfigurationError` that does not show it."""
    if not isinstance(value, str) or not _HEADER_TOKEN.fullmatch(value):
        raise ConfigurationError(f"{what} holds whitespace or a character an HTTP header cannot carry (a trailing "
                                 "newline from a file?); pass the key alone.")
    return value


def encode_secrets(secrets: Mapping[str, SecretValue]) -> str:
    """The `X-Secrets` header: base64(JSON {name: {value, allowed_domains}}). A value is a string (given the
    well-known domains of its name) or `(value, allowed_domains)`: the hosts a platform sandbox may use it against."""
    payload: dict[str, dict[str, object]] = {}
    for name, entry in secrets.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError("secret names must be non-empty strings")
        if isinstance(entry, str):
            value, domains = entry, list(_WELL_KNOWN_SECRET_DOMAINS.get(name.lower(), []))
        elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
            value, domains = entry[0], [str(d) for d in entry[1]]
        else:
            raise ConfigurationError(f"secret {name!r} must be a string or a (value, allowed_domains) tuple")
        payload[name] = {"value": value, "allowed_domains": domains}
    return base64.b64encode(json.dumps(payload).encode()).decode()


def platform_key_secret(target: Target) -> dict[str, SecretValue]:
    """The conventional `api_key` session secret for a catalog target (what platform environments read)."""
    if target.kind != "catalog" or not target.api_key:
        return {}
    return {"api_key": (str(target.api_key), sorted({h.rsplit(":", 1)[0] for h in target.key_hosts}))}
