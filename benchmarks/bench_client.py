"""Client latency and CPU: ors-trl vs the openreward SDK vs a bare keep-alive aiohttp loop (the floor).

One reference-server process (echo environment) on loopback; each client runs the same sequence
N times, one operation at a time: open a session and read its prompt, one tool call, close.
Prints per-operation medians, client CPU per operation, and the ratios

    ours / floor   (target: <= 1.3)
    ours / SDK     (target: <= 0.6)

Run: `.venv/bin/python benchmarks/bench_client.py [--iterations 200]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")

from ors_trl.testing.server import ReferenceServer  # noqa: E402

OPS = ("open+prompt", "tool call", "close")


class Timer:
    """Collects wall and process-CPU time per operation."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {op: [] for op in OPS}
        self.cpu: dict[str, list[float]] = {op: [] for op in OPS}

    def measure(self, op: str, fn: Callable[[], object]) -> object:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        self.wall[op].append(time.perf_counter() - t0)
        self.cpu[op].append(time.process_time() - c0)
        return out

    async def ameasure(self, op: str, coro) -> object:  # type: ignore[no-untyped-def]
        c0, t0 = time.process_time(), time.perf_counter()
        out = await coro
        self.wall[op].append(time.perf_counter() - t0)
        self.cpu[op].append(time.process_time() - c0)
        return out

    def medians(self) -> dict[str, tuple[float, float]]:
        return {op: (statistics.median(self.wall[op]), statistics.fmean(self.cpu[op])) for op in OPS}


def run_ours(url: str, n: int) -> Timer:
    from ors_trl import Client

    timer = Timer()
    client = Client(url, env_name="echoenvironment", keepalive_interval=None)
    client.num_tasks()  # resolve the environment and warm the connection pool
    for i in range(n):
        s = timer.measure("open+prompt", lambda i=i: _open_prompt(client, i))
        timer.measure("tool call", lambda s=s: s.call("echo", {"text": "nope"}))
        timer.measure("close", s.close)
    client.close()
    return timer


def _open_prompt(client, i: int):  # type: ignore[no-untyped-def]
    s = client.open_session(split="train", index=i % 16)
    s.prompt()
    return s


def run_sdk(url: str, n: int) -> Timer:
    os.environ["OPENREWARD_API_URL"] = url
    os.environ["OPENREWARD_SESSION_URL"] = url
    from openreward import OpenReward

    timer = Timer()
    env = OpenReward(api_key="unused", base_url=url).environments.get("echoenvironment")
    env.num_tasks("train")
    for i in range(n):
        cm = env.session(split="train", index=i % 16)

        def open_prompt(cm=cm):  # type: ignore[no-untyped-def]
            sess = cm.__enter__()
            sess.get_prompt()
            return sess

        sess = timer.measure("open+prompt", open_prompt)
        timer.measure("tool call", lambda sess=sess: sess.call_tool("echo", {"text": "nope"}))
        timer.measure("close", lambda cm=cm: cm.__exit__(None, None, None))
    return timer


async def _floor(url: str, n: int) -> Timer:
    """The protocol with nothing else: one keep-alive aiohttp session, minimal parsing."""
    import aiohttp

    timer = Timer()
    env = "/echoenvironment"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def open_prompt(i: int) -> str:
            async with http.post(url + "/create_session", data=b"{}") as r:
                body = await r.text()
            sid = body.split("data: ", 1)[1].split("\r\n", 1)[0].split("\n", 1)[0].strip()
            h = {"X-Session-ID": sid, "Content-Type": "application/json"}
            payload = json.dumps({"split": "train", "index": i % 16, "env_name": "echoenvironment"})
            async with http.post(url + "/create", data=payload, headers=h) as r:
                await r.read()
            async with http.get(url + env + "/prompt", headers=h) as r:
                await r.json()
            return sid

        async def call(sid: str) -> None:
            h = {"X-Session-ID": sid, "Content-Type": "application/json"}
            async with http.post(url + env + "/call", data=b'{"name":"echo","input":{"text":"nope"}}',
                                 headers=h) as r:
                await r.read()

        async def close(sid: str) -> None:
            h = {"X-Session-ID": sid}
            async with http.post(url + "/delete", headers=h) as r:
                await r.read()
            async with http.post(url + "/delete_session", headers=h) as r:
                await r.read()

        await (await http.get(url + "/health")).read()
        for i in range(n):
            sid = await timer.ameasure("open+prompt", open_prompt(i))
            await timer.ameasure("tool call", call(sid))
            await timer.ameasure("close", close(sid))
    return timer


def run_floor(url: str, n: int) -> Timer:
    return asyncio.run(_floor(url, n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    with ReferenceServer(envs="echo") as server:
        for name, fn in (("floor", run_floor), ("ors-trl", run_ours), ("sdk", run_sdk)):
            fn(server.url, 10)  # warm-up: imports, connections, server caches
            results[name] = fn(server.url, args.iterations).medians()
        leftover = server.stats()["open_sessions"]
    print(f"client latency, {args.iterations} iterations each, one reference-server process (echo)")
    print(f"{'operation':<12} {'floor ms':>9} {'ors-trl ms':>11} {'sdk ms':>8} {'ours/floor':>11} {'ours/sdk':>9}"
          f" {'cpu ours':>9} {'cpu sdk':>8}")
    summary = {}
    for op in OPS:
        f, o, s = results["floor"][op][0], results["ors-trl"][op][0], results["sdk"][op][0]
        co, cs = results["ors-trl"][op][1], results["sdk"][op][1]
        summary[op] = {"floor_ms": f * 1e3, "ours_ms": o * 1e3, "sdk_ms": s * 1e3, "ours_over_floor": o / f,
                       "ours_over_sdk": o / s, "cpu_ours_ms": co * 1e3, "cpu_sdk_ms": cs * 1e3}
        print(f"{op:<12} {f * 1e3:9.2f} {o * 1e3:11.2f} {s * 1e3:8.2f} {o / f:11.2f} {o / s:9.2f}"
              f" {co * 1e3:9.2f} {cs * 1e3:8.2f}")
    print(f"sessions left open on the server: {leftover}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
