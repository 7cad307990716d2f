"""`ors-trl demo` (docs/demo.md): serve the bundled environment on loopback, build a tiny Qwen3 and its tokenizer
locally, warm start it (format only), train it with `GRPOTrainer` fed by `OpenRewardSpec(url)` (or its rollout_func),
measure it on held-out tasks before and after: a table (`--json`: and a JSON line) and an HTML report. `--model`: a
real model; `--env`: another ORS environment (held out: its `test` split, else the last quarter of its training
split); `--save-model DIR`: save the trained model (`--steps 0`: the tiny one, untrained, and nothing else)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ors_trl.protocol.errors import ConfigurationError
from ors_trl.protocol.text import escape_controls

__all__ = ["DemoResult", "main", "run_demo"]

TASKS = ("look", "echo")
DEFAULT_TASK = "look"
DEFAULT_STEPS = {"look": 100, "echo": 150}
#: The held-out success `--eval-every` reports the episodes to (the demo's trained models reach 0.83-1.00).
TARGET = 0.8
EPISODE_LOG = "episodes.jsonl"
REPORT = "report.html"
#: What a run with a report writes into its output folder (a rerun replaces them, and says so).
RUN_FILES = (EPISODE_LOG, "eval_before.jsonl", "eval_after.jsonl", "trainer_state.json", REPORT)


@dataclass
class DemoResult:
    """What a demo run measured. `blind`: the look task's blind-variant evaluation after training; `report`,
    `episode_log`: the files written, if any."""

    before: dict[str, Any]
    after: dict[str, Any]
    seconds: float
    steps: int
    seed: int
    model: str
    environment: str
    log_history: list[dict[str, Any]] = field(default_factory=list)
    task: str = "echo"
    rollout_func: bool = False
    blind: dict[str, Any] | None = None
    report: str | None = None
    episode_log: str | None = None
    output_dir: str | None = None
    curve: list[dict[str, float]] = field(default_factory=list)
    pool: str = "train"
    task_sampling: str = "uniform"
    saved_model: str | None = None
    heldout: str = "the 'test' split"

    def episodes_to(self, target: float) -> int | None:
        """Training episodes (a difficulty probe's included) until held-out success first reached `target` (None:
        not within the run; needs `eval_every`)."""
        return next((int(p["episodes"]) for p in self.curve if p["success"] >= target), None)

    def to_json(self) -> dict[str, Any]:
        """`--json`'s object: every number measured before and after (`<key>_before`, `<key>_after`), the settings."""
        sides = (("before", self.before), ("after", self.after))
        out = {f"{k}_{when}": v for when, d in sides for k, v in d.items() if isinstance(v, int | float)}
        out.update({k: getattr(self, k) for k in ("seconds", "seed", "steps", "model", "environment", "task", "pool",
                                                  "task_sampling", "heldout")},
                   success_before=self.before["success_rate"], success_after=self.after["success_rate"])
        out.update({k: getattr(self, k) for k in ("curve", "report", "saved_model") if getattr(self, k)})
        if self.task == "look":  # no_look_success is None where no episode answered without looking
            out.update({f"no_look_success_{when}": d.get("no_look_success") for when, d in sides},
                       rollout_func=self.rollout_func)
            if self.blind is not None:
                out.update(blind_success_after=self.blind["success_rate"],
                           blind_follow_after=self.blind.get("follow_rate"),
                           blind_look_rate_after=self.blind.get("look_rate"))
        return out

    def table(self) -> str:
        """The before/after table `ors-trl demo` prints."""
        def cell(value: Any) -> str:
            return f"{value:>10.3f}" if isinstance(value, int | float) else f"{'n/a':>10}"

        def row(label: str, before: str, after: str, note: str = "") -> str:
            return f"{label:27}{before}{after}{note}"

        look, blank = self.task == "look", " " * 10
        rows = [("held-out success rate", "success_rate")]
        rows += [("looked before answering", "look_rate"), ("turns per episode", "turns"),
                 ("answer graded (terminal)", "answered_rate")] if look else []
        rows += [("tool-call rate", "tool_call_rate"), ("tool failure rate", "tool_failure_rate"),
                 ("mean reward", "mean_reward")]
        lines = [row("", f"{'before':>10}", f"{'after':>10}")]
        lines += [row(label, cell(self.before.get(key)), cell(self.after.get(key))) for label, key in rows]
        if look:
            lines.append(row("success without looking", cell(self.before.get("no_look_success")),
                             cell(self.after.get("no_look_success")),
                             f"   ({self.before.get('no_look_n', 0)} / {self.after.get('no_look_n', 0)} episodes)"))
        if look and self.blind is not None:
            lines += [row("blind-variant success", blank, cell(self.blind["success_rate"]),
                          "   (chance: 1/6 = 0.167)"),
                      row("blind: answered the decoy", blank, cell(self.blind.get("follow_rate")))]
        if self.curve:
            reached = "not yet" if (n := self.episodes_to(TARGET)) is None else n
            lines.append(row(f"episodes to {TARGET:g} held out", blank, f"{reached:>10}",
                             f"   ({self.pool} pool, {self.task_sampling} sampling)"))
        lines.append(f"{'wall time':27}{self.seconds:>19.1f}s")
        return "\n".join(lines)


def _say_to(quiet: bool) -> Callable[[str], None]:
    """Timestamped progress lines on stderr, so stdout keeps the table and the JSON line."""
    t0 = time.perf_counter()

    def say(message: str) -> None:
        if not quiet:  # escaped: the lines quote the environment's names
            print(f"[{time.perf_counter() - t0:6.1f}s] {escape_controls(message)}", file=sys.stderr, flush=True)

    return say


def _callback(say: Callable[[str], None], evaluate: Callable[[Any], dict[str, Any]], every: int, per_step: int,
              offset: int, curve: list[dict[str, float]]) -> Any:
    """The demo's trainer callback: one progress line per logging step, and with `every`, held-out success measured
    every `every` steps into `curve` (step, episodes: `offset` + `per_step` a step, success)."""
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            """Reward, tool calls per rollout, and the environment's own reward mean."""
            if not logs or logs.get("reward") is None:
                return
            parts = [f"step {state.global_step:4d}/{state.max_steps}", f"reward {logs['reward']:.2f}"]
            per_episode = next((v for k, v in logs.items() if k.endswith("/tool_calls_per_episode")), None)
            if logs.get("tools/call_frequency") is not None:
                parts.append(f"tool calls/rollout {logs['tools/call_frequency']:.2f}")
            elif per_episode is not None:  # spec.rollout_func: TRL does not count the calls; the environment does
                parts.append(f"tool calls/episode (env) {per_episode:.2f}")
            env_reward = next((v for k, v in logs.items() if k.endswith("/reward_mean") and v is not None), None)
            if env_reward is not None:
                parts.append(f"env reward (graded rollouts) {env_reward:.2f}")
            say("  " + "  ".join(parts))

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if every and state.global_step % every == 0 and model is not None:
                success = evaluate(model)["success_rate"]
                curve.append({"step": state.global_step, "episodes": offset + state.global_step * per_step,
                              "success": success})
                say(f"  step {state.global_step}: held-out success {success:.3f}")

    return DemoProgress()


def _load_model(name: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as exc:
        where = "local folder" if os.path.isdir(name) else "local folder or hub model"
        raise SystemExit(
            f"ors-trl demo: could not load --model {name!r} as a {where} ({type(exc).__name__}: {exc}). Pass a "
            "folder holding a saved model and tokenizer, or a hub name on a machine that can reach the hub."
        ) from None
    return model, tokenizer


def shuffled(reward_func: Callable[..., list[float | None]], seed: int) -> Callable[..., list[float | None]]:
    """The control: the same rewards, permuted across each batch, so they say nothing about the rollouts."""
    rng = random.Random(seed + 12345)

    def shuffled_reward(*args: Any, **kwargs: Any) -> list[float | None]:
        rewards = list(reward_func(*args, **kwargs))
        rng.shuffle(rewards)
        return rewards

    return shuffled_reward


def _bundled_class(task: str) -> type:
    """The task's bundled environment (the server names it after its class, lowercased)."""
    from ._environments import DemoEnvironment, LookEnvironment

    return LookEnvironment if task == "look" else DemoEnvironment


def run_demo(*, task: str = DEFAULT_TASK, url: str | None = None, env: str | None = None, env_name: str | None = None,
             model_name: str | None = None, steps: int | None = None, sft_steps: int | None = None, seed: int = 0,
             output_dir: str | None = None, control: bool = False, rollout_func: bool = False, report: bool = False,
             blind: bool = True, say: Callable[[str], None] = lambda _: None,
             config_overrides: dict[str, Any] | None = None, pool: str = "train", task_sampling: str = "uniform",
             difficulty: tuple[float, float] | None = None, eval_every: int = 0,
             save_model: str | None = None) -> DemoResult:
    """The demo pipeline, with `ors-trl demo`'s options (`_parser`; `--model` is `model_name`; `--env` has no warm
    start). `url`: a running server of the bundled environment (else one is started); `control`: shuffle the rewards
    across each batch; `blind`: also evaluate the look task's blind variant; `say`: the progress lines;
    `config_overrides`: GRPO configuration entries; `difficulty`: keep the training tasks whose mean reward in a probe
    of the warm-started model (4 attempts each; its episodes count in `curve`) lies in this range."""
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from ors_trl import OpenRewardSpec

    from . import _model, _recipe, _task

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    steps = DEFAULT_STEPS[task] if steps is None else steps
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # saving the model (--save-model) would draw one
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*experimental feature.*")
    torch.manual_seed(seed)
    random.seed(seed)

    started = time.perf_counter()
    out_dir = Path(output_dir or tempfile.mkdtemp(prefix="ors-trl-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    # A previous run's files go, said: the report describes this run alone, and a rerun is how one iterates.
    replaced = [name for name in RUN_FILES if report and (out_dir / name).is_file()]
    if replaced:
        print(f"ors-trl demo: {out_dir} holds a previous run's {', '.join(replaced)}; this run replaces them",
              file=sys.stderr, flush=True)
        for name in replaced:
            (out_dir / name).unlink()
    episode_log = str(out_dir / EPISODE_LOG) if report else None
    bundled = env is None
    look = bundled and task == "look"
    split = pool if look else "train"
    target, name = env, env_name
    server = None
    specs: list[Any] = []

    def spec(part: str, **options: Any) -> Any:
        """A spec of the environment's split `part`, closed when the run ends."""
        specs.append(OpenRewardSpec(target, env_name=name, split=part, **options))
        return specs[-1]

    try:
        if bundled:
            name = _bundled_class(task).__name__.lower()
            if url is None:
                from ors_trl.testing import ReferenceServer

                say(f"starting the bundled {task!r} environment (the reference ORS server, on loopback)")
                server = ReferenceServer([_bundled_class(task)]).start()
                url = server.url
                say(f"  serving {server.url}")
            target = url
        # The demo scores a rollout the environment never scored (no tool call in echo; cut off before a final
        # answer in look) as 0.0 rather than leaving it out: with TRL's None convention a model this small learns
        # to dodge the penalty for wrong answers by not answering.
        train_options: dict[str, Any] = {"unscored_reward": 0.0 if bundled else None, "episode_log": episode_log,
                                         "task_sampling": task_sampling}
        train = spec(split, **train_options)
        heldout_split, indices, held_indices, held = _heldout_plan(train, split)
        if indices is not None:  # a slice of the training split, held out: the other tasks are trained on
            train_options["indices"] = indices
            train = spec(split, **train_options)
            say(f"environment has no 'test' split: {held}")
        heldout = spec(heldout_split, indices=held_indices)
        tools = _recipe.environment_tools(train.environment_factory())
        train_tasks = train.run(train.select_tasks())[0]
        say(f"environment {train.name}: {len(train_tasks)} training tasks ({split}), "
            f"{len(list(heldout.train_dataset))} held-out tasks, tools {sorted(f.__name__ for f in tools)}"
            + (f", terminal tool {train.terminal_tool.name!r}" if train.terminal_tool else ""))

        flatten = not rollout_func  # how the trainer shows a system turn: joined to the user text, or kept
        prompt_fn = (_task.look_prompt if flatten else _task.look_messages) if look else _task.prompt
        episodes_fn = _task.look_warm_start_episodes if look else _task.warm_start_episodes
        if model_name:
            say(f"loading model {model_name}")
            model, tokenizer = _load_model(model_name)
        else:
            say("building a tiny Qwen3 model and its byte-level BPE tokenizer (local, nothing downloaded)")
            tasks = train.run(train.client.tasks(split)) if bundled else []
            corpus = (_model.render_corpus(tasks, tools, prompt_fn, episodes_fn=episodes_fn, copies=2, seed=seed)
                      if bundled else _prompt_corpus(train, tools))
            tokenizer = _model.build_tokenizer(corpus, isolate=_task.TARGETS if look else ())
            model = _model.build_model(tokenizer, seed=seed, **(_model.LOOK_MODEL_DIMS if look else {}))
            say(f"  {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary of {len(tokenizer)}")
            if bundled:
                say(f"warm start: {'look, then answer' if look else 'the tool-call format'}, with every word "
                    "equally often (not the answers)")
                sft = {**(_recipe.LOOK_WARM_START if look else {}),
                       **({} if sft_steps is None else {"steps": sft_steps})}
                _recipe.warm_start(model, tokenizer, tasks, seed, tools=tools, prompt_fn=prompt_fn,
                                   episodes_fn=episodes_fn, **sft)

        def evaluate(model: Any, spec: Any = heldout, **options: Any) -> dict[str, Any]:
            return _recipe.evaluate_policy(model, tokenizer, spec, flatten_system=flatten,
                                           look_tool=_task.LOOK_TOOL if look else None, **options)

        def measure(model: Any, when: str) -> dict[str, Any]:
            say(f"measuring the model on held-out tasks ({when})")
            out = evaluate(model, output=str(out_dir / f"eval_{when}.jsonl") if report else None)
            say(f"  held-out success {out['success_rate']:.3f}, tool-call rate {out['tool_call_rate']:.3f}")
            return out

        before = measure(model, "before")
        config = _recipe.grpo_config_kwargs(steps, seed, str(out_dir), task, **(config_overrides or {}))
        probe_episodes = 0
        if difficulty is not None:
            probe_out = out_dir / "difficulty_probe.jsonl"
            evaluate(model, spec(split, indices=indices), repeats=4, temperature=1.0, output=str(probe_out))
            probe_episodes = 4 * len(train_tasks)
            train = spec(split, **{**train_options, "unscored_reward": 0.0}, difficulty=difficulty,
                         difficulty_from=probe_out)
            kept = len(train.run(train.select_tasks())[0])
            say(f"  difficulty {difficulty}: {kept} of {len(train_tasks)} tasks kept "
                f"after a probe of {probe_episodes} episodes")
        curve: list[dict[str, float]] = []
        per_step = config["per_device_train_batch_size"] * config.get("gradient_accumulation_steps", 1)
        callback = _callback(say, evaluate, eval_every, per_step, probe_episodes, curve)
        say(f"GRPO for {steps} steps through OpenRewardSpec({target!r}) "
            f"({'spec.rollout_func' if rollout_func else 'environment_factory'})"
            + (" with SHUFFLED rewards" if control else ""))
        loop = ({"rollout_func": train.rollout_func} if rollout_func
                else {"environment_factory": train.environment_factory})
        rewards = shuffled(train.reward_funcs, seed) if control else train.reward_funcs
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=GRPOConfig(**config),
                              train_dataset=train.train_dataset, callbacks=[callback], reward_funcs=rewards, **loop)
        for printer in (PrinterCallback, ProgressCallback):  # our own progress lines instead of raw log dicts
            trainer.remove_callback(printer)
        trainer.train()
        train.close()  # every training episode is closed, and so written to the episode log
        if save_model:
            say(f"saved the trained model and its tokenizer to {_model.save(trainer.model, tokenizer, save_model)}")

        after = measure(trainer.model, "after")
        blind_result = None
        if look and blind:
            blind_result = evaluate(trainer.model, spec("blind"))
            say(f"  blind variant: success {blind_result['success_rate']:.3f} (chance 0.167), answered the decoy "
                f"{blind_result['follow_rate']:.3f}")
    finally:
        for opened in specs:
            opened.close()
        if server is not None:
            server.close()
    report_path = _write_report(out_dir, task, trainer, say) if report else None
    return DemoResult(before=before, after=after, seconds=time.perf_counter() - started, steps=steps, seed=seed,
                      model=model_name or "tiny-qwen3", environment=env or f"bundled {task} environment",
                      log_history=list(trainer.state.log_history), task=task if bundled else "env",
                      rollout_func=rollout_func, blind=blind_result, report=report_path, episode_log=episode_log,
                      output_dir=str(out_dir), curve=curve, pool=split,
                      task_sampling=task_sampling if difficulty is None else f"{task_sampling}+difficulty",
                      saved_model=save_model, heldout=held)


def _heldout_plan(train: Any, split: str) -> tuple[str, list[int] | None, list[int] | None, str]:
    """Where the held-out evaluation draws from: `(split, training indices, held-out indices, said)`: the server's
    `test` split when it has one (indices None: all), else the last quarter (at least one) of `split`'s tasks, which
    training then leaves out."""
    names = [s.name for s in train.run(train.client.splits())]
    if "test" in names:
        return "test", None, None, "the 'test' split"
    total = train.run(train.client.num_tasks(split))
    if total < 2:
        raise ConfigurationError(f"the environment has no 'test' split and {total} task(s) in {split!r}: the demo "
                                 "needs a 'test' split or two tasks (one to train on, one held out) to measure on")
    kept = total - max(1, total // 4)
    return split, list(range(kept)), list(range(kept, total)), (
        f"the last {total - kept} of the {total} {split!r} tasks, held out of training (splits: {', '.join(names)})")


def _write_report(out_dir: Path, task: str, trainer: Any, say: Callable[[str], None]) -> str | None:
    """Save the trainer state and write the run's HTML report; its path (None where it failed)."""
    from ors_trl import write_report

    trainer.state.save_to_json(str(out_dir / "trainer_state.json"))
    log = out_dir / EPISODE_LOG
    # The two evaluations come from one process and one policy: only their names tell them apart (before first,
    # the baseline the page compares "after" with).
    labels = [(name, str(p)) for name, p in (("before", out_dir / "eval_before.jsonl"),
                                              ("after", out_dir / "eval_after.jsonl")) if p.exists()]
    try:
        summary = write_report([*([str(log)] if log.exists() and log.stat().st_size > 0 else []), str(out_dir)],
                               str(out_dir / REPORT), title=f"ors-trl demo ({task})", labels=labels)
    except Exception as exc:  # the results stand without the page: say why it is missing, do not fail the run
        say(f"  (no HTML report: {type(exc).__name__}: {exc})")
        return None
    say(f"report: {summary.output}")
    return str(summary.output)


def _prompt_corpus(spec: Any, tools: list[Any], limit: int = 32) -> list[str]:
    """Tokenizer-training text for another environment: a few of its prompts rendered with its tools."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from ._model import chat_template

    conversations = []
    for row in list(spec.train_dataset)[:limit]:
        adapter = spec.environment_factory()
        conversations.append([{"role": "user", "content": adapter.reset(**row)}])
        if adapter.episode is not None:
            adapter.episode.release()
    rendered, _ = render_jinja_template(conversations, tools=tools, chat_template=chat_template())
    return rendered


def _parser() -> argparse.ArgumentParser:
    """`ors-trl demo`'s options; each `dest` is the `run_demo` keyword it sets, but `threads`, `json`, `quiet`."""
    p = argparse.ArgumentParser(
        prog="ors-trl demo",
        description="Train a tiny model with GRPO against a local ORS environment and show what it learned "
                    "(a few minutes on 2 CPU cores, nothing downloaded).",
    )
    p.add_argument("--task", choices=TASKS, default=DEFAULT_TASK,
                   help="look (default): the answer is only in the look() tool's output and the final message is "
                        "graded by the environment's terminal tool; echo: the word is in the prompt, call echo(text)")
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + "); 0 "
                        "with --save-model: train nothing, only save the tiny model untrained")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the warm start and GRPO (default 0)")
    p.add_argument("--rollout-func", action="store_true",
                   help="roll out through spec.rollout_func (the concurrent engine) instead of environment_factory")
    p.add_argument("--model", dest="model_name", default=None, metavar="PATH_OR_NAME",
                   help="train this model (local folder, or hub name where the hub is reachable) instead of the tiny "
                        "one")
    p.add_argument("--env", default=None, metavar="URL_OR_NAME",
                   help="train against this ORS environment (URL or catalog name) instead of the bundled one")
    p.add_argument("--env-name", default=None, help="with --env: the environment on a server hosting several")
    p.add_argument("--output-dir", default=None,
                   help="where the trainer, the episode log and the report go (default: a temporary folder)")
    p.add_argument("--save-model", metavar="DIR", default=None,
                   help="save the trained model and its tokenizer to DIR (made if missing), for ors-trl eval --model "
                        "DIR, LocalPolicy.from_pretrained(DIR) or GRPOTrainer(model=DIR); printed as 'model: DIR'")
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="write an HTML report of the run into the output folder (default: on)")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default: the task's recipe)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: cores are shared)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results as the last line")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the results")
    p.add_argument("--pool", choices=("train", "mixed", "sparse"), default="train",
                   help="look task: train on its tasks (default), or on the mixed pool: a third look tasks, a third "
                        "any answer solves, a third none does, or on the sparse one: a fifth look tasks, two fifths "
                        "each of the others (task selection)")
    p.add_argument("--task-sampling", choices=("uniform", "adaptive"), default="uniform",
                   help="how the training tasks are drawn (OpenRewardSpec(task_sampling=...)); default uniform")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="also measure held-out success every N steps, and say when it first reached 0.8")
    return p


def main(argv: list[str] | None = None) -> int:
    """`ors-trl demo`; returns a process exit code."""
    options = vars(_parser().parse_args(argv))
    threads, as_json, quiet = options.pop("threads"), options.pop("json"), options.pop("quiet")
    if (save := options["save_model"]) and os.path.exists(save) and not os.path.isdir(save):
        print(f"ors-trl demo: error: --save-model {save!r} is a file; give a folder (made if missing)",
              file=sys.stderr)
        return 2
    if options["steps"] == 0 and options["save_model"]:  # no server, no training: the untrained tiny model
        if options["model_name"] or options["env"]:
            print("ors-trl demo: error: --steps 0 saves the tiny untrained model; it takes no --model or --env",
                  file=sys.stderr)
            return 2
        from ._model import save_tiny_model

        print(f"model: {save_tiny_model(options['save_model'], seed=options['seed'])} (untrained)")
        return 0
    if options["steps"] is not None and options["steps"] < 1:
        print("ors-trl demo: error: --steps must be at least 1 (0 only with --save-model: save the untrained tiny "
              "model)", file=sys.stderr)
        return 2
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(max(1, threads))
    result = run_demo(**options, say=_say_to(quiet))
    print(result.table())
    if result.report:
        print(f"report: {result.report}")
    if result.saved_model:
        print(f"model: {result.saved_model}")
    print(f"held-out tasks: {result.heldout}")
    if as_json:
        print(json.dumps(result.to_json(), sort_keys=True))
    return 0
