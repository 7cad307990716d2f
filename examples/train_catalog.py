"""Train on an openreward.ai catalog environment.

    export OPENREWARD_API_KEY=...        # https://openreward.ai/keys
    python examples/train_catalog.py Eigent/SETA --model Qwen/Qwen3-4B

Uses the concurrent rollout engine (`rollout_func`): every episode of a batch runs at once, so a
step waits for the slowest episode, not for the sum of all of them. `episode_timeout` keeps one
straggling sandbox from holding the step.
"""

import argparse

from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("name", help="catalog name, e.g. Eigent/SETA or kanishk/EndlessTerminals")
parser.add_argument("--model", default="Qwen/Qwen3-4B")
parser.add_argument("--num-tasks", type=int, default=64)
args = parser.parse_args()

spec = OpenRewardSpec(args.name, num_tasks=args.num_tasks, episode_timeout=900, episode_log="episodes.jsonl")
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(num_generations=8, max_steps=100, max_completion_length=4096, max_tool_calling_iterations=20,
                    logging_steps=1),
    train_dataset=spec.train_dataset,
    rollout_func=spec.rollout_func,
    reward_funcs=spec.reward_funcs,
    callbacks=spec.callbacks,
)
trainer.train()
