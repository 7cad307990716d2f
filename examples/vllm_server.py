"""GRPO on an ORS environment with several training processes and vLLM generating (server or colocate mode).

One node, 4 GPUs: GPU 0 serves the model with vLLM, GPUs 1-3 train (one process each)::

    ors-trl serve-echo --port 8001 &                        # the ORS server (or your own / a catalog name)
    CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model Qwen/Qwen3-0.6B --port 8000 &
    CUDA_VISIBLE_DEVICES=1,2,3 accelerate launch --multi_gpu --num_processes 3 \\
        examples/vllm_server.py http://127.0.0.1:8001 --model Qwen/Qwen3-0.6B --vllm-port 8000

Colocate mode (no separate vLLM server; every training process holds its own vLLM engine)::

    accelerate launch --multi_gpu --num_processes 4 examples/vllm_server.py http://127.0.0.1:8001 --colocate

A catalog environment instead of a URL: ``export OPENREWARD_API_KEY=...`` on every node (every process
opens its own sessions with it), then pass the name, e.g. ``Eigent/SETA``.

It uses ``spec.rollout_func`` (the concurrent engine), not ``environment_factory``: in vLLM server mode every
generation call gathers the prompts of all processes, so every process must make the same number of calls
with the same number of prompts. The engine does that (a process that has run out of work joins with
dummy prompts); TRL's own tool loop makes as many calls as its own rollouts need, which can differ between
processes. Each process opens, keeps alive and closes its own sessions for its share of the batch
(``per_device_train_batch_size`` rollouts); ``--max-sessions`` caps them per process.

``--check`` only builds the dataset and binds the tools in every process (no GPU, no vLLM): a quick way
to see that every node reaches the ORS server before a long launch.
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="ORS server URL (http://HOST:PORT) or catalog name (needs OPENREWARD_API_KEY)")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model name or local path (the one vLLM serves)")
    p.add_argument("--env-name", default=None, help="environment on a server hosting several")
    p.add_argument("--num-tasks", type=int, default=64)
    p.add_argument("--colocate", action="store_true", help="vllm_mode='colocate' instead of 'server'")
    p.add_argument("--vllm-host", default="127.0.0.1", help="host of `trl vllm-serve` (server mode)")
    p.add_argument("--vllm-port", type=int, default=8000, help="port of `trl vllm-serve` (server mode)")
    p.add_argument("--per-device-batch", type=int, default=8, help="rollouts per process per step")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--max-completion-length", type=int, default=2048)
    p.add_argument("--max-tool-calling-iterations", type=int, default=10)
    p.add_argument("--max-sessions", type=int, default=None, help="cap on sessions open at once, per process")
    p.add_argument("--episode-timeout", type=float, default=None, help="seconds before an episode is scored None")
    p.add_argument("--output-dir", default="ors-grpo-vllm")
    p.add_argument("--check", action="store_true", help="build the dataset and tools in every process, then exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ors_trl import OpenRewardSpec

    spec = OpenRewardSpec(args.target, env_name=args.env_name, num_tasks=args.num_tasks,
                          max_sessions=args.max_sessions, episode_timeout=args.episode_timeout)
    if args.check:
        rank = os.environ.get("RANK", "0")
        tools = [t.name for t in spec.tool_specs]
        print(f"rank {rank} pid {os.getpid()}: {len(spec.train_dataset)} tasks from {spec.name}, tools {tools}")
        spec.close()
        return 0

    from trl import GRPOConfig, GRPOTrainer

    vllm = {"vllm_mode": "colocate"} if args.colocate else {
        "vllm_mode": "server", "vllm_server_host": args.vllm_host, "vllm_server_port": args.vllm_port}
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_vllm=True,
        **vllm,
        per_device_train_batch_size=args.per_device_batch,
        num_generations=args.num_generations,
        max_steps=args.max_steps,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        logging_steps=1,
        bf16=True,
    )
    trainer = GRPOTrainer(
        model=args.model,
        args=config,
        train_dataset=spec.train_dataset,
        rollout_func=spec.rollout_func,
        reward_funcs=spec.reward_funcs,
        callbacks=spec.callbacks,
    )
    try:
        trainer.train()
    finally:
        spec.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
