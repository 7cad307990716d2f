"""Shared pytest fixtures: reference ORS servers on loopback (``ors_trl.testing``) with the suite's environments
(``tests.fixtures.environments``), and a leak check that fails the test that leaked, once, and cleans up."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

# The openreward SDK otherwise starts a version-check thread that tries the network.
os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"
# One torch thread: the reference servers run beside the tests, and oversubscribed cores make torch crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# The orphan registry (and a shared session pace) of the suite's processes, subprocesses included, in a folder of its
# own rather than the checkout's `.ors-trl`; removed when the suite ends.
if "ORS_TRL_STATE_DIR" not in os.environ:
    os.environ["ORS_TRL_STATE_DIR"] = tempfile.mkdtemp(prefix="ors-trl-state-")
    atexit.register(shutil.rmtree, os.environ["ORS_TRL_STATE_DIR"], ignore_errors=True)
# A suite started in the background (`make test &` from a script) inherits SIGINT ignored, and so would the
# subprocesses that tests interrupt with Ctrl-C (an ignored signal survives exec); restore Python's handling.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from ors_trl.testing import ReferenceServer
from tests.fixtures.environments import server as fixture_server


@pytest.fixture(scope="session")
def ref_server() -> Iterator[ReferenceServer]:
    """One reference server with every fixture environment, shared by the whole test session.

    Other tests use it too: compare counters before and after rather than assuming zeros.
    """
    with fixture_server("all") as server:
        yield server


def check_no_leaks(server: ReferenceServer, timeout: float = 10.0) -> None:
    """Fail (once) if `server` still holds sessions after `timeout` s; delete them first, so that the next test
    starts clean and a report names the test that leaked, not the ones after it."""
    try:
        server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=timeout)
    except TimeoutError:
        left = server.close_sessions()
        pytest.fail(f"{len(left)} session(s) left open on the server: {left[:5]}", pytrace=False)


@pytest.fixture(scope="session")
def colliding_server() -> Iterator[ReferenceServer]:
    """The environment whose task fields are named like TRL's keywords, beside the echo one (served apart from
    `ref_server`: its tasks do not follow the shared catalog's conventions)."""
    with fixture_server("colliding,echo") as server:
        yield server


@pytest.fixture
def no_leaked_sessions(ref_server: ReferenceServer) -> Iterator[None]:
    """Use in a test module (autouse) whose tests must leave the shared server without sessions."""
    yield
    check_no_leaks(ref_server)


MakeServer = Callable[..., ReferenceServer]


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """Factory for extra, private reference servers (fixture environments by short name), stopped at the end.

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
        server = fixture_server(envs, idle_timeout=idle_timeout, env=env, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield factory
    for server in reversed(servers):
        server.close()


@pytest.fixture(scope="session")
def tiny_model_dir(ref_server, tmp_path_factory) -> str:
    """The harness's tiny random Qwen3 model + BPE tokenizer (`tests.fixtures.generation.build_tiny_model`), built
    for the echo environment once per session. Untrained: well-formed token sequences, not sensible tool calls."""
    import inspect
    import random

    from ors_trl import OpenRewardSpec
    from tests.fixtures.generation import build_tiny_model

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    tools = [f for n, f in inspect.getmembers(spec.environment_factory, inspect.isfunction) if n == "echo"]
    tasks = spec.run(spec.client.tasks("train"))

    def prompt_fn(task):
        return f'Call the `echo` tool with exactly this text: "{task["target"]}". Do not add anything else.'

    def episode_fn(task, rng: random.Random):
        return "echo", {"text": rng.choice(tasks)["target"]}, "ok"

    # 2048 positions: room for multi-turn test episodes
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), tools, prompt_fn, episode_fn, tasks=tasks)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2-VL model, a BPE tokenizer with its image markers (TRL's qwen3_vl template) and its image
    processor (the PIL one), saved locally, built for the card environment (`CardEnvironment`);
    `tests.fixtures.vision.load_vision` (and `tests/fixtures/generation.cpu_grpo_trainer`) load it. Untrained, built once
    per session."""
    from ors_trl.demo import _model
    from tests.fixtures import vision
    from tests.fixtures.environments import CARD_SYSTEM, CARD_WORDS, CardEnvironment

    def schema(name: str, description: str, properties: dict) -> dict:
        return {"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": list(properties)}}}

    tools = [schema("look", "Look at your card.", {}),
             schema("say", "Say the word on your card.", {"text": {"type": "string", "description": "The word you read on your card."}})]
    prompt = [{"role": "system", "content": CARD_SYSTEM}, {"role": "user", "content": [
        {"type": "text", "text": "A sample card:\n"}, {"type": "image"}, {"type": "text", "text": "\nNow read yours."}]}]
    corpus = _model.render_corpus(CardEnvironment.list_tasks("train"), tools, lambda task: prompt,
                                  lambda task, rng: ("say", {"text": rng.choice(CARD_WORDS)}, "right"), copies=4,
                                  template=vision.vision_chat_template())
    tokenizer = _model.build_tokenizer(corpus, vocab_size=400, special=vision.VISION_TOKENS,
                                       template=vision.vision_chat_template())
    path = str(tmp_path_factory.mktemp("tiny-vlm"))
    vision.save_vision(path, vision.build_vision_model(tokenizer, seed=0), vision.build_vision_processor(tokenizer))
    return path
