"""Per-turn credit (`OpenRewardSpec(credit="turn")`, `ors_trl.trl.credit`) on the long-horizon corridor.

A scripted model walks a 4-room corridor (0.1 per room, 1.0 at the exit, 0.0 for a wrong word) through TRL's own loop
and the engine; the per-token advantages GRPO trains on are checked against the group-normalised reward-to-go of each
turn, computed here from the episodes' calls alone.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from ors_trl import OpenRewardSpec
from ors_trl.demo._environments import CORRIDOR_SIZE_ENV, CorridorEnvironment
from ors_trl.protocol.errors import ConfigurationError
from ors_trl.testing import ReferenceServer
from ors_trl.trl import credit
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    generate_and_score,
    replace_generation,
    tool_call_text,
    trl_tokenizer,
)

CORRIDOR = "corridorenvironment"
ROOMS = 4
GROUP = 4
TURNS = 6  # tool turns TRL allows: a rollout with three wrong words is cut at max_turns

@pytest.fixture(scope="module")
def corridor() -> Iterator[ReferenceServer]:
    from tests.conftest import check_no_leaks

    with ReferenceServer([CorridorEnvironment], env={CORRIDOR_SIZE_ENV: str(ROOMS)}) as server:
        yield server
        check_no_leaks(server)


def walker(tokenizer: Any) -> Any:
    """A scripted model for the corridor: it opens the door with the word it was last shown, but the n-th time it
    sees the very same conversation it says "nope" when n is odd (so a group's identical rollouts part ways whatever
    order they are generated in); "Done." once out."""
    seen: Counter[str] = Counter()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)

    def generate(prompt_ids, images=None, multimodal_fields=None, num_generations=1, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = tokenizer.decode(ids)
            n, seen[text] = seen[text], seen[text] + 1
            if "out of the corridor" in text.rsplit("<tool_response>", 1)[-1]:
                out.append(encode("Done."))
                continue
            word = re.findall(r"says: (\w+)\.", text)[-1]
            out.append(encode(tool_call_text("open_door", {"word": "nope" if n % 2 else word})))
        return out, None

    return generate


def make_spec(url: str, credit_: str) -> OpenRewardSpec:
    return OpenRewardSpec(url, env_name=CORRIDOR, num_tasks=2, reward="sum", credit=credit_, gather_window=0.0)


def step(model_dir: str, spec: OpenRewardSpec, mode: str, tmp_path: Any) -> tuple[dict[str, Any], list[Any]]:
    """One generate-and-score of a batch (two tasks, a group of `GROUP` each) with the walker: TRL's batch and the
    episodes in its rows' order."""
    trainer = cpu_grpo_trainer(model_dir, str(tmp_path / mode), batch=2 * GROUP, generations=GROUP, turns=TURNS,
                               completion_length=1536, spec=spec, mode=mode)
    replace_generation(trainer, walker(trl_tokenizer(trainer)))
    rows = [dict(row) for row in spec.train_dataset for _ in range(GROUP)]
    out = generate_and_score(trainer, rows)
    episodes = ([env.episode for env in trainer.environments] if mode == "env"
                else spec.rollout_func.last_episodes)
    return out, episodes


def std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def expected(episodes: list[Any]) -> tuple[list[float], list[list[float]]]:
    """From the episodes' calls alone: GRPO's advantage per rollout (its summed reward against its group's), and per
    turn the mean of it and the turn's reward-to-go against the group's rollouts at the same turn."""
    togo = []
    for ep in episodes:
        calls = [[c.get("reward") for c in t["tool_calls"] if c.get("status") != "not_run"] for t in ep.turns]
        togo.append([sum(r or 0.0 for later in calls[t:] for r in later) for t in range(len(calls))])
    episode, turn = [], []
    for g in range(0, len(episodes), GROUP):
        rows = togo[g:g + GROUP]
        totals = [r[0] for r in rows]
        episode += [(x - sum(totals) / GROUP) / (std(totals) + 1e-4) for x in totals]
        base = [sum(r[t] for r in rows if len(r) > t) / sum(len(r) > t for r in rows) for t in range(max(map(len, rows)))]
        residuals = [[x - base[t] for t, x in enumerate(r)] for r in rows]
        scale = std([x for r in residuals for x in r])
        turn += [[(episode[g + i] + x / (scale + 1e-4)) / 2 for x in r] for i, r in enumerate(residuals)]
    return episode, turn


@pytest.mark.parametrize("mode", ["env", "engine"])
def test_each_turn_trains_on_its_group_normalised_return(tiny_model_dir, corridor, tmp_path, mode) -> None:
    """Every generated token of turn t carries the mean of the rollout's GRPO advantage and turn t's reward-to-go
    normalised in its group (baseline: the group's rollouts at turn t); tool-result tokens carry 0."""
    spec = make_spec(corridor.url, "turn")
    try:
        out, episodes = step(tiny_model_dir, spec, mode, tmp_path)
    finally:
        spec.close()
    assert all(ep.reward is not None and len(ep.turns) >= 2 for ep in episodes)
    assert {ep.end_reason for ep in episodes} >= {"finished"}
    _, turn = expected(episodes)
    advantages = out["advantages"]
    assert advantages.dim() == 2 and advantages.shape == out["completion_ids"].shape
    varied = 0
    for i, ep in enumerate(episodes):
        kept = out["completion_mask"][i].bool()
        mask, adv = out["tool_mask"][i][kept].tolist(), advantages[i][kept].tolist()
        spans = credit.turn_spans(mask)
        assert len(spans) == len(ep.turns), (i, spans, len(ep.turns))
        want = [0.0] * len(mask)
        for (a, b), value in zip(spans, turn[i], strict=True):
            want[a:b] = [value] * (b - a)
        assert adv == pytest.approx(want, abs=1e-5), i
        assert all(a == 0.0 for a, m in zip(adv, mask, strict=True) if not m)  # tool results: no credit
        varied += len({round(v, 5) for v in turn[i]}) > 1
    assert varied >= 2  # the turns of a rollout are told apart, not one advantage broadcast


def test_episode_credit_keeps_trl_advantages(tiny_model_dir, corridor, tmp_path) -> None:
    """`credit="episode"` (the default) trains on TRL's one advantage per rollout, with the credit hook installed."""
    credit.install()
    spec = make_spec(corridor.url, "episode")
    try:
        out, episodes = step(tiny_model_dir, spec, "env", tmp_path)
    finally:
        spec.close()
    episode, _ = expected(episodes)
    assert out["advantages"].dim() == 1
    assert out["advantages"].tolist() == pytest.approx(episode, abs=1e-5)


def test_a_real_grpo_step_trains_with_turn_credit(tiny_model_dir, corridor, tmp_path) -> None:
    """A full `trainer.train()` step (loss and optimizer) with the tiny model and per-token advantages."""
    import torch

    spec = make_spec(corridor.url, "turn")
    try:
        trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path / "train"), batch=2 * GROUP, generations=GROUP,
                                   turns=TURNS, completion_length=1536, spec=spec, mode="engine")
        replace_generation(trainer, walker(trl_tokenizer(trainer)))
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
    finally:
        spec.close()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert trainer.state.global_step == 1 and math.isfinite(logs["loss"])
    assert logs["credit/turns"] > 2 and logs["credit/unmatched"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_turn_credit_where_no_turns_can_be_read_is_a_configuration_error(corridor) -> None:
    """Outside GRPOTrainer's hooked scoring (TRL's async trainer, a trainer that scores its own way), the reward
    function refuses: the per-turn credit asked for would silently not happen."""
    turn, episode = make_spec(corridor.url, "turn"), make_spec(corridor.url, "episode")
    try:
        with pytest.raises(ConfigurationError, match="credit='turn'"):
            turn.reward_funcs(ors_reward=[0.3], ors_env=[turn.runtime.key])
        assert episode.reward_funcs(ors_reward=[0.3], ors_env=[episode.runtime.key]) == [0.3]
    finally:
        turn.close()
        episode.close()


def test_a_lone_survivor_turn_and_an_unscored_rollout() -> None:
    """A turn index only one rollout reached gets no baseline of its own (advantage 0 from the turn term); a rollout
    without returns has none; scale "none" leaves the residuals as they are."""
    rows = credit.group_turn_advantages([[1.0, 0.5], [0.0], None, [1.0]], group=4, scale="none")
    assert rows == [[pytest.approx(1 / 3), 0.0], [pytest.approx(-2 / 3)], None, [pytest.approx(1 / 3)]]
    assert json.dumps(credit.turn_spans([1, 1, 0, 0, 1, 0, 1])) == "[[0, 2], [4, 5], [6, 7]]"


def test_a_callable_reward_rule_gets_the_episode_in_turn_returns(corridor) -> None:
    """A callable rule is documented as `f(rewards, episode)`: the per-turn returns credit trains on hand it the
    episode too, not None (a rule reading `episode.finished` crashed the training step)."""
    given: list[Any] = []

    def rule(rewards: list[float | None], episode: Any) -> float:
        given.append(episode)
        return sum(r or 0.0 for r in rewards) + (1.0 if episode.finished else 0.0)

    spec = OpenRewardSpec(corridor.url, env_name=CORRIDOR, num_tasks=1, reward=rule, credit="turn")
    try:
        env = spec.environment_factory()
        text = env.reset(**spec.train_dataset[0])
        for _ in range(2):
            text = env.open_door(word=re.findall(r"says: (\w+)\.", text)[-1])
        ep = env.episode
        assert ep.turn_returns() == [pytest.approx(0.2)]  # one turn (no reply between the calls): both rewards to go
    finally:
        spec.close()
    assert given and all(e is ep for e in given)
