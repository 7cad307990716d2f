"""Train on an openreward.ai catalog environment.

    export OPENREWARD_API_KEY=...        # https://openreward.ai/keys
    python examples/train_catalog.py Eigent/SETA --model Qwen/Qwen3-4B

Uses the concurrent rollout engine (`rollout_func`): every episode of a batch runs at once, so a
step waits for the slowest episode, not for the sum of all of them. `episode_timeout` keeps one
straggling sandbox from holding the step. Every finished episode is written to `episodes.jsonl`.
"""

import argparse

import torch
from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("name", help="catalog name, e.g. Eigent/SETA or kanishk/EndlessTerminals")
parser.add_argument("--model", default="Qwen/Qwen3-4B")
parser.add_argument("--num-tasks", type=int, default=64)
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--max-completion-length", type=int, default=4096, help="tokens per episode, tool replies included")
parser.add_argument("--output-dir", default="trainer_output")
parser.add_argument("--episode-log", default="episodes.jsonl")
args = parser.parse_args()

spec = OpenRewardSpec(args.name, num_tasks=args.num_tasks, episode_timeout=900, episode_log=args.episode_log)
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(output_dir=args.output_dir, num_generations=8, max_steps=args.max_steps,
                    max_completion_length=args.max_completion_length, max_tool_calling_iterations=20,
                    logging_steps=1, use_cpu=not torch.cuda.is_available()),
    train_dataset=spec.train_dataset,
    rollout_func=spec.rollout_func,
    reward_funcs=spec.reward_funcs,
    callbacks=spec.callbacks,
)
trainer.train()
