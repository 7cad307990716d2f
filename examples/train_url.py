"""Train on a self-hosted ORS environment given by URL.

    ors-trl serve-echo --port 8000 &                          # or your own ORS server
    python examples/train_url.py http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B

The three spec properties plug straight into GRPOTrainer; `callbacks=spec.callbacks` releases
sessions at the end of every step instead of at the next reset (optional).
"""

import argparse

import torch
from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("url", help="ORS server URL, e.g. http://127.0.0.1:8000")
parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model name or local path")
parser.add_argument("--env-name", default=None, help="environment on a server hosting several")
parser.add_argument("--num-tasks", type=int, default=64)
parser.add_argument("--max-steps", type=int, default=50)
parser.add_argument("--max-completion-length", type=int, default=1024, help="tokens per episode, tool replies included")
parser.add_argument("--output-dir", default="trainer_output")
args = parser.parse_args()

spec = OpenRewardSpec(args.url, env_name=args.env_name, num_tasks=args.num_tasks)
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(output_dir=args.output_dir, num_generations=4, max_steps=args.max_steps,
                    max_completion_length=args.max_completion_length, max_tool_calling_iterations=8,
                    logging_steps=1, use_cpu=not torch.cuda.is_available()),
    train_dataset=spec.train_dataset,
    environment_factory=spec.environment_factory,
    reward_funcs=spec.reward_funcs,
    callbacks=spec.callbacks,
)
trainer.train()
