"""Opt-in upload of finished episodes to the OpenReward rollout viewer through the `openreward` SDK (which owns the
viewer's wire format). It never slows or fails a step: `submit` only queues (full: dropped, counted); worker threads
send; a failure is counted and logged once, the API key masked."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._version import __version__
from .errors import ConfigurationError
from .registry import RUN_ID
from .target import DEFAULT_PLATFORM_URL, resolve_target
from .text import readable, task_label
from .transport import Decoder

__all__ = ["RolloutUploader"]

logger = logging.getLogger("ors_trl")

#: A catalog-shaped name, only so that the platform's host and key resolve as for any catalog target.
_PLATFORM = "openreward/rollouts"


class RolloutUploader:
    """Send episode records to the OpenReward rollout viewer in the background. `api_key` defaults to
    `OPENREWARD_API_KEY`, `run_name` to `ors-trl-<run id>`; `run_info` (or a callable giving it, called when the first
    episode goes) holds the SDK's `RunInfo` fields; `step()` gives the training step of a record that does not say;
    past `max_pending` queued episodes more are dropped. `sent`, `failed` and `dropped` count the episodes."""

    def __init__(self, *, api_key: str | None = None, run_name: str | None = None,
                 run_info: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
                 step: Callable[[], int | None] | None = None, max_pending: int = 1024, workers: int = 2) -> None:
        target = resolve_target(_PLATFORM, api_key=api_key)
        self._url, self._key = target.api_url, str(target.api_key)
        self._mask = Decoder([self._key]).mask
        self.run_name = run_name or f"ors-trl-{RUN_ID}"
        self._run_info = run_info
        self._step = step
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(max(1, max_pending))
        self._workers = max(1, workers)
        self._threads: list[threading.Thread] = []
        self._api: Any = None
        self._lock = threading.Lock()
        self.sent = self.failed = self.dropped = 0
        self._warned = False

    def __repr__(self) -> str:  # never shows the key
        return f"RolloutUploader({self.run_name!r}, sent={self.sent}, failed={self.failed}, dropped={self.dropped})"

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}

    def submit(self, record: Mapping[str, Any]) -> None:
        """Queue one finished episode (any thread; never blocks, never raises)."""
        item = dict(record)
        if item.get("step") is None and self._step is not None:
            try:
                item["step"] = self._step()
            except Exception:  # the step is a nicety: the episode still goes
                item["step"] = None
        with self._lock:
            while len(self._threads) < self._workers:
                self._threads.append(thread := threading.Thread(target=self._work, name="ors-trl-upload", daemon=True))
                thread.start()
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                self._warn(f"the upload queue is full ({self._queue.maxsize} episodes); episodes are dropped")

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (at most `timeout` seconds), then flush and stop the SDK; `submit` starts it again."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        api, self._api = self._api, None
        if api is not None:
            api.shutdown_timeout = max(1.0, deadline - time.monotonic())
            try:
                api.close()
            except Exception as exc:
                self._warn(f"flushing the uploads failed: {type(exc).__name__}: {exc}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("rollout upload: %s (counted; later failures are only counted)",
                           readable(self._mask(message)))

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                self._send(record)
            except Exception as exc:  # never into training: counted, said once
                with self._lock:
                    self.failed += 1
                self._warn(f"an episode could not be uploaded: {type(exc).__name__}: {exc}")
            else:
                with self._lock:
                    self.sent += 1

    def _rollouts(self) -> Any:
        with self._lock:
            if self._api is None:
                try:
                    from openreward.api.rollouts import RolloutAPI
                    from openreward.models import RunInfo, SendLoopConfig
                except ImportError as exc:
                    raise ConfigurationError(f"uploads need the openreward package ({exc}): pip install openreward"
                                             ) from None

                info = self._run_info() if callable(self._run_info) else dict(self._run_info or {})
                info = {**info, "framework": "ors-trl", "framework_version": __version__}
                info.setdefault("model_name", "unknown")
                known = {f.name for f in dataclasses.fields(RunInfo)}
                config = SendLoopConfig(
                    max_items=128, max_bytes=4_000_000, max_age=1.0, jitter=0.05, ring_capacity=10_000,
                    max_batch_items=128, max_batch_bytes=1_000_000, max_retries=4, backoff_base=0.5,
                    backoff_factor=2.0, backoff_cap=30.0, max_upload_concurrency=8, api_key=self._key,
                    base_url=self._url)
                self._api = RolloutAPI(send_loop_config=config, run_info=RunInfo(**{
                    k: v for k, v in info.items() if k in known and v is not None}),
                    web_base_url=os.environ.get("OPENREWARD_URL") or DEFAULT_PLATFORM_URL)
            return self._api

    def _send(self, record: dict[str, Any]) -> None:
        from openreward.api.rollouts.serializers.base import (
            AssistantMessage,
            SystemMessage,
            ToolCall,
            ToolResult,
            UserMessage,
        )
        from openreward.models import RolloutInfo

        shown = {k: record.get(k) for k in ("run", "source", "policy", "repeat", "step", "end_reason", "unscored",
                                            "reward", "tool_calls", "tool_failures")}
        target = str(record.get("target") or "")
        rollout = self._rollouts().create(
            run_name=self.run_name, rollout_name=f"{record.get('environment')} {task_label(record)}",
            environment=target if "/" in target and "://" not in target else record.get("environment"),
            split=record.get("split"), task_spec=record.get("task_spec"),
            metadata={k: v for k, v in shown.items() if v is not None})
        if getattr(rollout, "_rollouts_disabled", False):  # the SDK's only sign that the platform refused it
            raise RuntimeError(f"the platform at {self._url} did not accept the rollout")
        events: list[tuple[Any, dict[str, Any]]] = []
        if record.get("system"):
            events.append((SystemMessage(content=str(record["system"])), {}))
        events.append((UserMessage(content=str(record.get("prompt") or "")), {}))
        for t, turn in enumerate(record.get("turns") or []):
            if turn.get("assistant"):
                events.append((AssistantMessage(content=str(turn["assistant"])), {}))
            for k, call in enumerate(turn.get("tool_calls") or []):
                call_id = str(call.get("id") or f"call_{t}_{k}")
                events.append((ToolCall(name=str(call.get("name")), content=json.dumps(call.get("arguments"),
                                                                                    default=str), call_id=call_id), {}))
                events.append((ToolResult(content=str(call.get("output") or call.get("status") or ""),
                                          call_id=call_id), {"reward": call.get("reward"),
                                                             "is_finished": call.get("finished") is True}))
        final = record.get("final") or {}
        if final.get("tool"):
            events.append((ToolCall(name=str(final["tool"]), content=json.dumps({"message": final.get("message")}),
                                    call_id="final"), {}))
            events.append((ToolResult(content=str(final.get("output") or ""), call_id="final"), {}))
        events[-1][1].update(reward=record.get("reward"), is_finished=True)
        index = record.get("task_index")
        if isinstance(index, int):
            seconds = (record.get("timings") or {}).get("total")
            events[0][1]["rollout_info"] = RolloutInfo(
                task_index=index, current_step=record.get("step"), harness="ors-trl",
                duration_ms=int(seconds * 1000) if isinstance(seconds, int | float) else None)
        for message, extra in events:
            rollout.log(message, **extra)

