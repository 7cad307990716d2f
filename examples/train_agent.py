"""Train the agent you ship: an OpenAI Agents SDK program plays ORS episodes with its own loop, and GRPO trains the
model behind its endpoint on exactly the tokens it generated (docs/guides/agent.md).

    pip install 'ors-trl[harness]'
    ors-trl serve-echo --port 8000 &                          # or your own ORS server
    python examples/train_agent.py http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B

Per episode the agent gets an OpenAI-compatible base URL and API key (the policy being trained, served in-process by
ors-trl) and the episode's tools over MCP (URL and bearer token), all on loopback. Nothing in the agent knows it is
being trained: swap in your own program.
"""

import argparse

import torch
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp
from openai import AsyncOpenAI
from trl import GRPOConfig, GRPOTrainer

from ors_trl import Endpoint, Harness, LocalPolicy, OpenRewardSpec

set_tracing_disabled(True)  # the SDK would otherwise export traces to api.openai.com


async def agent(ep: Endpoint) -> str | None:
    """The agent as it ships: its instructions, its loop, its tools over MCP."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=ep.base_url,
                                                                                 api_key=ep.api_key, timeout=600))
    headers = {"Authorization": f"Bearer {ep.mcp_token}"}
    async with MCPServerStreamableHttp(params={"url": ep.mcp_url, "headers": headers, "timeout": 60}) as tools:
        me = Agent(name="agent", instructions=ep.system or "Solve the task with the tools.", model=model,
                   mcp_servers=[tools])
        result = await Runner.run(me, ep.prompt, max_turns=8)
    return result.final_output


parser = argparse.ArgumentParser()
parser.add_argument("url", help="ORS server URL, e.g. http://127.0.0.1:8000")
parser.add_argument("--model", default="Qwen/Qwen3-0.6B", help="model name or local path")
parser.add_argument("--env-name", default=None, help="environment on a server hosting several")
parser.add_argument("--num-tasks", type=int, default=64)
parser.add_argument("--max-steps", type=int, default=50)
parser.add_argument("--max-completion-length", type=int, default=1024, help="tokens per episode, tool replies included")
parser.add_argument("--eval-tasks", type=int, default=0, help="evaluate the agent on this many tasks first (--model a local directory)")
parser.add_argument("--output-dir", default="trainer_output")
args = parser.parse_args()

spec = OpenRewardSpec(args.url, env_name=args.env_name, num_tasks=args.num_tasks)
harness = Harness(agent, timeout=600)
if args.eval_tasks:
    report = spec.evaluate(LocalPolicy.from_pretrained(args.model, max_new_tokens=128), harness=harness,
                           num_tasks=args.eval_tasks, progress=False)
    print(report.summary())
trainer = GRPOTrainer(
    model=args.model,
    args=GRPOConfig(output_dir=args.output_dir, num_generations=4, max_steps=args.max_steps,
                    max_completion_length=args.max_completion_length, logging_steps=1,
                    use_cpu=not torch.cuda.is_available()),
    train_dataset=spec.train_dataset,
    rollout_func=harness.rollout_func(spec),
    reward_funcs=spec.reward_funcs,
    callbacks=spec.callbacks,
)
trainer.train()
spec.close()
