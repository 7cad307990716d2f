"""One HTTP server for harness episodes, loopback by default (design decision 16): an MCP endpoint with each
episode's tools (Streamable HTTP, JSON responses only) and OpenAI-compatible model endpoints backed in-process by an
ors-trl generator, each call kept as a `ModelCall` for the row builder. Tool calls go to `Episode.call`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..core.conversation import assistant_message
from ..core.episode import Episode, Reply, ToolCall
from ..core.rollout import Conversation, StopEpisode
from ..evaluation.policies import openai_message
from ..protocol.errors import ContextLengthExceeded

__all__ = ["HarnessServer", "ModelCall", "Seat"]

logger = logging.getLogger("ors_trl.harness")

#: MCP protocol revisions the endpoint answers `initialize` with (the client's when it is one of them).
MCP_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
#: What a harness reads when it calls the model after its episode ended.
ENDED = "The episode has ended."
_LOOPBACK = re.compile(r"https?://(127\.0\.0\.1|localhost|\[::1\])(:\d+)?/?", re.IGNORECASE)


@dataclass
class ModelCall:
    """One model call of a harness: what it sent, what the generator answered, and the ids (None without a token
    generator). `row`: the training row it went into (`ors_trl.harness.rows`), None when it trains in none."""

    index: int
    messages: list[dict[str, Any]]
    reply: Reply
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    version: int | None = None
    joined: bool = False
    row: int | None = None


@dataclass
class Seat:
    """One episode at the server: its token, its generator, its model calls and the conversation they continue."""

    episode: Episode
    generator: Any
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    calls: list[ModelCall] = field(default_factory=list)
    conversation: Conversation | None = None
    shown: list[dict[str, Any]] = field(default_factory=list)  # the last answered request + our reply to it
    names: dict[str, str] = field(default_factory=dict)  # our tool-call ids -> tool names
    live: set[asyncio.Task[Any]] = field(default_factory=set)  # its requests in flight: cancelled when it is revoked

    def __repr__(self) -> str:  # never the token
        return f"<Seat {self.episode!r} calls={len(self.calls)}>"


_SEAT: Any = web.RequestKey("seat", Seat) if hasattr(web, "RequestKey") else "seat"  # aiohttp < 3.13: a str key


def _text(content: Any) -> str:
    """A message's text (content parts joined)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def _texts(*contents: Any) -> bool:
    """Whether message contents are text alone: `_text` keeps nothing else, and the model must not answer about an
    image (audio, file) it is never shown."""
    return all(not isinstance(c, list) or all(isinstance(p, Mapping) and "text" in p for p in c) for c in contents)


#: Why a request with other parts is refused.
_TEXT_ONLY = "this endpoint serves text content only: image, audio and file parts are not supported"


def _identity(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages the same turn (arguments compared as canonical JSON)."""
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True, default=str))
                  for c in map(ToolCall.of, message.get("tool_calls") or ()))
    return message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id")


def _version(generator: Any) -> int | None:
    """The policy version a generator samples with: its trainer's step, or its own `version`."""
    state = getattr(getattr(getattr(generator, "backend", None), "trainer", None), "state", None)
    step = getattr(state, "global_step", None)
    return step if isinstance(step, int) else getattr(generator, "version", None)


def _error(id_: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "error": {"code": code, "message": message}}


class HarnessServer:
    """The server of one harness (`start` on the loop that plays the episodes, `aclose` at the end): `/mcp` (tools)
    and `/v1/chat/completions` (the model), routed to an episode by its bearer token. `refused`: requests answered
    401/403 (nothing of them ran).

    Args:
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            The address to bind (`"0.0.0.0"`: every interface, for an environment on another machine).
        port (`int`, *optional*, defaults to `0`):
            The port to bind (0: a free one).
        public_url (`str`, *optional*):
            The base URL harnesses are given, where they reach it another way (a tunnel, a routable address).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, public_url: str | None = None) -> None:
        self.host, self.port, self.public_url = host, port, public_url and public_url.rstrip("/")
        self.seats: dict[str, Seat] = {}
        self.refused = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    def __reduce__(self) -> tuple[Any, ...]:  # to another process (TRL's async rollout worker): its settings, not its seats
        return type(self), (self.host, self.port, self.public_url)

    def __repr__(self) -> str:
        return f"HarnessServer({self.url!r}, episodes={len(self.seats)})"

    async def start(self) -> str:
        """Bind (once, however many episodes start at the same time); the base URL harnesses are given."""
        async with self._lock:
            if self._runner is None:
                app = web.Application(client_max_size=16 * 2**20, middlewares=[self._admit])
                app.router.add_post("/mcp", self._mcp)
                app.router.add_post("/v1/chat/completions", functools.partial(self._model_call, _from_chat, _completion))
                # the OpenAI Responses API, stateless: the harness sends its whole input
                app.router.add_post("/v1/responses", functools.partial(self._model_call, _from_responses, _response))
                app.router.add_get("/v1/models", _models)
                runner = web.AppRunner(app, access_log=None, handler_cancellation=True)  # a call its client left stops
                await runner.setup()
                site = web.TCPSite(runner, self.host, self.port)
                try:
                    await site.start()
                except BaseException:  # the port is taken: nothing half-started stays, the next start binds
                    await runner.cleanup()
                    raise
                self._runner = runner
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                near = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
                self.url = self.public_url or f"http://{f'[{near}]' if ':' in near else near}:{port}"
            return self.url

    async def aclose(self) -> None:
        """Stop serving (every token stops working)."""
        self.seats.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.url = None, ""

    def seat(self, episode: Episode, generator: Any) -> Seat:
        """Admit an episode: its seat, with a fresh token."""
        seat = Seat(episode, generator)
        self.seats[seat.token] = seat
        return seat

    def revoke(self, seat: Seat) -> None:
        """The episode's token stops working (its harness has stopped), and its requests in flight stop with it."""
        self.seats.pop(seat.token, None)
        for task in seat.live:
            task.cancel()

    @web.middleware
    async def _admit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Route a request to its episode by its unguessable token (API key, MCP bearer token), or answer 401/403 (a
        foreign origin: DNS rebinding) before anything runs: no episode reaches another's tools or model calls."""
        if isinstance(request.match_info.http_exception, web.HTTPNotFound):
            return await handler(request)
        origin = request.headers.get("Origin")
        if origin is not None and not _LOOPBACK.fullmatch(origin):
            self.refused += 1
            return web.json_response({"error": {"message": "forbidden origin"}}, status=403)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        seat = self.seats.get(token) if token else None
        if seat is None:
            self.refused += 1
            return web.json_response({"error": {"message": "unauthorized: unknown or expired episode token"}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        request[_SEAT] = seat
        task = asyncio.current_task()
        assert task is not None
        seat.live.add(task)
        try:
            return await handler(request)
        finally:
            seat.live.discard(task)

    async def _mcp(self, request: web.Request) -> web.StreamResponse:
        seat = request[_SEAT]
        try:
            message = await request.json()
        except ValueError:
            return web.json_response(_error(None, -32700, "parse error"), status=400)
        if not isinstance(message, dict):
            return web.json_response(_error(None, -32600, "one JSON-RPC request per POST"), status=400)
        id_, method, params = message.get("id"), message.get("method"), message.get("params")
        params = params if isinstance(params, dict) else {}
        if id_ is None:  # a notification (or a response): accepted
            return web.Response(status=202)
        if method == "initialize":
            asked = params.get("protocolVersion")
            result: dict[str, Any] = {"protocolVersion": asked if asked in MCP_VERSIONS else MCP_VERSIONS[0],
                                      "capabilities": {"tools": {"listChanged": False}},
                                      "serverInfo": {"name": "ors-trl", "version": "1"}}
        elif method == "ping":
            result = {}
        elif method == "tools/list":
            result = {"tools": _mcp_tools(seat.episode)}
        elif method == "tools/call":
            name, arguments = params.get("name"), params.get("arguments")
            if not isinstance(name, str):
                return web.json_response(_error(id_, -32602, "tools/call needs a tool name"))
            call = asyncio.ensure_future(seat.episode.call(ToolCall(name, {} if arguments is None else arguments)))
            seat.live.add(call)  # the episode's stop cancels it; a client that leaves does not: the environment runs it
            call.add_done_callback(seat.live.discard)
            outcome = await asyncio.shield(call)
            result = {"content": [{"type": "text", "text": outcome.text}], "isError": outcome.error is not None}
        else:
            return web.json_response(_error(id_, -32601, f"method not found: {method}"))
        return web.json_response({"jsonrpc": "2.0", "id": id_, "result": result})

    async def _model_call(self, read: Any, answer: Any, request: web.Request) -> web.StreamResponse:
        """One model call in a dialect: `read(body)` gives the chat messages and tools (or why not: a 400),
        `answer(model, reply, ids, finish, call)` the reply in the dialect."""
        seat: Seat = request[_SEAT]
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _bad("the request body must be a JSON object")
        stream = bool(body.get("stream"))
        if (stream and read is not _from_chat) or (body.get("n") or 1) != 1:
            return _bad("this endpoint answers one choice (n=1); streamed only for chat completions")
        read_out = read(body)
        if isinstance(read_out, str):
            return _bad(read_out)
        messages, tools = read_out
        model = str(body.get("model") or "policy")
        if seat.episode.over:  # the episode ended: the harness reads that, nothing is generated or recorded
            return await _send(request, answer(model, Reply(ENDED), [], "stop"), stream)
        conversation, joined = self._conversation(seat, messages, tools)
        try:
            reply = await seat.generator.reply(conversation)
        except (StopEpisode, ContextLengthExceeded) as stop:
            reason = stop.reason if isinstance(stop, StopEpisode) else "context_length"
            await seat.episode.end(reason, detail=str(stop))
            return await _send(request, answer(model, Reply(""), [], "length"), stream)
        except Exception as exc:  # a request the generator cannot take (a template that cannot render it, ...)
            logger.warning("%s: a harness model call failed: %s: %s", seat.episode.env.name, type(exc).__name__, exc)
            return _bad(f"the model call failed: {type(exc).__name__}: {exc}")
        call = ModelCall(len(seat.calls), [dict(m) for m in messages], reply, *_ids(conversation.state),
                         version=_version(seat.generator), joined=joined)
        if call.prompt_ids is not None:
            reply.usage = {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids or ())}
        seat.calls.append(call)
        ids = [f"call_{call.index}_{k}" for k in range(len(reply.tool_calls))]
        seat.names.update((i, c.name) for i, c in zip(ids, reply.tool_calls, strict=True))  # type: ignore[union-attr]
        seat.conversation, seat.shown = conversation, [*conversation.messages, assistant_message(reply, ids)]
        await seat.episode.observe(reply)
        finish = "tool_calls" if reply.tool_calls else "length" if reply.truncated else "stop"
        return await _send(request, answer(model, reply, ids, finish, call), stream)

    def _conversation(self, seat: Seat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                      ) -> tuple[Conversation, bool]:
        """The conversation a request continues (ours, when it sends back exactly what we had with tool results
        after it: a token generator joins the ids as GRPO builds them), or a new one, rendered afresh."""
        shown, tail = seat.shown, messages[len(seat.shown):]
        current = seat.conversation
        if (current is not None and shown and len(messages) > len(shown)
                and current.tools == tools
                and all(m.get("role") == "tool" for m in tail)
                and [_identity(m) for m in messages[: len(shown)]] == [_identity(m) for m in shown]):
            # taken until its reply is shown: a request racing this one (a retry), or one after it failed (its ids may
            # hold what it added: tool results, a reply nobody read), is rendered afresh instead of joining
            current.messages, seat.conversation = [*shown, *(_normal(m, seat.names) for m in tail)], None
            return current, True
        return Conversation(seat.episode, [_normal(m, seat.names) for m in messages], tools), False


def _is_message(message: Any) -> bool:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and (calls is None or (isinstance(calls, list) and all(isinstance(c, dict) for c in calls))))


def _normal(message: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A harness's chat message as ors-trl writes one (`ors_trl.core.conversation`): text content, calls with their
    arguments decoded, a tool result named after its call."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [ToolCall.of(c).chat(c.get("id")) for c in message["tool_calls"]]
    if out["role"] == "tool":
        out["name"] = message.get("name") or names.get(str(message.get("tool_call_id")), "")
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _from_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | str:
    """A chat completions request's messages and tools, or why it cannot be answered."""
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        return ("the request needs `messages`, a list of chat messages (each with a `role`; `tool_calls`, where "
                "given, a list of objects)")
    if not _texts(*(m.get("content") for m in messages)):
        return _TEXT_ONLY
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]  # as in `_from_responses`
    return messages, [t for t in tools if isinstance(t, dict)] or None if isinstance(tools, list) else None


def _from_responses(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | str:
    """A Responses request (`instructions`, `input` items, `tools`) as chat messages and tools, or why not."""
    if body.get("previous_response_id") or body.get("conversation"):
        return "this endpoint keeps no responses: send the whole input (no previous_response_id or conversation)"
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        return "the request needs `input`, a text or a list of input items"
    if not _texts(*(i.get("content") for i in items), *(i.get("output") for i in items)):
        return _TEXT_ONLY
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
        elif kind != "reasoning":
            return f"input items of type {kind!r} are not supported"
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    return messages, tools or None


def _ids(tokens: Any) -> tuple[Any, Any, Any]:
    """A token generator's ids of the call just answered: the prompt it was generated from, the trailing generated run
    of its `Tokens`, and that run's logprobs (Nones without a token generator)."""
    if tokens is None or not hasattr(tokens, "mask"):
        return None, None, None
    k = next((j for j, m in enumerate(reversed(tokens.mask)) if m != 1), len(tokens.mask))
    ids, logprobs = tokens.ids, tokens.logprobs
    return ids[: len(ids) - k], ids[len(ids) - k:], None if logprobs is None else list(logprobs[len(logprobs) - k:])


def _mcp_tools(episode: Episode) -> list[dict[str, Any]]:
    """The episode's tools as MCP lists them (the schemas the model sees; the terminal tool is never listed)."""
    functions = [s.get("function", s) for s in (episode.toolset.schemas if episode.toolset is not None else ())]
    return [{"name": f["name"], "description": f.get("description", ""),
             "inputSchema": f.get("parameters") or {"type": "object", "properties": {}}} for f in functions]


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "ors-trl"}]})


def _bad(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=400)


def _response(model: str, reply: Reply, ids: list[str], finish: str, call: ModelCall | None = None
              ) -> dict[str, Any]:
    """A reply as a Responses API response: a message item (where it has text), then a function call item per call."""
    output: list[dict[str, Any]] = []
    if reply.content:
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(8)}", "role": "assistant",
                       "status": "completed",
                       "content": [{"type": "output_text", "text": reply.content, "annotations": []}]})
    output += [{"type": "function_call", "id": f"fc_{i}", "call_id": i, "name": c.name, "status": "completed",
                "arguments": c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments)}
               for i, c in zip(ids, reply.tool_calls, strict=True)]  # type: ignore[union-attr]
    used = (len(call.prompt_ids), len(call.completion_ids or ())) if call and call.prompt_ids is not None else (0, 0)
    return {
        "id": f"resp_{secrets.token_hex(8)}", "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if finish == "length" else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": used[0], "output_tokens": used[1], "total_tokens": sum(used),
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def _completion(model: str, reply: Reply, ids: list[str], finish: str, call: ModelCall | None = None
                ) -> dict[str, Any]:
    """A chat completion in OpenAI's shape (the ids the call generated included, as vLLM returns them)."""
    message = openai_message({**assistant_message(reply, ids), "reasoning_content": None})  # its text and calls
    message["content"] = reply.content if reply.content or not ids else None
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    used = (len(call.prompt_ids), len(call.completion_ids or ())) if call and call.prompt_ids is not None else (0, 0)
    body: dict[str, Any] = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion",
                            "created": int(time.time()), "model": model, "choices": [choice],
                            "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)}}
    if call is not None and call.prompt_ids is not None:
        choice["token_ids"], body["prompt_token_ids"] = call.completion_ids, call.prompt_ids
    return body


async def _send(request: web.Request, body: dict[str, Any], stream: bool) -> web.StreamResponse:
    """A reply as JSON, or (`stream`) a chat completion replayed as server-sent chunks: the message, then the finish
    reason and usage, then `[DONE]` (generation is not streamed: the chunks follow it)."""
    if not stream:
        return web.json_response(body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    choice = body["choices"][0]
    delta = {k: v for k, v in choice["message"].items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for chunk in ({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": body["usage"]}):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
