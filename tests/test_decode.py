"""Issue 22: text a server sends that a tokenizer or a file cannot take (a lone surrogate) is repaired where it is
decoded, so a real `GRPOTrainer` step on such an environment completes with the right rewards.

The reference server's JSON encoders refuse lone surrogates (they cannot be UTF-8), so the fixture environment
``OddTextEnvironment`` writes ``LONE_MARK`` where it means one and a proxy in front of the server writes the JSON
escape ``\\ud800`` in its place: the answer a server encoding with ``ensure_ascii`` sends for terminal output
decoded with ``surrogateescape``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import pytest

from ors_trl import OpenRewardSpec
from ors_trl.testing import ReferenceServer
from ors_trl.testing.faults import Fault, FaultProxy
from tests.fixtures.environments import LONE_MARK, OddTextEnvironment
from tests.fixtures.generation import cpu_grpo_trainer, logged_rewards, replace_generation, tool_call_text

ODD = "oddtextenvironment"
_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})


class LoneSurrogates(Fault):
    """Forward, then write the JSON escape `\\ud800` (a lone surrogate) wherever the answer says `LONE_MARK`."""

    name = "lone_surrogates"

    async def handle(self, ex: Any) -> None:
        async with ex.upstream() as resp:
            body = (await resp.read()).replace(LONE_MARK.encode(), b"\\ud800")
            headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in _HOP]
            await ex.reply(resp.status, body, headers, content_type="")


@pytest.fixture
def odd_url():
    with ReferenceServer([OddTextEnvironment]) as server, FaultProxy(server.url) as proxy:
        proxy.add(LoneSurrogates(), times=None)
        yield proxy.url


def test_a_grpo_step_survives_a_lone_surrogate_in_the_prompt_and_the_tool_output(tiny_model_dir, odd_url,
                                                                                   tmp_path) -> None:
    """Bug: the prompt and the tool output reached TRL with the lone surrogate; the fast tokenizer raised on it and
    the training step died. Now the model sees U+FFFD there, the step completes, and `echo` scores 1.0 for the
    right word and 0.0 for a wrong one."""
    pytest.importorskip("trl")
    request = urllib.request.Request(f"{odd_url}/{ODD}/tasks", data=b'{"split": "train"}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert "\ud800" in json.loads(answer.read())["tasks"][0]["note"]  # what the client is sent: a lone surrogate
    spec = OpenRewardSpec(odd_url, env_name=ODD, num_tasks=2)
    dataset = spec.train_dataset
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=4, generations=2, turns=2, completion_length=64,
                               train_dataset=dataset, reward_funcs=spec.reward_funcs,
                               environment_factory=spec.environment_factory)
    tok = trainer.processing_class
    prompts: list[str] = []
    turn = iter(range(1000))

    def generate(prompt_ids, *args, **kwargs):  # first turn: echo the target (every other rollout: a wrong word)
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            prompts.append(text)
            if "<tool_response>" in text:
                body = "Done."
            else:
                target = re.findall(r'exactly this text: "(\w+)"', text)[0]
                body = tool_call_text("echo", {"text": target if next(turn) % 2 == 0 else "nope"})
            out.append(tok.encode(body + "<|im_end|>", add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    trainer.train()  # one step: generation, the environment's rewards, the loss, the optimizer
    rewards = [r for values in logged_rewards(trainer, 4).values() for r in values]
    spec.close()
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0], rewards
    assert any("Terminal said: \ufffd" in p for p in prompts)  # the prompt, repaired
    assert any("<tool_response>" in p and "\ufffd" in p.split("<tool_response>")[-1] for p in prompts)  # the output
    assert all("\ufffd" in note for note in dataset["note"])  # and the task fields
