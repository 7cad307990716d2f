"""Train on several environments at once, with mixture weights and per-environment metrics.

    export OPENREWARD_API_KEY=...
    python examples/train_mix.py --model Qwen/Qwen3-4B

Each row of the dataset carries TRL's `environment` column; TRL shows each environment's tools only
in its own rows; every rollout is scored by its own environment. Metrics appear per environment as
`env/<name>/reward_mean`, `env/<name>/graded_fraction`, `env/<name>/failures/...` and so on.
"""

import argparse

from trl import GRPOConfig, GRPOTrainer

from ors_trl import OpenRewardMix, OpenRewardSpec

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen/Qwen3-4B")
parser.add_argument("--local", default=None, help="also mix in a self-hosted server, e.g. http://127.0.0.1:8000")
args = parser.parse_args()

specs = {
    "terminal": OpenRewardSpec("kanishk/EndlessTerminals", num_tasks=64),
    "seta": OpenRewardSpec("Eigent/SETA", num_tasks=64),
}
weights = {"terminal": 0.5, "seta": 0.5}
if args.local:
    specs["local"] = OpenRewardSpec(args.local, num_tasks=32)
    weights = {"terminal": 0.4, "seta": 0.4, "local": 0.2}

mix = OpenRewardMix(specs, weights=weights, episode_log="episodes.jsonl")
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(num_generations=8, max_steps=100, max_completion_length=4096, max_tool_calling_iterations=20,
                    logging_steps=1),
    train_dataset=mix.train_dataset,
    environment_factory=mix.environment_factory,  # or rollout_func=mix.rollout_func
    reward_funcs=mix.reward_funcs,
    callbacks=mix.callbacks,
)
trainer.train()
