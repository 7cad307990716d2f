"""One turn rule: a scripted model whose every step is known, played through TRL's own loop (the adapter), the
engine (`rollout_func`) and evaluation, gives the same records and the same counts on every path."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ors_trl import EvalReport, OpenRewardSpec, PolicyReply
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    generate_and_score,
    replace_generation,
    tool_call_text,
    trl_tokenizer,
)

pytest.importorskip("trl")

ECHO = "echoenvironment"
# What the scripted model replies, per task target and reply number: a list of calls, or a plain text (a text ending
# in "..." is cut off: no end-of-sequence token, as when the length limit stops a reply).
SCRIPT: dict[str, list[Any]] = {
    "hello": [[("echo", {"text": "hello"}), ("echo", {"text": "again"})], "Done."],  # right, then a call after finished
    "world": [[("no_such_tool", {"text": "world"})], [("echo", {"text": "nope"})], "Done."],  # unknown tool, wrong call
    "trl": ["No."],  # a reply with no call
    "openreward": [[("echo", {"txt": "openreward"})], "Done..."],  # arguments the server refuses, then a cut-off reply
    "spec": [[("echo", {"text": "a"})], [("echo", {"text": "b"})], [("echo", {"text": "c"})]],  # past the turn limit
    "factory": ['<tool_call>\n{"name": "echo", "arguments": {"text": "factory"}\n</tool_call>'],  # markup, no call
}
TARGETS = list(SCRIPT)
ITERATIONS = 2  # TRL's max_tool_calling_iterations: three replies, the last one's calls are not run


def scripted_ids(tok: Any, step: Any) -> list[int]:
    if isinstance(step, str):
        cut = step.endswith("...")
        return tok.encode(step[:-3] if cut else step + "<|im_end|>", add_special_tokens=False)
    text = "\n".join(tool_call_text(name, args) for name, args in step)
    return tok.encode(text + "<|im_end|>", add_special_tokens=False)


def target_of(text: str) -> str:
    return next(t for t in TARGETS if f'"{t}"' in text)


def script_step(tok: Any, ids: list[int]) -> list[int]:
    """The script's reply to a generation input: by its task's target and the replies it already holds."""
    text = tok.decode(ids)
    return scripted_ids(tok, SCRIPT[target_of(text)][text.count("<|im_start|>assistant") - 1])  # the prompt opens one


def scripted_generation(trainer: Any, inputs: list[list[int]] | None = None):
    tok = trl_tokenizer(trainer)

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if inputs is not None:
            inputs.extend(list(ids) for ids in prompt_ids)
        return [script_step(tok, list(ids)) for ids in prompt_ids], None

    return generate


class ScriptModel:
    """The script as a causal LM for `LocalPolicy`: it generates the script's ids from each (left-padded) input and
    keeps every input."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import PretrainedConfig

        self.tokenizer, self.config, self.device = tokenizer, PretrainedConfig(max_position_embeddings=4096), "cpu"
        self.inputs: list[list[int]] = []

    def generate(self, input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
        import torch

        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            self.inputs.append([i for i, m in zip(ids, mask, strict=True) if m])
            rows.append(ids + script_step(self.tokenizer, self.inputs[-1]))
        width, pad = max(map(len, rows)), self.tokenizer.pad_token_id
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


class ScriptedPolicy:
    """The same script as a `Policy` for evaluation; its tool-call markup is the chat template's (qwen3)."""

    tool_markup = "<tool_call>"

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        step = SCRIPT[target_of(messages[0]["content"])][sum(m["role"] == "assistant" for m in messages)]
        if isinstance(step, str):
            cut = step.endswith("...")
            return PolicyReply(content=step[:-3] if cut else step, truncated=cut)
        return PolicyReply(content="", tool_calls=[{"name": n, "arguments": a} for n, a in step])


def make_trainer(model_dir: str, spec: OpenRewardSpec, mode: str, tmp_path: Any, logged: dict[str, float],
                 inputs: list[list[int]] | None = None) -> Any:
    def outcome_reward(**kwargs: Any) -> list[float | None]:  # the spec's, with what it logs kept
        return spec.reward_funcs(**{**kwargs, "log_metric": logged.__setitem__})

    trainer = cpu_grpo_trainer(model_dir, str(tmp_path / mode), batch=len(TARGETS) * 2, generations=2,
                               turns=ITERATIONS, completion_length=256, spec=spec, mode=mode,
                               reward_funcs=outcome_reward)
    replace_generation(trainer, scripted_generation(trainer, inputs))
    return trainer


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    """A record without what differs by driver or by clock: timings, ids, the driver's name and run."""
    out = {k: v for k, v in record.items()
           if k not in ("run", "source", "started_at", "timings", "repeat", "policy", "tokens")}
    out["turns"] = [{**{k: v for k, v in t.items() if k not in ("generation_seconds", "raw", "usage")},
                     "tool_calls": [{k: v for k, v in c.items() if k not in ("seconds", "id")} for c in t["tool_calls"]]}
                    for t in record["turns"]]
    if out.get("final"):
        out["final"] = {k: v for k, v in out["final"].items() if k != "seconds"}
    return out


def play_every_path(model_dir: str, url: str, tmp_path: Any, **options: Any
                    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, float]], EvalReport]:
    """The script played through TRL's loop (`env`), the engine and eval, each with its own spec (`options`): each
    path's records (one per task), the metrics the trainer paths logged (two rollouts per task) and eval's report.
    Every session is closed after."""
    specs = {mode: OpenRewardSpec(url, env_name=ECHO, num_tasks=len(TARGETS), gather_window=0.0, **options)
             for mode in ("env", "engine", "eval")}
    records: dict[str, list[dict[str, Any]]] = {}
    metrics: dict[str, dict[str, float]] = {}
    try:
        rows = [copy.deepcopy(row) for row in specs["env"].train_dataset for _ in range(2)]
        assert [r["target"] for r in rows[::2]] == TARGETS
        for mode in ("env", "engine"):
            metrics[mode] = {}
            trainer = make_trainer(model_dir, specs[mode], mode, tmp_path, metrics[mode])
            generate_and_score(trainer, rows)
            episodes = ([env.episode for env in trainer.environments] if mode == "env"
                        else specs[mode].rollout_func.last_episodes)
            records[mode] = [ep.record() for ep in episodes][::2]
        report = specs["eval"].evaluate(ScriptedPolicy(), max_turns=ITERATIONS + 1, progress=False)
        records["eval"] = report.episodes
    finally:
        for spec in specs.values():
            spec.close()
    return records, metrics, report


def assert_eval_counts_as_training(report: EvalReport, metrics: dict[str, float]) -> None:
    """Eval's report counts the script (one episode per task) as the engine's metrics do (two rollouts per task)."""
    m = {k.removeprefix(f"env/{ECHO}/"): v for k, v in metrics.items()}
    n = report.num_episodes
    assert m["episodes"] == 2 * n == 2 * len(TARGETS)
    assert (m["tool_calls"], m["malformed_calls"]) == (2 * n * report.tool_calls_per_episode, 2 * report.malformed_calls)
    assert sum(v for k, v in m.items() if k.startswith("failures/")) == 2 * n * report.tool_failures_per_episode
    assert m["unscored/error"] == 2 * report.num_errors
    assert m["unscored/no_reward"] + m["unscored/cut_off"] + m["unscored/error"] + m["unscored/timeout"] \
        == 2 * (n - report.num_scored)
    for metric, value in (("reward_mean", report.mean_reward), ("graded_fraction", report.coverage),
                          ("success_rate", report.success_rate), ("finished_fraction", report.finished_rate),
                          ("tool_calls_per_episode", report.tool_calls_per_episode),
                          ("no_tool_call_fraction", report.no_tool_call_rate),
                          ("unparsed_turn_fraction", report.unparsed_turn_rate)):
        assert m[metric] == pytest.approx(value), metric


def test_every_driver_plays_and_records_a_turn_the_same_way(tiny_model_dir, ref_server, tmp_path) -> None:
    records, metrics, report = play_every_path(tiny_model_dir, ref_server.url, tmp_path)
    by_target = {mode: {r["prompt"]: comparable(r) for r in recs} for mode, recs in records.items()}
    for prompt in by_target["env"]:
        assert by_target["env"][prompt] == by_target["engine"][prompt], prompt
        assert by_target["eval"][prompt] == by_target["engine"][prompt], prompt
    fidelity = {mode: {r["prompt"]: r.get("tokens") for r in records[mode]} for mode in ("env", "engine")}
    assert fidelity["env"] == fidelity["engine"]  # both training paths: the generated ids, exactly
    assert all(t["exact"] and t["masked"] == 0 and t["generated"] > 0 for t in fidelity["env"].values())
    summary = {comparable(r)["prompt"].split('"')[1]: (r["end_reason"], r["reward"], r["tool_calls"], r["tool_failures"],
                                                     [[c["status"] for c in t["tool_calls"]] for t in r["turns"]])
               for r in records["eval"]}
    assert summary == {
        "hello": ("finished", 1.0, 2, 1, [["ok", "refused"], []]),
        "world": ("no_tool_calls", 0.0, 2, 1, [["refused"], ["ok"], []]),
        "trl": ("no_tool_calls", None, 0, 0, [[]]),
        "openreward": ("length", None, 1, 1, [["refused"], []]),
        "spec": ("max_turns", 0.0, 2, 0, [["ok"], ["ok"], ["not_run"]]),
        "factory": ("no_tool_calls", None, 0, 0, [[]]),
    }
    for mode in by_target:  # the markup that parsed to no call is marked on every path
        assert [r["turns"][0].get("unparsed") for r in records[mode] if "factory" in r["prompt"]] == [True], mode
    assert report.unparsed_turn_rate == pytest.approx(1 / 12)  # of 2 + 3 + 1 + 2 + 3 + 1 turns
    after = next(c for r in records["eval"] if "hello" in r["prompt"] for c in r["turns"][0]["tool_calls"][1:])
    assert after["error"]["reason"] == "episode_finished" and "finished" in after["output"]
    for key in ("tool_calls", "failures/refused", "failures/failed", "episodes", "tool_calls_per_episode",
                "unscored/no_reward"):
        assert metrics["env"][f"env/{ECHO}/{key}"] == metrics["engine"][f"env/{ECHO}/{key}"], key
    assert_eval_counts_as_training(report, metrics["engine"])
    assert ref_server.stats()["open_sessions"] == 0


@pytest.mark.parametrize("batch_tool_calls", [True, False])
def test_max_tool_calls_refuses_the_same_calls_on_every_path(tiny_model_dir, ref_server, tmp_path,
                                                             batch_tool_calls) -> None:
    """`max_tool_calls=1`: the model's second call (counting one TRL failed itself, an unknown tool) is refused
    locally with reason `max_tool_calls`, recorded and counted the same in TRL's loop (its calls started ahead
    across the batch, or one by one), the engine and eval."""
    records, metrics, report = play_every_path(tiny_model_dir, ref_server.url, tmp_path, max_tool_calls=1,
                                               batch_tool_calls=batch_tool_calls)
    assert ref_server.stats()["open_sessions"] == 0
    by_target = {mode: {r["prompt"]: comparable(r) for r in recs} for mode, recs in records.items()}
    for prompt in by_target["env"]:
        assert by_target["env"][prompt] == by_target["engine"][prompt] == by_target["eval"][prompt], prompt
    summary = {r["prompt"].split('"')[1]: (r["end_reason"], r["reward"], r["tool_calls"], r["tool_failures"],
                                          [[c.get("error", {}).get("reason") or c["status"] for c in t["tool_calls"]]
                                           for t in r["turns"]])
               for r in records["eval"]}
    assert summary == {
        "hello": ("finished", 1.0, 2, 1, [["ok", "episode_finished"], []]),  # finished is said first
        "world": ("no_tool_calls", None, 2, 2, [["not_found"], ["max_tool_calls"], []]),
        "trl": ("no_tool_calls", None, 0, 0, [[]]),
        "openreward": ("length", None, 1, 1, [["input_validation"], []]),
        "spec": ("max_turns", 0.0, 2, 1, [["ok"], ["max_tool_calls"], ["not_run"]]),
        "factory": ("no_tool_calls", None, 0, 0, [[]]),
    }
    refused = next(c for r in records["eval"] if "spec" in r["prompt"] for c in r["turns"][1]["tool_calls"])
    assert "at most 1 tool calls" in refused["output"]  # what the model reads
    for key in ("tool_calls", "failures/refused", "episodes", "tool_calls_per_episode"):
        assert metrics["env"][f"env/{ECHO}/{key}"] == metrics["engine"][f"env/{ECHO}/{key}"], key
    assert_eval_counts_as_training(report, metrics["engine"])
    for mode in ("env", "engine"):  # the cost of the step, logged with it
        assert metrics[mode][f"env/{ECHO}/sessions_opened"] == 2 * len(TARGETS), mode
        assert 0 < metrics[mode][f"env/{ECHO}/session_seconds_unscored"] < metrics[mode][f"env/{ECHO}/session_seconds"]


def test_training_and_evaluation_build_the_same_ids(tiny_model_dir, ref_server, tmp_path) -> None:
    """One construction of each turn's ids: the script played through TRL's loop (`environment_factory`), the engine
    and evaluation with a local model (`LocalPolicy`) gives the model the very same input ids at every turn, and the
    same records. (The demo used to check this at run time, for the turn after a tool call.)"""
    from transformers import AutoTokenizer

    from ors_trl import LocalPolicy

    specs = {mode: OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=len(TARGETS), gather_window=0.0)
             for mode in ("env", "engine", "eval")}
    inputs: dict[str, list[list[int]]] = {"env": [], "engine": []}
    records = {}
    try:
        rows = [copy.deepcopy(row) for row in specs["env"].train_dataset for _ in range(2)]
        for mode in ("env", "engine"):
            trainer = make_trainer(tiny_model_dir, specs[mode], mode, tmp_path, {}, inputs[mode])
            generate_and_score(trainer, rows)
            episodes = ([env.episode for env in trainer.environments] if mode == "env"
                        else specs[mode].rollout_func.last_episodes)
            records[mode] = [ep.record() for ep in episodes][::2]
        model = ScriptModel(AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True))
        report = specs["eval"].evaluate(LocalPolicy(model, model.tokenizer, max_new_tokens=256),
                                        max_turns=ITERATIONS + 1, progress=False)
        inputs["eval"], records["eval"] = model.inputs, report.episodes
    finally:
        for spec in specs.values():
            spec.close()
    seen = {mode: sorted(map(tuple, ids)) for mode, ids in inputs.items()}
    assert len(seen["eval"]) == 2 + 3 + 1 + 2 + 3 + 1  # every reply of the script, generated once per task
    assert seen["env"] == seen["engine"] == sorted(t for t in seen["eval"] for _ in range(2))  # two rollouts a task
    later = [ids for ids in seen["eval"] if b"<tool_response>" in model.tokenizer.decode(ids).encode()]
    assert len(later) == 2 + 1 + 1 + 2  # the turns after tool results are among them (the demo's check)
    by_target = {mode: {r["prompt"]: comparable(r) for r in recs} for mode, recs in records.items()}
    for prompt in by_target["env"]:
        assert by_target["env"][prompt] == by_target["engine"][prompt] == by_target["eval"][prompt], prompt
    assert ref_server.stats()["open_sessions"] == 0
