"""Train on several environments at once, with mixture weights and per-environment metrics.

    export OPENREWARD_API_KEY=...
    python examples/train_mix.py --model Qwen/Qwen3-4B                # EndlessTerminals + SETA, 50/50
    python examples/train_mix.py kanishk/EndlessTerminals Eigent/SETA http://127.0.0.1:8000 --weights 0.4 0.4 0.2

Targets are catalog names and/or URLs. Each row of the dataset carries TRL's `environment` column; TRL
shows each environment's tools only in its own rows; every rollout is scored by its own environment.
Metrics appear per environment as `env/<name>/reward_mean`, `env/<name>/graded_fraction`,
`env/<name>/failures/...` and so on.
"""

import argparse

import torch
from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardMix, OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("targets", nargs="*", default=["kanishk/EndlessTerminals", "Eigent/SETA"],
                    help="catalog names and/or ORS server URLs (default: kanishk/EndlessTerminals Eigent/SETA)")
parser.add_argument("--weights", type=float, nargs="*", default=None, help="one per target (default: equal)")
parser.add_argument("--model", default="Qwen/Qwen3-4B")
parser.add_argument("--num-tasks", type=int, default=64, help="tasks per environment")
parser.add_argument("--max-steps", type=int, default=100)
parser.add_argument("--max-completion-length", type=int, default=4096, help="tokens per episode, tool replies included")
parser.add_argument("--output-dir", default="trainer_output")
parser.add_argument("--episode-log", default="episodes.jsonl")
args = parser.parse_args()

mix = OpenRewardMix([OpenRewardSpec(t, num_tasks=args.num_tasks) for t in args.targets], weights=args.weights,
                    episode_log=args.episode_log)
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(output_dir=args.output_dir, num_generations=8, max_steps=args.max_steps,
                    max_completion_length=args.max_completion_length, max_tool_calling_iterations=20,
                    logging_steps=1, use_cpu=not torch.cuda.is_available()),
    train_dataset=mix.train_dataset,
    environment_factory=mix.environment_factory,  # or rollout_func=mix.rollout_func
    reward_funcs=mix.reward_funcs,
    callbacks=mix.callbacks,
)
trainer.train()
