"""The concurrent rollout engine (`spec.rollout_func`) against TRL's own `environment_factory` loop."""

from __future__ import annotations

import asyncio
import copy
import gc
import re
import types

import pytest

from ors_trl import OpenRewardSpec
from ors_trl.protocol.errors import ConfigurationError
from ors_trl.trl import backend as _trl
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    echo_generation,
    logged_metric,
    replace_generation,
    run_batch,
    tool_call_text,
    trl_tokenizer,
    work_turn_by_turn,
)

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")


def make_trainer(model_dir: str, spec, mode: str, tmp_path, **config):
    """The harness's CPU trainer on `spec`'s `mode` path, greedy; `config`: more `GRPOConfig` fields."""
    return cpu_grpo_trainer(model_dir, str(tmp_path / mode), spec=spec, mode=mode,
                            config={"generation_kwargs": {"do_sample": False}, **config})


_TARGET = re.compile(r'exactly this text: "([^"]+)"')


def batch_rows(spec, indices: list[int], generations: int) -> list[dict]:
    rows = spec.train_dataset
    return [copy.deepcopy(rows[i]) for i in indices for _ in range(generations)]


@pytest.fixture
def echo_spec(ref_server):
    # A gather window no rollout outlasts on any machine (a bound, never reached: generation starts as soon as no
    # rollout is busy): every rollout of a turn joins its generation call, so the batches (and with them the padded
    # greedy numerics) are TRL's own, turn by turn, however loaded the machine; the automatic window would not wait.
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", gather_window=300.0)
    yield spec
    spec.close()


def test_engine_matches_environment_factory_with_scripted_calls(tiny_model_dir, echo_spec, ref_server, tmp_path):
    env_trainer = make_trainer(tiny_model_dir, echo_spec, "env", tmp_path, per_device_train_batch_size=8)
    eng_trainer = make_trainer(tiny_model_dir, echo_spec, "engine", tmp_path, per_device_train_batch_size=8)
    env_calls: list[int] = []
    eng_calls: list[int] = []
    replace_generation(env_trainer, echo_generation(trl_tokenizer(env_trainer), env_calls))
    replace_generation(eng_trainer, echo_generation(trl_tokenizer(eng_trainer), eng_calls))
    targets = echo_spec.train_dataset["target"]
    picks = [targets.index("hello"), targets.index("world"), targets.index("trl"), targets.index("openreward")]
    rows = batch_rows(echo_spec, picks, 2)
    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    a = run_batch(env_trainer, rows)
    mid = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    b = run_batch(eng_trainer, rows)
    after = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)

    assert a["prompts"] == b["prompts"]
    assert a["completions"] == b["completions"]
    assert a["tool_mask"] == b["tool_mask"]
    assert a["rewards"] == b["rewards"]
    # hello: right first time; world: unknown tool, never scored; trl: right; openreward: wrong then right
    assert a["rewards"] == [1.0, 1.0, None, None, 1.0, 1.0, 1.0, 1.0]
    assert mid - before == after - mid == 10  # same remote calls in both paths (the unknown tool never reached it)
    assert env_calls == eng_calls  # the same generation batches, turn by turn
    assert any(0 in m for m in b["tool_mask"]) and all(m[0] == 1 for m in b["tool_mask"])
    stats = ref_server.stats()
    assert stats["open_sessions"] <= 8  # the env path keeps its last sessions until the next reset
    echo_spec.close()
    assert ref_server.stats()["open_sessions"] == 0


def test_engine_matches_environment_factory_greedy(tiny_model_dir, echo_spec, tmp_path):
    """Real greedy generation on the tiny model: the two paths produce the same tokens and rewards."""
    env_trainer = make_trainer(tiny_model_dir, echo_spec, "env", tmp_path, max_completion_length=48)
    eng_trainer = make_trainer(tiny_model_dir, echo_spec, "engine", tmp_path, max_completion_length=48)
    rows = batch_rows(echo_spec, [0, 1], 2)
    a = run_batch(env_trainer, rows)
    b = run_batch(eng_trainer, rows)
    assert a["prompts"] == b["prompts"]
    assert a["completions"] == b["completions"]
    assert a["rewards"] == b["rewards"]


def test_engine_runs_episodes_concurrently(tiny_model_dir, make_server, tmp_path):
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "0.5", "ORS_TEST_TOOL_LATENCY": "0.3"})
    spec = OpenRewardSpec(server.url, num_tasks=8)
    trainer = make_trainer(tiny_model_dir, spec, "engine", tmp_path, per_device_train_batch_size=8,
                           max_completion_length=256)
    replace_generation(trainer, work_turn_by_turn(trl_tokenizer(trainer), turns=3))
    rows = batch_rows(spec, [0, 1, 2, 3], 2)
    result = run_batch(trainer, rows)
    assert result["rewards"] == [1.0] * 8
    stats = server.stats()
    # all 8 sessions were set up at once, and every turn's 8 tool calls ran at once
    assert stats["peak_in_flight"]["slowenvironment/setup"] == 8
    assert stats["peak_in_flight"]["slowenvironment/work"] == 8
    assert stats["open_sessions"] == 0  # the engine closes its sessions when the episodes end
    assert stats["tool_calls"]["slowenvironment/work"] == 8 * 3


def test_engine_episode_timeout_scores_none(tiny_model_dir, make_server, tmp_path):
    server = make_server("slow")
    spec = OpenRewardSpec(server.url, num_tasks=2, episode_timeout=1.0)
    trainer = make_trainer(tiny_model_dir, spec, "engine", tmp_path)
    tok = trl_tokenizer(trainer)

    def generate(prompt_ids, images, mm, num_generations, has_tool_images=False):
        out = []
        for i, ids in enumerate(prompt_ids):
            seconds = 5 if i == 0 and "<tool_response>" not in tok.decode(ids) else 0
            body = (tool_call_text("sleep", {"seconds": seconds}) + "<|im_end|>"
                    if "<tool_response>" not in tok.decode(ids) else "Done.<|im_end|>")
            out.append(tok.encode(body, add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    result = run_batch(trainer, batch_rows(spec, [0, 1], 2))
    # the step did not wait for the straggler: its 5 s sleep is still running on the server
    assert server.stats()["done"].get("slowenvironment/sleep", 0) == 3
    episodes = spec.rollout_func.last_episodes
    assert [ep.end_reason == "timeout" for ep in episodes] == [True, False, False, False]
    assert result["rewards"] == [None] * 4  # sleep is unscored; the timed-out one is None too
    assert server.stats()["open_sessions"] == 0


def test_the_gather_window_waits_only_when_generating_costs_more() -> None:
    """The rule itself: the automatic window is capped at half of what a generation call takes (and at AUTO_WINDOW);
    a fixed one is kept; nobody waits when no one else can come."""
    from ors_trl.core.rollout import AUTO_WINDOW, Batcher

    auto, fixed = Batcher(), Batcher(5.0)
    assert auto.seconds == AUTO_WINDOW  # nothing measured yet: the cap
    auto.give([], [], seconds=0.02)
    assert auto.seconds == pytest.approx(0.01)  # cheap generation: hardly any wait
    for _ in range(30):
        auto.give([], [], seconds=10.0)
    assert auto.seconds == pytest.approx(AUTO_WINDOW)  # costly: the cap again
    fixed.give([], [], seconds=0.0)
    assert fixed.seconds == 5.0  # a fixed window is kept

    async def lone_request() -> list[int]:  # the only member asks: nobody else can come, so it goes at once
        fixed.enter()
        asked = asyncio.ensure_future(fixed.ask("x"))
        await asyncio.sleep(0)
        batch = await asyncio.to_thread(fixed.take)
        fixed.give(batch, [1])
        return [await asked]

    assert asyncio.run(lone_request()) == [1] and fixed.batch_sizes == [1]


@pytest.mark.parametrize(("window", "straggler_s", "calls"), [
    (None, 4.0, None),  # automatic, generating is cheap: the ready ones go on without the straggler
    (30.0, 1.0, [4, 4]),  # a fixed gather_window (longer than the straggler, however loaded the machine) is waited out
])
def test_engine_waits_for_company_only_when_generating_costs_more(tiny_model_dir, make_server, tmp_path,
                                                                  window, straggler_s, calls):
    """The schedule follows the rule: with the automatic window a cheap generator does not wait for a straggler's
    slow tool call; a fixed window waits for it."""
    server = make_server("slow")
    spec = OpenRewardSpec(server.url, num_tasks=2, gather_window=window)
    trainer = make_trainer(tiny_model_dir, spec, "engine", tmp_path)
    tok = trl_tokenizer(trainer)

    def generate(prompt_ids, images, mm, num_generations, has_tool_images=False):
        out = []
        for i, ids in enumerate(prompt_ids):
            first = "<tool_response>" not in tok.decode(ids)
            seconds = straggler_s if i == 0 and len(prompt_ids) == 4 else 0
            body = tool_call_text("sleep", {"seconds": seconds}) + "<|im_end|>" if first else "Done.<|im_end|>"
            out.append(tok.encode(body, add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    engine = spec.rollout_func
    before = len(engine.generation_calls)
    run_batch(trainer, batch_rows(spec, [0, 1], 2))
    made = engine.generation_calls[before:]
    if calls is None:  # the three without the straggler went on (together or not, as the machine's load allows)
        assert made[0] == 4 and made[-1] == 1 and sum(made) == 8
    else:
        assert made == calls
    assert server.stats()["done"].get("slowenvironment/sleep", 0) == 4
    assert server.stats()["open_sessions"] == 0


def test_gather_window_must_be_a_non_negative_number(ref_server) -> None:
    from ors_trl import ConfigurationError

    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigurationError, match="gather_window"):
            OpenRewardSpec(ref_server.url, env_name="echoenvironment", gather_window=bad)


def test_engine_failed_open_is_a_none_scored_rollout(tiny_model_dir, echo_spec, tmp_path):
    trainer = make_trainer(tiny_model_dir, echo_spec, "engine", tmp_path)
    replace_generation(trainer, echo_generation(trl_tokenizer(trainer)))
    rows = batch_rows(echo_spec, [0, 1], 2)
    rows[0]["prompt"][0]["ors_task"] = '{"env": null, "split": "train", "index": 999}'
    result = run_batch(trainer, rows)
    assert result["rewards"][0] is None  # unscored
    assert result["rewards"][1] == 1.0


def test_engine_session_cap_queues_in_waves(tiny_model_dir, make_server, tmp_path):
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "0.2"})
    spec = OpenRewardSpec(server.url, num_tasks=4, max_sessions=3)
    trainer = make_trainer(tiny_model_dir, spec, "engine", tmp_path, per_device_train_batch_size=8,
                           max_completion_length=256)
    replace_generation(trainer, work_turn_by_turn(trl_tokenizer(trainer), turns=3))
    result = run_batch(trainer, batch_rows(spec, [0, 1, 2, 3], 2))
    assert result["rewards"] == [1.0] * 8  # every episode ran, in waves of at most 3
    stats = server.stats()
    assert stats["peak_sessions"] <= 3
    assert stats["open_sessions"] == 0


def test_trl_loop_refuses_a_session_cap_below_its_batch(tiny_model_dir, make_server, tmp_path):
    """TRL's own loop holds every session of a batch open until the step ends, so a rollout past `max_sessions` could
    only wait for a slot that frees after its own step: a `ConfigurationError` at the batch's first reset, before any
    session opens, not a stall of `session_wait` (30 min; 5 s here) and rollouts that failed to start."""
    server = make_server("echo")
    spec = OpenRewardSpec(server.url, env_name="echoenvironment", num_tasks=2, max_sessions=3)
    object.__setattr__(spec.client.options, "session_wait", 5.0)  # bounds the wait the cap makes today
    trainer = make_trainer(tiny_model_dir, spec, "env", tmp_path, per_device_train_batch_size=4)
    opened = server.stats()["setups"]
    with pytest.raises(ConfigurationError, match="max_sessions=3"):
        run_batch(trainer, batch_rows(spec, [0, 1], 2))
    assert server.stats()["setups"] == opened  # no session was opened
    spec.close()


def test_a_generation_failure_mid_wave_reaches_the_step_and_closes_the_waves_sessions(tiny_model_dir, make_server,
                                                                                      tmp_path):
    """The generation backend raises on its second call, while the first wave's episodes wait for replies: the step
    gets the error, the wave's sessions are closed, and no later wave opens one."""
    server = make_server("slow")
    spec = OpenRewardSpec(server.url, num_tasks=4, max_sessions=3)
    trainer = make_trainer(tiny_model_dir, spec, "engine", tmp_path, per_device_train_batch_size=8,
                           max_completion_length=256)
    work = work_turn_by_turn(trl_tokenizer(trainer), turns=3)
    calls: list[int] = []

    def generate(prompt_ids, *args, **kwargs):
        calls.append(len(prompt_ids))
        if len(calls) == 2:
            raise RuntimeError("the generation backend died")
        return work(prompt_ids, *args, **kwargs)

    replace_generation(trainer, generate)
    try:
        with pytest.raises(RuntimeError, match="the generation backend died"):
            run_batch(trainer, batch_rows(spec, [0, 1, 2, 3], 2))
        assert len(calls) == 2  # nothing generated after the failure
        stats = server.wait_for_stats(lambda st: st["open_sessions"] == 0)
        assert stats["peak_sessions"] <= 3
    finally:
        spec.close()


def test_trl_loop_resets_open_the_whole_batch_at_once(tiny_model_dir, make_server, tmp_path):
    """Through TRL's own environment_factory loop: a batch of 4 distinct tasks pays about one setup, not four."""
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "0.6"})
    spec = OpenRewardSpec(server.url, num_tasks=4)
    trainer = make_trainer(tiny_model_dir, spec, "env", tmp_path, per_device_train_batch_size=8)
    tok = trl_tokenizer(trainer)
    replace_generation(trainer, lambda ids, *a, **k: ([tok.encode("Done.<|im_end|>", add_special_tokens=False)
                                                       for _ in ids], None))
    rows = batch_rows(spec, [0, 1, 2, 3], 2)
    run_batch(trainer, rows)
    stats = server.stats()
    assert stats["peak_in_flight"]["slowenvironment/setup"] == 8  # the whole batch was set up at once
    assert stats["setups"] == 8 + 1  # every rollout got its own session (+1 tool discovery probe)
    spec.close()
    assert server.stats()["open_sessions"] == 0


def _work_calls(trainer, steps: list[int]):
    """Scripted generation: the first turn calls `work` once per step in one message, then "Done."."""
    tok = trl_tokenizer(trainer)
    calls = "".join(tool_call_text("work", {"step": s}) for s in steps)

    def generate(prompt_ids, *args, **kwargs):
        return [tok.encode(("Done." if "<tool_response>" in tok.decode(ids) else calls) + "<|im_end|>",
                           add_special_tokens=False) for ids in prompt_ids], None

    return generate


@pytest.mark.parametrize("batched", [True, False])
def test_trl_loop_runs_a_turns_tool_calls_at_once(tiny_model_dir, make_server, tmp_path, batched, monkeypatch):
    """TRL's own tool loop calls rollouts one after another; with batch_tool_calls a turn's calls all start at once.

    Each rollout sends work(0), work(1), work(2) in one message: they must still run in order on its session,
    work(1) ends the episode, and work(2) is refused locally (never reaches the server) and counted as a failure.
    """
    server = make_server("slow", env={"ORS_TEST_TOOL_LATENCY": "0.2", "ORS_TEST_STEPS": "2"})
    spec = OpenRewardSpec(server.url, num_tasks=4, batch_tool_calls=batched)
    # a budget the three results fit in (TRL rolls back results that do not: the model never sees them, no reward)
    trainer = make_trainer(tiny_model_dir, spec, "env", tmp_path, per_device_train_batch_size=8,
                           max_completion_length=256)
    replace_generation(trainer, _work_calls(trainer, [0, 1, 2]))
    turns: list[object] = []
    tool_turn = _trl.tool_turn

    def seen_turn(adapter, skip=2, rest=True):
        seen = tool_turn(adapter, skip + 1, rest)
        if seen is not None and not any(t is seen[0] for t in turns):
            turns.append(seen[0])
        return seen

    monkeypatch.setattr(_trl, "tool_turn", seen_turn)
    result = run_batch(trainer, batch_rows(spec, [0, 1, 2, 3], 2))
    stats = server.stats()
    assert result["rewards"] == [1.0] * 8
    assert stats["tool_calls"]["slowenvironment/work"] == 16  # work(0) and work(1) of 8 rollouts, each once
    assert stats["peak_in_flight"]["slowenvironment/work"] == (8 if batched else 1)
    for env in trainer.environments:
        assert [m["step"] if m else None for m in env.metadata] == [0, 1, None]  # in order; the third refused
        assert env.rewards == [None, 1.0, None] and env.reward == 1.0 and env.finished
        assert env.tool_calls == 3 and env.tool_failures == 1
    assert logged_metric(trainer, "tools/failure_frequency")[-1] == pytest.approx(1 / 3)  # TRL saw the refusal
    assert spec._runtime.calls_ahead == (24 if batched else 0)
    if batched:  # TRL's turn lists (`tool_calls`) the calls were started from are not kept past the step's end
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)
        gc.collect()
        assert turns and not [r for t in turns for r in gc.get_referrers(t)
                              if r is not turns and not isinstance(r, types.FrameType)]
        turns.clear()
    # The next step (a new run of TRL's tool loop, whose frame and turn counter look like the last one's) too.
    assert run_batch(trainer, batch_rows(spec, [0, 1, 2, 3], 2))["rewards"] == [1.0] * 8
    assert server.stats()["tool_calls"]["slowenvironment/work"] == 32
    assert spec._runtime.calls_ahead == (48 if batched else 0)
    spec.close()
    assert server.stats()["open_sessions"] == 0


def test_engine_with_a_mix_routes_and_scores_each_environment(tiny_model_dir, ref_server, tmp_path):
    from ors_trl import OpenRewardMix

    mix = OpenRewardMix({
        "echo": OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2),
        "math": OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=2),
    })
    trainer = make_trainer(tiny_model_dir, mix, "engine", tmp_path, per_device_train_batch_size=8,
                           max_completion_length=128)
    tok = trl_tokenizer(trainer)

    def generate(prompt_ids, images, mm, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            if "<tool_response>" in text:
                body = "Done.<|im_end|>"
            elif (echo := _TARGET.findall(text)):
                body = tool_call_text("echo", {"text": echo[0]}) + "<|im_end|>"
            else:
                a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[0])
                body = tool_call_text("submit", {"answer": a + b}) + "<|im_end|>"
            out.append(tok.encode(body, add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    before = ref_server.stats()["tool_calls"]
    rows = [copy.deepcopy(r) for r in mix.train_dataset for _ in range(2)]
    result = run_batch(trainer, rows)
    assert result["rewards"] == [1.0] * 8
    after = ref_server.stats()["tool_calls"]
    assert after["echoenvironment/echo"] - before.get("echoenvironment/echo", 0) == 4
    assert after["sparseenvironment/submit"] - before.get("sparseenvironment/submit", 0) == 4
    # each environment's rows were rendered with its own tools only
    for row, prompt_ids in zip(rows, result["prompts"], strict=True):
        text = tok.decode(prompt_ids)
        assert ('"calculator"' in text) == (row["environment"] == "math")
    mix.close()
