"""One short, real GRPO training against an ORS server, run by each process of `accelerate launch`.

Launched by tests/test_distributed.py (two processes, gloo on CPU; `--multi_gpu` because `--cpu` would start
only one process, and `GRPOConfig(use_cpu=True)` below keeps it on CPU):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        tests/distributed/grpo_run.py --url http://127.0.0.1:PORT --model-dir DIR --out DIR --mode env|engine

`--mode env` wires the spec's three properties (`environment_factory` path, TRL's own tool loop);
`--mode engine` uses `spec.rollout_func` (the concurrent engine); `--mode harness` the engine with every episode
played by `Harness(agent).rollout_func(spec)`, the agent `tests.test_harness.agents_sdk()` (an OpenAI Agents SDK
program: the model over the episode's capture endpoint, the tools over MCP); `--sampling adaptive` draws the tasks as training
goes (`task_sampling="adaptive"`); `--credit` trains with `credit="turn"` (rewards summed, `scale_rewards="batch"`,
so a turn's advantage depends on the other process's rollouts too). Generation is a scripted double
(`tests.fixtures.generation.replace_generation`, so tools really get called), everything else is real: DDP
forward, backward and optimizer steps, TRL's reward gathering, metric gathering and logging.

The scripted model, per rollout: first turn, the even positions of the generation call echo the
right word (reward 1.0), the odd ones echo "nope" (reward 0.0); in harness mode, where the calls' order is the
agents' arrival order, the first rollout of a task in a step to ask echoes the right word, the other "nope" (so
each group has one of each, a gradient). After a wrong echo, rank 0 tries
"nope" once more (a third turn), every other rank says "Done.". So rank 0 has more turns than
rank 1, which is what makes the engine pad its generation calls.

Each process writes `<out>/report-<mode>-rank<r>.json`: what it saw and did (sessions it opened,
the rows TRL handed it per step, its generation calls, local rewards and metrics, log history,
parameter hashes). With `--fork-check`, rank 0 also forks after training and checks that the child
gets its own background loop and sessions while the parent's session stays valid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
import traceback
import urllib.request

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

torch.set_num_threads(1)

from ors_trl import OpenRewardSpec  # noqa: E402
from tests.fixtures.generation import (  # noqa: E402
    cpu_grpo_trainer,
    replace_generation,
    tool_call_text,
    train_sampler,
    trl_tokenizer,
    wrap_generate_and_score,
    wrap_metric_log,
)

ENV_NAME = "echoenvironment"
_TARGET = re.compile(r'exactly this text: "([^"]+)"')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("env", "engine", "harness"), required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--num-tasks", type=int, default=8)
    p.add_argument("--fork-check", action="store_true")
    p.add_argument("--sampling", choices=("uniform", "adaptive"), default="uniform")
    p.add_argument("--credit", action="store_true", help="credit='turn', rewards summed, scale_rewards='batch'")
    return p.parse_args(argv)


def params_hash(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def dataset_fingerprint(ds) -> str:
    payload = {name: list(ds[name]) for name in ("task_index", "prompt", "target")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def scripted_generation(trainer, rank: int, calls: list, right=lambda pos, target: pos % 2 == 0):
    tok = trl_tokenizer(trainer)

    def call(text: str) -> list[int]:
        return tok.encode(tool_call_text("echo", {"text": text}) + "<|im_end|>", add_special_tokens=False)

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        responses = [tok.decode(ids).count("<tool_response>") for ids in prompt_ids]
        calls.append({"step": trainer.state.global_step, "n": len(prompt_ids), "responses": responses})
        out = []
        for pos, ids in enumerate(prompt_ids):
            text = tok.decode(ids)
            target = _TARGET.findall(text)[0]
            n = responses[pos]
            if n == 0:
                out.append(call(target if right(pos, target) else "nope"))
            elif n == 1 and rank == 0 and text.rsplit("<tool_response>", 1)[1].strip().startswith("nope"):
                out.append(call("nope"))
            else:
                out.append(tok.encode("Done.<|im_end|>", add_special_tokens=False))
        return out, None

    return generate


def credit_rows(batch, episodes) -> list[dict]:
    """Each local rollout's turn returns and, per trained span (a model reply), the advantages its tokens got."""
    from ors_trl.trl.credit import turn_spans

    rows = []
    for i, ep in enumerate(episodes):
        kept = batch["completion_mask"][i].bool()
        mask, advantages = batch["tool_mask"][i][kept].tolist(), batch["advantages"][i][kept].tolist()
        rows.append({"returns": ep.turn_returns(), "spans": [advantages[a:b] for a, b in turn_spans(mask)]})
    return rows


def fork_check(spec: OpenRewardSpec, url: str, out_path: str) -> dict:
    """Fork after the spec was used; the child must get a fresh loop and its own sessions, the parent keeps its own."""
    import ors_trl.protocol.loop as loop_module
    from ors_trl import Client

    parent_loop = loop_module.get_loop()
    held = spec.run(spec.client.open_session(split="train", index=0))  # the parent's live session across the fork
    child_path = out_path + ".child.json"
    pid = os.fork()
    if pid == 0:  # the child: report, then exit the way multiprocessing's fork children do
        result: dict = {"pid": os.getpid()}
        code = 0
        try:
            result["loop_reset_after_fork"] = loop_module._current is None
            client = Client(url, env_name=ENV_NAME)
            child_loop = loop_module.get_loop()
            result["fresh_loop"] = (child_loop is not parent_loop and child_loop.pid == os.getpid()
                                    and child_loop.thread.is_alive())
            first = client.open_session(split="train", index=1)
            second = client.open_session(split="train", index=2)
            result["sids"] = [first.sid, second.sid]
            result["reward"] = first.call("echo", {"text": "world"}).reward
            first.close()
            result["left_open_for_exit_hook"] = second.sid
            # The parent's objects must not be usable by mistake (nor hang): the spec's client and an adapter.
            result["inherited_client"] = _bounded(lambda: spec.run(spec.client.num_tasks("train")))
            adapter = spec.environment_factory()
            result["inherited_reset_cached"] = _bounded(lambda: adapter.reset(task_index=3))
            result["inherited_tool_call"] = _bounded(lambda: adapter.echo(text="openreward"))
            result["inherited_reset_uncached"] = _bounded(lambda: spec.environment_factory().reset(task_index=9))
        except BaseException:
            result["error"] = traceback.format_exc()
            code = 1
        with open(child_path, "w") as f:
            json.dump(result, f)
        threading._shutdown()  # runs the ors-trl exit hook (registered with threading._register_atexit)
        os._exit(code)
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    child = {"error": "no child report"}
    if os.path.exists(child_path):
        with open(child_path) as f:
            child = json.load(f)
    child["exit_status"] = status
    # The parent's session survived the child (its exit hook did not touch it) and still works.
    with urllib.request.urlopen(url + "/_test/stats", timeout=10) as resp:
        live = json.load(resp)["sessions"]
    reward = spec.run(held.call("echo", {"text": "nope"})).reward
    parent = {"sid": held.sid, "reward_after_fork": reward, "loop_same": loop_module.get_loop() is parent_loop,
              "server_sessions_after_child_exit": live}
    spec.run(held.close())
    return {"child": child, "parent": parent}


def _bounded(fn, seconds: float = 5.0) -> str:
    """Run fn in a thread; say whether it returned, raised (and what) or hung."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = repr(fn())
        except BaseException as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return "hung"
    return "raised " + box["error"] if "error" in box else "returned " + box["value"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import TrainerCallback

    rank = int(os.environ.get("RANK", "0"))
    report: dict = {"rank": rank, "pid": os.getpid(), "mode": args.mode, "opened": [], "batches": [],
                    "generate_calls": [], "rewards": [], "local_metrics": [], "on_log_calls": 0, "peak_open": 0,
                    "open_at_step_end": [], "credit": []}
    phase = ["setup"]

    # A fixed gather window: each turn's rollouts share one generation call, so the calls the test counts are fixed.
    spec = OpenRewardSpec(args.url, env_name=ENV_NAME, num_tasks=args.num_tasks, gather_window=1.0,
                          task_sampling=args.sampling, **({"credit": "turn", "reward": "sum"} if args.credit else {}))
    sampled = args.sampling != "uniform"
    client = spec.client
    real_open = client.open_session

    async def open_session(**kwargs):
        record = {"index": kwargs.get("index"), "phase": phase[0], "pid": os.getpid()}
        session = await real_open(**kwargs)
        record["sid"] = session.sid
        report["opened"].append(record)
        report["peak_open"] = max(report["peak_open"], client.open_sessions)
        return session

    client.open_session = open_session

    if not sampled:  # a sampled dataset is a stream: no rows to fingerprint, no sampler order
        report["dataset_fingerprint"] = dataset_fingerprint(spec.train_dataset)
        task_of_row = list(spec.train_dataset["task_index"])

    def outcome_reward(environments=None, **kwargs):
        rewards = spec.reward_funcs(environments=environments, **kwargs)
        report["rewards"].append({"step": trainer.state.global_step, "rewards": rewards})
        return rewards

    class Recorder(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **kwargs):
            report["on_log_calls"] += 1

        def on_step_end(self, args_, state, control, **kwargs):
            report["open_at_step_end"].append(client.open_sessions)  # before spec.callbacks release anything

    harness_kwargs = {}
    if args.mode == "harness":
        from ors_trl.harness import Harness
        from tests.test_harness import agents_sdk

        harness_kwargs["rollout_func"] = Harness(agents_sdk()).rollout_func(spec)
        report["harness_episodes"] = []
    trainer = cpu_grpo_trainer(args.model_dir, os.path.join(args.out, f"trainer-{args.mode}"), completion_length=128,
                               spec=spec, mode="env" if args.mode == "env" else "engine", reward_funcs=outcome_reward,
                               **harness_kwargs,
                               callbacks=[Recorder(), *spec.callbacks],
                               config={"learning_rate": 1e-3, "max_steps": args.steps, "seed": 42,
                                       "dataloader_num_workers": 0,
                                       **({"scale_rewards": "batch"} if args.credit else {})})
    config, acc = trainer.args, trainer.accelerator
    report.update(
        process_index=acc.process_index, num_processes=acc.num_processes, is_main_process=acc.is_main_process,
        is_world_process_zero=trainer.is_world_process_zero(),
        backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        generation_batch_size=config.generation_batch_size, per_device_batch=config.per_device_train_batch_size,
        sampler_task_order=[] if sampled else [task_of_row[i] for i in train_sampler(trainer)],
        params_before=params_hash(trainer.model),
    )

    asked: set = set()  # harness mode: (step, target) pairs already answered right

    def right(pos, target):
        if args.mode != "harness":
            return pos % 2 == 0
        key = (trainer.state.global_step, target)
        return key not in asked and not asked.add(key)

    replace_generation(trainer, scripted_generation(trainer, rank, report["generate_calls"], right))

    def generate_and_score(real, inputs):
        step = trainer.state.global_step
        phase[0] = f"step{step}"
        report["batches"].append({"step": step, "task_index": [row["task_index"] for row in inputs]})
        try:
            result = real(inputs)
            if args.credit:  # per local row: its turn returns, and the advantage on each of its trained spans
                report["credit"].append({"step": step, "rows": credit_rows(result, spec.rollout_func.last_episodes)})
            for ep in harness_kwargs["rollout_func"].last_episodes if harness_kwargs else ():
                report["harness_episodes"].append({"step": step, "task_index": ep.task.index, "reward": ep.reward,
                                                   "sid": ep.session.sid if ep.session else None,
                                                   "harness": ep.info.get("harness")})
            return result
        finally:
            phase[0] = "between"

    def log_metric(real, name, value):
        report["local_metrics"].append({"step": trainer.state.global_step, "name": name, "value": value})
        real(name, value)

    wrap_generate_and_score(trainer, generate_and_score)
    wrap_metric_log(trainer, log_metric)

    trainer.train()
    phase[0] = "after"
    report["params_after"] = params_hash(trainer.model)
    report["log_history"] = trainer.state.log_history
    report["client_open_sessions_after_train"] = client.open_sessions
    report["global_step"] = trainer.state.global_step
    if sampled:
        report["sampler_state"] = spec.curriculum.sampler.state_dict()
    if args.mode == "engine":
        report["engine_last_episodes"] = [
            {"task_index": ep.task.index, "sid": ep.session.sid if ep.session else None, "reward": ep.reward}
            for ep in spec.rollout_func.last_episodes
        ]
    out_path = os.path.join(args.out, f"report-{args.mode}{'-' + args.sampling if sampled else ''}"
                                      f"{'-credit' if args.credit else ''}-rank{rank}.json")
    if args.fork_check and acc.is_main_process:
        report["fork"] = fork_check(spec, args.url, out_path)
    spec.close()
    report["client_open_sessions_after_close"] = client.open_sessions
    with open(out_path, "w") as f:
        json.dump(report, f, default=str)
    acc.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
