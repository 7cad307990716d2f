"""Agent harnesses that own their loop, on ORS environments (design decision 16): `Harness` plays an episode through
a loopback MCP endpoint (the episode's tools) and an OpenAI-compatible endpoint backed by ors-trl's generator, and
turns its model calls into training rows token-exactly. See docs/guides/agent.md."""

from .driver import Endpoint, Harness, HarnessConversation
from .rows import build_rows
from .server import HarnessServer, ModelCall

__all__ = ["Endpoint", "Harness", "HarnessConversation", "HarnessServer", "ModelCall", "build_rows"]
