"""`ors-trl demo`: train a tiny tool-calling model with GRPO against a local ORS environment, end to end.

1. start the bundled demo environment (`ors_trl.demo._environments`, written with the `openreward`
   scaffolding) under the reference server on a free loopback port;
2. build a tiny Qwen3 model and a byte-level BPE tokenizer locally (TRL's `qwen3.jinja` template);
3. warm start it (supervised, format only: every allowed word equally, whatever the prompt asks);
4. measure it on held-out tasks; train it with `GRPOTrainer` fed by `OpenRewardSpec(url)`'s
   `train_dataset`, `environment_factory` and `reward_funcs`; measure it again;
5. print a before/after table (and, with `--json`, one JSON object as the last line).

Nothing is downloaded. With `--model` a real model is trained instead (from a local path, or from
the hub where there is one); with `--env` another ORS environment is used.
"""

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
from typing import Any

__all__ = ["DemoResult", "main", "run_demo"]

BUNDLED_ENV = "demoenvironment"
DEFAULT_STEPS = 150


@dataclass
class DemoResult:
    """What a demo run measured, plus what a test wants to check afterwards."""

    before: dict[str, Any]
    after: dict[str, Any]
    seconds: float
    steps: int
    seed: int
    model: str
    environment: str
    log_history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{k}_{when}": v for when, d in (("before", self.before), ("after", self.after))
                               for k, v in d.items() if isinstance(v, int | float)}
        out.update({
            "success_before": self.before["success_rate"],
            "success_after": self.after["success_rate"],
            "seconds": self.seconds,
            "seed": self.seed,
            "steps": self.steps,
            "model": self.model,
            "environment": self.environment,
        })
        return out

    def table(self) -> str:
        rows = [
            ("held-out success rate", "success_rate"),
            ("tool-call rate", "tool_call_rate"),
            ("tool failure rate", "tool_failure_rate"),
            ("mean reward", "mean_reward"),
        ]
        lines = [f"{'':24}{'before':>10}{'after':>10}"]
        for label, key in rows:
            lines.append(f"{label:24}{self.before[key]:>10.3f}{self.after[key]:>10.3f}")
        lines.append(f"{'wall time':24}{self.seconds:>19.1f}s")
        return "\n".join(lines)


def _say_to(quiet: bool) -> Callable[[str], None]:
    """Timestamped progress lines on stderr, so stdout keeps the table and the JSON line."""
    t0 = time.perf_counter()

    def say(message: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def _progress_callback(say: Callable[[str], None]) -> Any:
    from transformers import TrainerCallback

    class DemoProgress(TrainerCallback):
        """One line per logging step: reward, tool calls per rollout, and the environment's own reward mean."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if not logs or logs.get("reward") is None:
                return
            parts = [f"step {state.global_step:4d}/{state.max_steps}", f"reward {logs['reward']:.2f}"]
            if logs.get("tools/call_frequency") is not None:
                parts.append(f"tool calls/rollout {logs['tools/call_frequency']:.2f}")
            env_reward = next((v for k, v in logs.items() if k.endswith("/reward_mean") and v is not None), None)
            if env_reward is not None:
                parts.append(f"env reward (graded rollouts) {env_reward:.2f}")
            say("  " + "  ".join(parts))

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


def run_demo(
    *,
    url: str | None = None,
    env: str | None = None,
    env_name: str | None = None,
    model_name: str | None = None,
    steps: int = DEFAULT_STEPS,
    sft_steps: int | None = None,
    seed: int = 0,
    output_dir: str | None = None,
    control: bool = False,
    say: Callable[[str], None] = lambda _: None,
    config_overrides: dict[str, Any] | None = None,
) -> DemoResult:
    """The demo pipeline. `url` uses an already running demo environment (else one is started);
    `env` trains against another ORS environment instead; `control` shuffles the rewards."""
    import torch
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from ors_trl import OpenRewardSpec

    from . import _model, _recipe, _task

    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*experimental feature.*")
    torch.manual_seed(seed)
    random.seed(seed)

    started = time.perf_counter()
    server = None
    try:
        if env is not None:
            target, name = env, env_name
        elif url is not None:
            target, name = url, BUNDLED_ENV
        else:
            from ors_trl.testing import ReferenceServer

            from ._environments import DemoEnvironment

            say("starting the bundled demo environment (the reference ORS server, on loopback)")
            server = ReferenceServer([DemoEnvironment]).start()
            target, name = server.url, BUNDLED_ENV
            say(f"  serving {server.url}")
        bundled = env is None
        # The demo scores a rollout that never calls the tool as 0.0 rather than leaving it unscored: with TRL's
        # None convention a model this small learns to stop calling the tool to dodge the penalty for wrong calls.
        train = OpenRewardSpec(target, env_name=name, split="train", unscored_reward=0.0 if bundled else None)
        heldout = OpenRewardSpec(target, env_name=name, split="test")
        heldout_rows = list(heldout.train_dataset)
        factory = train.environment_factory
        tools = _recipe.environment_tools(factory())
        say(f"environment {train.name}: {len(train.train_dataset)} training tasks, {len(heldout_rows)} held-out "
            f"tasks, tools {sorted(f.__name__ for f in tools)}")

        if model_name:
            say(f"loading model {model_name}")
            model, tokenizer = _load_model(model_name)
        else:
            say("building a tiny Qwen3 model and its byte-level BPE tokenizer (local, nothing downloaded)")
            tasks = train.run(train.client.tasks("train")) if bundled else []
            corpus = (_model.render_corpus(tasks, tools, _task.prompt, episodes_fn=_task.warm_start_episodes,
                                           copies=2, seed=seed) if bundled else _prompt_corpus(train, tools))
            tokenizer = _model.build_tokenizer(corpus)
            model = _model.build_model(tokenizer, seed=seed)
            say(f"  {_model.count_parameters(model):,} parameters, vocabulary of {len(tokenizer)}")
            if bundled:
                say("warm start: the tool-call format, with every word equally often (not the answers)")
                sft = {} if sft_steps is None else {"steps": sft_steps}
                _recipe.warm_start(model, tokenizer, tasks, seed, tools=tools, prompt_fn=_task.prompt,
                                   episodes_fn=_task.warm_start_episodes, **sft)

        say("measuring the model on held-out tasks (before)")
        before = _recipe.evaluate_policy(model, tokenizer, heldout)
        say(f"  held-out success {before['success_rate']:.3f}, tool-call rate {before['tool_call_rate']:.3f}")

        config = _recipe.grpo_config_kwargs(steps=steps, seed=seed,
                                            output_dir=output_dir or tempfile.mkdtemp(prefix="ors-trl-demo-"),
                                            **(config_overrides or {}))
        say(f"GRPO for {steps} steps through OpenRewardSpec({target!r})" + (" with SHUFFLED rewards" if control else ""))
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            args=GRPOConfig(**config),
            train_dataset=train.train_dataset,
            environment_factory=train.environment_factory,
            reward_funcs=shuffled(train.reward_funcs, seed) if control else train.reward_funcs,
            callbacks=[_progress_callback(say)],
        )
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(PrinterCallback)  # our own progress lines instead of raw log dicts on stdout
        trainer.remove_callback(ProgressCallback)
        trainer.train()

        say("measuring the model on held-out tasks (after)")
        after = _recipe.evaluate_policy(trainer.model, tokenizer, heldout)
        train.close()
        heldout.close()
        return DemoResult(before=before, after=after, seconds=time.perf_counter() - started, steps=steps, seed=seed,
                          model=model_name or "tiny-qwen3", environment=target if env else "bundled demo environment",
                          log_history=list(trainer.state.log_history))
    finally:
        if server is not None:
            server.stop()


def _prompt_corpus(spec: Any, tools: list[Any], limit: int = 32) -> list[str]:
    """Tokenizer-training text for another environment: a few of its prompts rendered with its tools."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from ._model import chat_template

    conversations = []
    for row in list(spec.train_dataset)[:limit]:
        adapter = spec.environment_factory()
        conversations.append([{"role": "user", "content": adapter.reset(**row)}])
        adapter._close()
    rendered, _ = render_jinja_template(conversations, tools=tools, chat_template=chat_template())
    return rendered


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ors-trl demo",
        description="Train a tiny model with GRPO against a local ORS environment and show what it learned "
                    "(about 3 minutes on 2 CPU cores, nothing downloaded).",
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"GRPO steps (default {DEFAULT_STEPS})")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the warm start and GRPO (default 0)")
    p.add_argument("--model", default=None, metavar="PATH_OR_NAME",
                   help="train this model (local folder, or hub name where the hub is reachable) instead of the tiny one")
    p.add_argument("--env", default=None, metavar="URL_OR_NAME",
                   help="train against this ORS environment (URL or catalog name) instead of the bundled one")
    p.add_argument("--env-name", default=None, help="with --env: the environment on a server hosting several")
    p.add_argument("--output-dir", default=None, help="where the trainer writes (default: a temporary folder)")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default: the recipe's 80)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: cores are shared)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results as the last line")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only the results")
    return p


def main(argv: list[str] | None = None) -> int:
    """`ors-trl demo`; returns a process exit code."""
    args = _parser().parse_args(argv)
    if args.steps < 1:
        print("ors-trl demo: --steps must be at least 1", file=sys.stderr)
        return 2
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(max(1, args.threads))
    result = run_demo(env=args.env, env_name=args.env_name, model_name=args.model, steps=args.steps,
                      sft_steps=args.sft_steps, seed=args.seed, output_dir=args.output_dir, say=_say_to(args.quiet))
    print(result.table())
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    return 0
