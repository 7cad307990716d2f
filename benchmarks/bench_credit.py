"""Per-turn credit against outcome-only credit and a shuffled control, side by side on the long-horizon corridor.

The bundled corridor (`CorridorEnvironment`, served with `ORS_CORRIDOR_SIZE=ROOMS:WORDS`: `--rooms` rooms, doors
written with the first `--words` door words): each door opens with the word the last result (or the prompt) shows,
0.1 per room passed, 1.0 and `finished` at the exit, 0.0 for a wrong word. The episode's reward is their sum
(`reward="sum"`); TRL's loop (`environment_factory`) allows `--rooms + 1` tool turns (one wrong word can be made up).
Per seed, the same tiny model (the demo's tiny Qwen3, warm-started on the call format with random words: the format,
not the answers) trains with GRPO in three arms:

    outcome   credit="episode": GRPO's one advantage per rollout, broadcast over its turns
    turn      credit="turn": each turn's tokens also get the turn's reward-to-go, normalised in its GRPO group
              against the group's rollouts at the same turn (`ors_trl.trl.credit`)
    shuffled  the control: credit="turn", but each episode's per-call rewards are shuffled before the returns are
              taken (same sum, so the same episode advantage; the turn term no longer says which call earned what)

Measured on the training rollouts themselves (every step's batch, sampled at temperature 1): the success rate (the
exit reached), and the environment episodes until its mean over the last 3 steps first reaches `--target`. A run
that never reaches it counts as never (median over seeds; `--` in the table). Ratios are outcome / arm (above 1: the
arm needed fewer episodes).

`.venv/bin/python benchmarks/bench_credit.py [--quick] [--seeds 0 1 2] [--steps N] [--rooms 3] [--words 2]
[--target 0.7] [--jobs 2] [--json]`  (`--quick`: a smoke run, 3 steps per arm and seed, about 3 minutes on 2 cores,
too short to learn; the default run: 3 arms x 3 seeds, 2-8 minutes a run on one core (busy box), 12-25 minutes).

Measured (2 busy cores, TRL 1.16, 3 seeds): 3 rooms, 25 steps, target 0.7: median episodes outcome 704 (2 of 3
seeds reached it), turn 672 (2 of 3), shuffled -- (1 of 3: 576); 4 rooms: no arm reached 0.7 in 25 steps (final
success 0.32 / 0.28 / 0.30); 4 rooms, 40 steps, target 0.5: each arm reached it on 1 seed of 3 (704 / 704 / 512
episodes; final success 0.375 / 0.403 / 0.403). Per-turn credit did not learn measurably faster than outcome-only here: the differences
are within the spread between seeds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARMS = ("outcome", "turn", "shuffled")
WINDOW = 3  # steps the success rate is averaged over before it is compared with the target
DONE = "Done."


def corridor_conversations(tasks: list[dict[str, Any]], prompts: list[list[dict[str, Any]]], words: list[str],
                           rng: random.Random) -> list[list[dict[str, Any]]]:
    """The warm start's walks: each task's prompt, then a call per room with a random word (the format, not the
    answer) answered as if it opened the door (a random word on the next one), then "Done." at the exit."""
    from ors_trl.demo._model import tool_call_message

    out = []
    for task, prompt in zip(tasks, prompts, strict=True):
        messages = [dict(m) for m in prompt]
        for room in range(1, task["rooms"] + 1):
            messages.append(tool_call_message("open_door", {"word": rng.choice(words)}))
            shown = ("You are out of the corridor." if room == task["rooms"]
                     else f"Room {room + 1} of {task['rooms']}. The door says: {rng.choice(words)}.")
            messages.append({"role": "tool", "name": "open_door", "content": shown})
        messages.append({"role": "assistant", "content": DONE})
        out.append(messages)
    return out


def warm_start(model: Any, tokenizer: Any, walks: list[list[dict[str, Any]]], tools: list[Any], seed: int,
               steps: int) -> None:
    """A short supervised loop on the walks (loss on the model's own turns only), built at the token level as TRL's
    tool loop builds a rollout (`ors_trl.demo._recipe`'s warm start, for several calls)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from ors_trl.demo._model import EOS_TOKEN
    from ors_trl.demo._recipe import rendering, tool_call_text

    render = rendering(tokenizer)
    examples = []
    for walk in walks:
        first = next(i for i, m in enumerate(walk) if m["role"] == "assistant")
        ids = render.prompt_ids(walk[:first], tools)
        labels = [-100] * len(ids)
        for m in walk[first:]:
            if m["role"] == "tool":
                part, own = render.tool_suffix_ids([m]), False
            elif m.get("tool_calls"):
                call = m["tool_calls"][0]["function"]
                part, own = tokenizer.encode(tool_call_text(tokenizer, call["name"], call["arguments"]),
                                             add_special_tokens=False), True
            else:
                part, own = tokenizer.encode(m["content"] + EOS_TOKEN, add_special_tokens=False), True
            ids, labels = ids + part, labels + (part if own else [-100] * len(part))
        examples.append((torch.tensor(ids), torch.tensor(labels)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, min(32, len(examples)))
        input_ids = pad_sequence([i for i, _ in batch], batch_first=True, padding_value=tokenizer.pad_token_id)
        attention = pad_sequence([torch.ones_like(i) for i, _ in batch], batch_first=True)
        labels = pad_sequence([lab for _, lab in batch], batch_first=True, padding_value=-100)
        model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def shuffle_credit(seed: int) -> None:
    """The control: per-turn credit over each episode's per-call rewards in a random order."""
    from ors_trl.trl import credit

    rng = random.Random(seed + 4242)

    def shuffled(ep: Any) -> list[float] | None:
        rewards = list(ep.rewards)
        rng.shuffle(rewards)
        return ep.turn_returns(rewards)

    credit.returns_of = shuffled


def train_one(arm: str, seed: int, steps: int, rooms: int, words: int, prompts: int, generations: int,
              sft_steps: int) -> dict[str, Any]:
    """One arm and seed, on a reference server of its own: the per-step success and return of the rollouts."""
    import logging
    import warnings

    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from ors_trl import OpenRewardSpec
    from ors_trl.demo import _model, _recipe
    from ors_trl.demo._environments import _DOOR_WORDS, CORRIDOR_SIZE_ENV, CorridorEnvironment
    from ors_trl.testing import ReferenceServer

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(seed)
    random.seed(seed)
    if arm == "shuffled":
        shuffle_credit(seed)
    started = time.perf_counter()
    vocabulary = _DOOR_WORDS[:words]
    name = CorridorEnvironment.__name__.lower()
    with ReferenceServer([CorridorEnvironment], env={CORRIDOR_SIZE_ENV: f"{rooms}:{words}"}) as server, \
            tempfile.TemporaryDirectory() as out:
        spec = OpenRewardSpec(server.url, env_name=name, reward="sum", unscored_reward=0.0,
                              credit="episode" if arm == "outcome" else "turn")
        try:
            factory = spec.environment_factory
            tools = _recipe.environment_tools(factory())
            rows = list(spec.train_dataset)
            shown = []
            for row in rows:  # what TRL's loop shows: the row's prompt with the environment's appended
                adapter = factory()
                observation = adapter.reset(**row)
                last = row["prompt"][-1]
                shown.append([*row["prompt"][:-1], {**last, "content": last["content"] + observation}])
                adapter.episode.release()
            tasks = [{"rooms": rooms}] * len(rows)
            walks = corridor_conversations(tasks, shown, vocabulary, random.Random(seed))
            from transformers.utils.chat_template_utils import render_jinja_template

            corpus, _ = render_jinja_template(walks, tools=tools, chat_template=_model.chat_template())
            tokenizer = _model.build_tokenizer(corpus, isolate=vocabulary)
            model = _model.build_model(tokenizer, seed=seed)
            warm_start(model, tokenizer, walks, tools, seed, sft_steps)
            config = _recipe.grpo_config_kwargs(
                steps, seed, out, "corridor", per_device_train_batch_size=prompts * generations,
                num_generations=generations, max_tool_calling_iterations=rooms + 1,
                max_completion_length=48 * (rooms + 2), logging_steps=1)
            trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=GRPOConfig(**config),
                                  train_dataset=spec.train_dataset, reward_funcs=spec.reward_funcs,
                                  environment_factory=factory)
            for printer in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(printer)
            trainer.train()
        finally:
            spec.close()
    history = trainer.state.log_history
    success = [h[f"env/{name}/success_rate"] for h in history if f"env/{name}/success_rate" in h]
    returns = [h["reward"] for h in history if "reward" in h]
    per_step = prompts * generations
    reached = next((k + 1 for k in range(WINDOW - 1, len(success))
                    if statistics.fmean(success[k - WINDOW + 1:k + 1]) >= TARGET[0]), None)
    return {"arm": arm, "seed": seed, "success": success, "returns": returns,
            "episodes_to_target": None if reached is None else reached * per_step,
            "success_end": statistics.fmean(success[-WINDOW:]) if success else 0.0,
            "return_end": statistics.fmean(returns[-WINDOW:]) if returns else 0.0,
            "seconds": time.perf_counter() - started}


TARGET = [0.7]  # set by --target (a list: the spawned workers read the module's default)


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [(arm, seed) for seed in args.seeds for arm in args.arms]  # each in a fresh process (the control patches)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_set_target,
                                                initargs=(args.target,), max_tasks_per_child=1) as executor:
        futures = [executor.submit(train_one, arm, seed, args.steps, args.rooms, args.words, args.prompts,
                                   args.generations, args.sft_steps) for arm, seed in runs]
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            print(f"  {row['arm']:9} seed {row['seed']}: episodes to {args.target}: {row['episodes_to_target']}  "
                  f"success (last {WINDOW} steps) {row['success_end']:.3f}  return {row['return_end']:.3f}  "
                  f"({row['seconds']:.0f} s)", flush=True)
        return [future.result() for future in futures]


def _set_target(target: float) -> None:
    TARGET[0] = target


def median_episodes(rows: list[dict[str, Any]]) -> float:
    """The median over seeds of the episodes to the target, a run that never reached it counting as never."""
    return statistics.median_high([r["episodes_to_target"] if r["episodes_to_target"] is not None else math.inf
                                   for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, small batches (~3 min)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 25; quick 3)")
    parser.add_argument("--rooms", type=int, default=3, help="rooms per corridor (default 3)")
    parser.add_argument("--words", type=int, default=2, help="door words in use (default 2: chance 1/2 a door)")
    parser.add_argument("--prompts", type=int, default=None, help="tasks per step (default 8; quick 4)")
    parser.add_argument("--generations", type=int, default=None, help="rollouts per task (default 4)")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default 80; quick 20)")
    parser.add_argument("--target", type=float, default=0.7, help="training success to reach (default 0.7)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU thread each)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    quick = args.quick
    args.steps = args.steps or (3 if quick else 25)
    args.prompts = args.prompts or (4 if quick else 8)
    args.generations = args.generations or 4
    args.sft_steps = args.sft_steps or (20 if quick else 80)
    per_step = args.prompts * args.generations
    print(f"corridor of {args.rooms} rooms, {args.words} door words, reward=sum, {args.rooms + 1} tool turns; "
          f"{args.steps} GRPO steps of {per_step} episodes ({args.prompts} tasks x {args.generations}); seeds "
          f"{args.seeds}; {args.jobs} at a time" + (" [quick: a smoke run, too short to learn]" if quick else ""),
          flush=True)
    started = time.perf_counter()
    rows = run_all(args)
    print()
    print(f"{'arm':10}{'median episodes to ' + str(args.target):>26}{'reached':>9}{'per seed':>24}"
          f"{'success end':>13}{'return end':>12}{'vs outcome':>12}")
    base = median_episodes([r for r in rows if r["arm"] == "outcome"]) if "outcome" in args.arms else math.inf
    summary = []
    for arm in args.arms:
        mine = [r for r in rows if r["arm"] == arm]
        median = median_episodes(mine)
        ratio = base / median if math.isfinite(base) and math.isfinite(median) else None
        seeds = " ".join("--" if r["episodes_to_target"] is None else str(r["episodes_to_target"]) for r in mine)
        summary.append({"arm": arm, "median_episodes": None if median == math.inf else median,
                        "reached": sum(r["episodes_to_target"] is not None for r in mine), "runs": len(mine),
                        "success_end": statistics.fmean(r["success_end"] for r in mine),
                        "return_end": statistics.fmean(r["return_end"] for r in mine), "ratio": ratio})
        s = summary[-1]
        print(f"{arm:10}{s['median_episodes'] if s['median_episodes'] is not None else '--':>26}"
              f"{s['reached']:>6}/{s['runs']:<2}{seeds:>24}{s['success_end']:>13.3f}{s['return_end']:>12.3f}"
              f"{(f'{ratio:.2f}x' if ratio is not None else '--'):>12}")
    print(f"success end / return end: the training rollouts' mean over the last {WINDOW} steps (return: the sum of "
          f"per-call rewards, {0.1 * (args.rooms - 1) + 1.0:.1f} at best); vs outcome: outcome's median episodes / "
          f"the arm's. {time.perf_counter() - started:.0f} s in all.")
    if args.json:
        print(json.dumps({"args": vars(args), "runs": rows, "summary": summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
