"""Shared pytest fixtures: reference ORS servers on loopback (see ``ors_trl.testing``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

# The openreward SDK otherwise starts a version-check thread that tries the network.
os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"
# One torch thread: the reference servers run beside the tests, and oversubscribed cores make torch crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# A suite started in the background (`make test &` from a script) inherits SIGINT ignored, and so would the
# subprocesses that tests interrupt with Ctrl-C (an ignored signal survives exec); restore Python's handling.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from ors_trl.testing.server import ReferenceServer


@pytest.fixture(scope="session")
def ref_server() -> Iterator[ReferenceServer]:
    """One reference server with every fixture environment, shared by the whole test session.

    Other tests use it too: compare counters before and after rather than assuming zeros.
    """
    with ReferenceServer(envs="all") as server:
        yield server


MakeServer = Callable[..., ReferenceServer]


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """Factory for extra, private reference servers, stopped at the end of the test.

    ``make_server(envs="echo", idle_timeout=3, env={"ORS_TEST_TOOL_LATENCY": "0.2"})`` returns a
    started ``ReferenceServer``; keyword arguments are those of ``ReferenceServer``.
    """
    servers: list[ReferenceServer] = []

    def factory(
        envs: str | Sequence[str] = "all",
        *,
        idle_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> ReferenceServer:
        server = ReferenceServer(envs, idle_timeout=idle_timeout, env=env, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield factory
    for server in reversed(servers):
        server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(ref_server, tmp_path_factory) -> str:
    """A tiny random Qwen3 model + BPE tokenizer (TRL's qwen3 template) saved locally, built for the echo env.

    Untrained: it produces well-formed token sequences, not sensible tool calls. Built once per session.
    """
    import inspect
    import random

    from ors_trl import OpenRewardSpec
    from ors_trl.demo._model import build_model, build_tokenizer, render_corpus

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    tools = [f for n, f in inspect.getmembers(spec.environment_factory, inspect.isfunction) if n == "echo"]
    tasks = spec.run(spec.client.tasks("train"))

    def prompt_fn(task):
        return f'Call the `echo` tool with exactly this text: "{task["target"]}". Do not add anything else.'

    def episode_fn(task, rng: random.Random):
        return "echo", {"text": rng.choice(tasks)["target"]}, "ok"

    tokenizer = build_tokenizer(render_corpus(tasks, tools, prompt_fn, episode_fn, copies=4))
    model = build_model(tokenizer, seed=0, max_position_embeddings=2048)  # room for multi-turn test episodes
    tokenizer.model_max_length = 2048
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
