"""Train on a self-hosted ORS environment given by URL.

    ors-trl serve-echo --port 8000 &                          # or your own ORS server
    python examples/train_url.py http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B

The three spec properties plug straight into GRPOTrainer; `callbacks=spec.callbacks` releases
sessions at the end of every step instead of at the next reset (optional).
"""

import argparse

from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("url", help="ORS server URL, e.g. http://127.0.0.1:8000")
parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model name or local path")
parser.add_argument("--env-name", default=None, help="environment on a server hosting several")
parser.add_argument("--num-tasks", type=int, default=64)
args = parser.parse_args()

spec = OpenRewardSpec(args.url, env_name=args.env_name, num_tasks=args.num_tasks)
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(num_generations=4, max_steps=50, max_completion_length=1024, max_tool_calling_iterations=8,
                    logging_steps=1),
    train_dataset=spec.train_dataset,
    environment_factory=spec.environment_factory,
    reward_funcs=spec.reward_funcs,
    callbacks=spec.callbacks,
)
trainer.train()
