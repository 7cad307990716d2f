"""The demo's training recipe: a supervised warm start, the GRPO configuration that learns, and the evaluation.

The warm start builds the token ids GRPO trains on: the prompt rendered with TRL's training template
(`Rendering.for_training`), then call, tool suffix and final message joined at the token level as TRL's tool loop
joins them (a re-render would differ: an empty `<think>` block the model never generated).
"""

from __future__ import annotations

import functools
import inspect
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from ..core.metrics import EpisodeStats
from ._model import EOS_TOKEN, episode_parts, tool_call_message


def environment_tools(environment: Any) -> list[Callable]:
    """The tool methods TRL exposes for an environment instance (public methods but reset/get_reward)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def rendering(tokenizer: Any) -> Any:
    """How GRPO renders and parses with this tokenizer (the engine's `Rendering` too)."""
    from ors_trl.trl.backend import Rendering

    out = Rendering.for_training(tokenizer)
    if out.parse_error is not None:
        raise ValueError("TRL did not recognise the chat template; it must be trl/chat_templates/qwen3.jinja verbatim")
    return out


def tool_call_text(tokenizer: Any, name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the template renders for one tool call, up to its end-of-turn token (a non-final turn: no
    empty `<think>` block)."""
    header = "<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "x"}, tool_call_message(name, arguments),
                {"role": "tool", "name": name, "content": "x"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    start = rendered.index(header) + len(header)
    return rendered[start:rendered.index(EOS_TOKEN, start) + len(EOS_TOKEN)]


def warm_start(model: Any, tokenizer: Any, tasks: Sequence[dict[str, Any]], seed: int, *, tools: Sequence,
               prompt_fn: Callable[[dict[str, Any]], str | list[dict[str, Any]]],
               episodes_fn: Callable[[dict[str, Any]], Sequence[tuple[Any, ...]]], steps: int = 80,
               batch_size: int = 36, learning_rate: float = 3e-3, warmup_steps: int = 5,
               weight_decay: float = 0.0) -> None:
    """Teach the tool-call *format*, not the answer: a supervised loop (assistant-only loss) over `prompt_fn(task)`
    then each of `episodes_fn(task)`, one per allowed answer. A batch holds all of a task's episodes (less label noise
    than one random episode each), so the loss is least for a call uniform over the answers, whatever the prompt."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    rng = random.Random(seed)
    render = rendering(tokenizer)

    @functools.cache
    def examples(index: int) -> list[tuple[Any, Any]]:
        """The task's rollouts as (input ids, labels: -100 where the model did not write)."""
        prompt = prompt_fn(tasks[index])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        ids = render.prompt_ids(messages, list(tools))
        out = []
        for name, arguments, reply, final in map(episode_parts, episodes_fn(tasks[index])):
            call = tokenizer.encode(tool_call_text(tokenizer, name, arguments), add_special_tokens=False)
            suffix = render.tool_suffix_ids([{"role": "tool", "name": name, "content": reply}])
            last = tokenizer.encode(final + EOS_TOKEN, add_special_tokens=False)
            labels = [-100] * len(ids) + call + [-100] * len(suffix) + last
            out.append((torch.tensor(ids + call + suffix + last), torch.tensor(labels)))
        return out

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, steps - warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    order: list[int] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            batch: list[tuple[Any, Any]] = []
            while len(batch) < batch_size:
                if not order:  # walk the tasks in a fresh random order each epoch
                    order = list(range(len(tasks)))
                    rng.shuffle(order)
                batch.extend(examples(order.pop()))
            input_ids = pad_sequence([ids for ids, _ in batch], batch_first=True, padding_value=tokenizer.pad_token_id)
            attention = pad_sequence([torch.ones_like(ids) for ids, _ in batch], batch_first=True)
            labels = pad_sequence([wrote for _, wrote in batch], batch_first=True, padding_value=-100)
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()


def grpo_config_kwargs(steps: int, seed: int, output_dir: str, task: str, **overrides: Any) -> dict[str, Any]:
    """`GRPOConfig` keywords that make the tiny model learn from the environment's reward on CPU (`task` "look":
    `LOOK_RECIPE` on top; `overrides` replace any entry)."""
    import dataclasses

    from transformers import TrainingArguments

    # checkpointing is on by default: pure overhead at 0.5M parameters (~30% of a step); newer transformers renamed it
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    kwargs: dict[str, Any] = {
        "output_dir": output_dir, "max_steps": steps, "seed": seed, "data_seed": seed,
        "learning_rate": 3e-4,  # TRL's default 1e-6 does nothing at this scale; >= 5e-4 tends to break the format
        "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
        "per_device_train_batch_size": 64,  # rollouts per step: 8 prompts x 8 generations
        "num_generations": 8,  # with 4 (16 prompts), more groups got identical rewards and runs stalled more often
        "gradient_accumulation_steps": 1,
        # Counts the tool reply too: call (13 tokens) + tool suffix (~11) + "Done." (3) = ~27. A tight cap also bounds
        # the rambling that appears after wrong calls late in training (GRPO pushes "Done." down in failed rollouts).
        "max_completion_length": 32,
        "max_tool_calling_iterations": 1,  # one call is executed; the post-tool turn just closes the episode
        "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "beta": 0.0,  # no reference model: cheaper, and a KL anchor (0.05) stopped learning in a short test
        "num_iterations": 1, "scale_rewards": "group",
        "logging_steps": 10, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "log_completions": False,
        checkpointing: False,
        "use_cpu": True, "bf16": False, "fp16": False, "dataloader_num_workers": 0,
    }
    return {**kwargs, **(LOOK_RECIPE if task == "look" else {}), **overrides}


#: The look task's warm start: 50 steps give a steady format (look, then one word) at temperature 1.
LOOK_WARM_START: dict[str, Any] = {"steps": 50}

#: What the look task changes in the echo recipe (see the tuning notes in `ors_trl.demo.__init__`).
LOOK_RECIPE: dict[str, Any] = {
    # After the warm start the look call has p ~0.97; the rare rollout that answers without looking scores at chance
    # like every other, its low-probability first token takes large GRPO steps, and in one seed of three the policy
    # drifted into never looking. The cut removes those tails (and malformed calls); the six words, ~1/6 each, stay.
    "top_p": 0.95,
    # look call (13 tokens) + tool turn (14-20) + answer and <|im_end|> (2): 29-35; room for the longest held-out
    # sentence, and rambling answers are cut off early.
    "max_completion_length": 40,
}


def evaluate_policy(model: Any, tokenizer: Any, spec: Any, *, flatten_system: bool, look_tool: str | None = None,
                    output: str | None = None, repeats: int = 1, temperature: float = 0.0) -> dict[str, Any]:
    """Roll the model out `repeats` times per task of `spec` as GRPO plays it (greedy unless `temperature`, 32 new
    tokens a turn, 2 turns); `mean_reward` counts unscored as 0. With `look_tool`: `look_rate`, `answered_rate` (graded
    by the terminal tool), `follow_rate` (answered what it showed), `no_look_success` (None: every episode looked)."""
    from ors_trl import LocalPolicy

    was_training = model.training
    model.eval()
    policy = LocalPolicy(model, tokenizer, temperature=temperature, max_new_tokens=32, seed=0,
                         chat_template=rendering(tokenizer).chat_template, name="demo-policy")
    report = spec.evaluate(policy, concurrency=64, max_turns=2, progress=False, flatten_prompt=flatten_system,
                           repeats=repeats, **({"output": output, "overwrite": True} if output else {}))
    if was_training:
        model.train()
    episodes = report.episodes
    n = max(len(episodes), 1)
    calls = sum(e["tool_calls"] for e in episodes)
    out: dict[str, Any] = {
        "success_rate": report.success_rate,
        "tool_call_rate": sum(e["tool_calls"] > 0 for e in episodes) / n,
        "tool_failure_rate": sum(e["tool_failures"] for e in episodes) / calls if calls else 0.0,
        "mean_reward": sum(e.get("reward") or 0.0 for e in episodes) / n,
        "n": len(episodes),
        "seconds": report.seconds,
        "report": report,
    }
    if look_tool is not None:
        def looked(e: dict[str, Any]) -> bool:
            return any(c.get("name") == look_tool for t in e.get("turns") or [] for c in t.get("tool_calls") or [])

        blind = [e for e in episodes if not looked(e)]
        blind_stats = EpisodeStats(report.success_threshold)
        for e in blind:
            blind_stats.add_record(e)
        finals = [e.get("final") or {} for e in episodes]
        out.update({
            "look_rate": sum(map(looked, episodes)) / n,
            "turns": sum(len(e.get("turns") or []) for e in episodes) / n,
            "answered_rate": sum("tool" in f and "reward" in f for f in finals) / n,
            "follow_rate": sum(bool((f.get("metadata") or {}).get("follow")) for f in finals) / n,
            "no_look_n": len(blind),
            "no_look_success": blind_stats.success_rate if blind else None,
        })
    return out
