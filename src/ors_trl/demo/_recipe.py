"""The demo's training recipe: a supervised warm start, the GRPO configuration that learns, and the evaluation.

The warm start teaches exactly the token sequences GRPO samples: the prompt rendered with the trainer's chat template
(TRL's prefix-preserving training variant of Qwen3's, `Rendering.for_training`) and the environment's tools, then the
tool call, TRL's tool suffix and the final message, joined at the token level as TRL's tool loop joins them. The
evaluation (`spec.evaluate` with `LocalPolicy`) builds every turn's ids as GRPO builds them (`tests/test_turns.py`);
re-rendering the conversation would not (TRL's training template renders an empty `<think>` block in the tool-call
turn, which the model never generated). A system turn is shown as the trainer shows it: joined to the user text on
the `environment_factory` path (TRL's `reset()` can only append text), a system message through `spec.rollout_func`.
"""

from __future__ import annotations

import functools
import inspect
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.metrics import EpisodeStats
from ._model import EOS_TOKEN, episode_parts, tool_call_message


def environment_tools(environment: Any) -> list[Callable]:
    """The tool methods TRL exposes for an environment instance (public methods other than reset/get_reward)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def rendering(tokenizer: Any) -> Any:
    """How GRPO renders and parses with this tokenizer: the `ors_trl.trl.backend.Rendering` the engine uses too."""
    from ors_trl.trl.backend import Rendering

    out = Rendering.for_training(tokenizer)
    if out.parse_error is not None:
        raise ValueError("TRL did not recognise the chat template; it must be trl/chat_templates/qwen3.jinja verbatim")
    return out


def tool_call_text(tokenizer: Any, name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the model's own template renders for one tool call, up to its end-of-turn token (a
    non-final turn: no empty `<think>` block), e.g. `<tool_call>\\n{"name": "echo", ...}\\n</tool_call><|im_end|>`."""
    header = "<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "x"}, tool_call_message(name, arguments),
                {"role": "tool", "name": name, "content": "x"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    start = rendered.index(header) + len(header)
    return rendered[start:rendered.index(EOS_TOKEN, start) + len(EOS_TOKEN)]


# ── warm start (supervised) ─────────────────────────────────────────────────────────────────────────────────────────


def warm_start(model: Any, tokenizer: Any, tasks: Sequence[dict[str, Any]], seed: int, *, tools: Sequence,
               prompt_fn: Callable[[dict[str, Any]], str | list[dict[str, Any]]],
               episodes_fn: Callable[[dict[str, Any]], Sequence[tuple[Any, ...]]], steps: int = 80,
               batch_size: int = 36, learning_rate: float = 3e-3, warmup_steps: int = 5, weight_decay: float = 0.0,
               log_every: int = 0) -> dict[str, Any]:
    """Teach the tool-call *format* with a short supervised loop (assistant-only loss), not the answer.

    An example is a full rollout as GRPO samples it: `prompt_fn(task)` (a user text, or chat messages), then each
    episode of `episodes_fn(task)`, `(tool_name, arguments, reply[, final_message])` (default final "Done."). The
    echo task lists one episode per allowed argument, the look task one per allowed final answer, and a batch holds
    *all* of a task's episodes: the loss is least for a well-formed call whose argument is uniform over the allowed
    values whatever the prompt says. (One random episode per example has the same optimum, but its label noise made
    the model markedly slower to learn the prompt -> argument mapping afterwards.) Returns `{"loss", "seconds"}`.
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence

    start = time.perf_counter()
    rng = random.Random(seed)
    render = rendering(tokenizer)

    @functools.cache
    def examples(index: int) -> list[tuple[Any, Any]]:
        """The task's rollouts as (input ids, labels: -100 where the model did not write the token)."""
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
    loss_value = float("nan")
    order: list[int] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
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
            loss_value = loss.item()
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"  sft step {step:3d} loss {loss_value:.4f}", flush=True)
    model.eval()
    return {"loss": loss_value, "seconds": time.perf_counter() - start}


# ── GRPO configuration ──────────────────────────────────────────────────────────────────────────────────────────────


def grpo_config_kwargs(steps: int, seed: int, output_dir: str, task: str, **overrides: Any) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments that make the tiny model learn from the environment's reward on CPU.

    `task` picks the recipe ("echo", or "look": `LOOK_RECIPE` on top). For echo, 200 steps x 64 rollouts take
    ~2.2 minutes on one CPU thread (in-process environment). `overrides` replace any entry.
    """
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
        "logging_steps": 10, "save_strategy": "no", "report_to": "none", "disable_tqdm": True, "log_completions": False,
        # GRPOConfig turns checkpointing on by default: pure overhead for a 0.5M model (~30% of a step). Newer
        # transformers renamed the option and warn on the old name.
        _checkpointing_option(): False,
        "use_cpu": True, "bf16": False, "fp16": False, "dataloader_num_workers": 0,
    }
    return {**kwargs, **(LOOK_RECIPE if task == "look" else {}), **overrides}


#: The look task's warm start: 50 steps already give a steady format (look, then one word) at temperature 1.
LOOK_WARM_START: dict[str, Any] = {"steps": 50}

#: What the look task changes in the echo recipe (see the tuning notes in `ors_trl.demo.__init__`).
LOOK_RECIPE: dict[str, Any] = {
    # Sample from the top 95%: after the warm start the look call has p ~0.97 at temperature 1, and the rare rollout
    # that answers without looking scores at chance like every other rollout before learning starts; its
    # low-probability first token takes large GRPO steps either way, and in one seed of three the policy drifted
    # into never looking (absorbing: no signal brings the look back). The cut removes those tails (and malformed
    # calls) and leaves the six answer words, each near 1/6, all in play.
    "top_p": 0.95,
    # look call (13 tokens) + the tool turn (the sentence and both headers, 14-20) + the answer and <|im_end|> (2):
    # 29-35 tokens. 40 leaves room for the longest held-out sentence and cuts off rambling answers early.
    "max_completion_length": 40,
}


def _checkpointing_option() -> str:
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


# ── evaluation ──────────────────────────────────────────────────────────────────────────────────────────────────────


def evaluate_policy(model: Any, tokenizer: Any, spec: Any, *, flatten_system: bool, look_tool: str | None = None,
                    output: str | None = None, repeats: int = 1, temperature: float = 0.0) -> dict[str, Any]:
    """Roll the model out `repeats` times per task of `spec` through `spec.evaluate`, as GRPO plays it: greedy unless
    `temperature`, the trainer's chat template, at most 32 new tokens a turn and 2 model turns (the recipe's
    `max_tool_calling_iterations` + 1); `flatten_system` is `spec.evaluate(flatten_prompt=)`.

    Returns `success_rate` (`EvalReport.success_rate`), `tool_call_rate` (episodes with a tool call),
    `tool_failure_rate` (failed calls / calls), `mean_reward` (unscored counted as 0), `n`, `seconds` and the
    `report`. With `look_tool` (a task graded by a terminal tool) also: `look_rate` (episodes that called it before
    answering), `turns` (model turns per episode), `answered_rate` (final messages the terminal tool graded),
    `follow_rate` (answers naming what the tool showed, from the terminal tool's metadata), `no_look_n` and
    `no_look_success` (success of the episodes that answered without looking; None when there are none).
    """
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
