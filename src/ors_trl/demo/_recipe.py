"""Training recipe for the demo: supervised warm start, the GRPO configuration that learns, and policy evaluation.

Everything here mirrors what TRL's `GRPOTrainer` does with `environment_factory`, so that the warm start teaches
exactly the token sequences GRPO will sample and the evaluation measures exactly what GRPO rewards:

- prompts are rendered with the trainer's chat template (TRL swaps Qwen3's template for its prefix-preserving training
  variant, `get_training_chat_template`) with the environment's tools and `add_generation_prompt=True`;
- a rollout is `prompt + assistant tool call + <tool suffix> + final assistant message`, concatenated at the token
  level exactly as TRL's tool loop concatenates them (the tool suffix computed the way TRL computes it);
- completions are parsed with `trl.chat_template_utils.parse_response(tokenizer, ids, prefix=prompt_ids, tools=...)`;
- a conversation's system turn is shown as the trainer shows it: joined to the user text on the `environment_factory`
  path (TRL's `reset()` can only append text), a system message through `spec.rollout_func`;
- the evaluation (`spec.evaluate` with `LocalPolicy`, whose ids are built as GRPO builds them, `ors_trl.trl.tokens`;
  `tests/test_rollout.py` checks them against TRL's own). Re-rendering the conversation would give other ids: TRL's
  training template for Qwen3 renders an empty `<think>` block in the assistant's tool-call turn, which the model
  never generated in GRPO.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.metrics import EpisodeStats
from ._model import EOS_TOKEN, episode_parts, tool_call_message

# ── chat-template plumbing shared by SFT and evaluation ─────────────────────────────────────────────────────────────


def environment_tools(environment: Any) -> list[Callable]:
    """The tool methods TRL exposes for an environment instance (public methods other than reset/get_reward)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def rendering(tokenizer) -> Any:
    """How GRPO renders and parses with this tokenizer (TRL's training chat template, tool turns, parsing):
    the one `ors_trl.trl.backend.Rendering` the engine and `LocalPolicy` use too."""
    from ors_trl.trl.backend import Rendering

    out = Rendering.for_training(tokenizer)
    if out.parse_error is not None:
        raise ValueError("TRL did not recognise the chat template; it must be trl/chat_templates/qwen3.jinja verbatim")
    return out


def prompt_ids(render: Any, prompt: str | Sequence[dict[str, Any]], tools: Sequence) -> list[int]:
    """Token ids of the rendered prompt (a user text, or chat messages), exactly as GRPOTrainer renders prompts."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return render.prompt_ids(messages, list(tools))


def tool_call_text(tokenizer, name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the template renders for one tool call, ending with the end-of-turn token.

    Rendered with the model's own template on a non-final assistant turn (no empty `<think>` block), e.g.
    `<tool_call>\\n{"name": "echo", "arguments": {"text": "apple"}}\\n</tool_call><|im_end|>`.
    """
    header = "<|im_start|>assistant\n"
    messages = [
        {"role": "user", "content": "x"},
        tool_call_message(name, arguments),
        {"role": "tool", "name": name, "content": "x"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    start = rendered.index(header) + len(header)
    end = rendered.index(EOS_TOKEN, start) + len(EOS_TOKEN)
    return rendered[start:end]


# ── warm start (supervised) ─────────────────────────────────────────────────────────────────────────────────────────


def warm_start(
    model,
    tokenizer,
    tasks: Sequence[dict[str, Any]],
    seed: int,
    *,
    tools: Sequence,
    prompt_fn: Callable[[dict[str, Any]], str | list[dict[str, Any]]],
    episodes_fn: Callable[[dict[str, Any]], Sequence[tuple[Any, ...]]] | None = None,
    episode_fn: Callable[[dict[str, Any], random.Random], tuple[Any, ...]] | None = None,
    steps: int = 80,
    batch_size: int = 36,
    learning_rate: float = 3e-3,
    warmup_steps: int = 5,
    weight_decay: float = 0.0,
    log_every: int = 0,
) -> dict[str, Any]:
    """Teach the tool-call *format* with a short supervised loop (assistant-only loss), not the answer.

    Each example is a full rollout rendered exactly the way GRPO will sample it (prompt, tool call, tool reply, final
    message). `prompt_fn(task)` is the prompt as GRPO renders it (the user text, or chat messages).
    `episodes_fn(task)` returns the episodes to imitate for a task as `(tool_name, arguments, reply)` triples, or
    `(tool_name, arguments, reply, final_message)` (default final message "Done."); the echo task returns one
    episode per allowed argument value, the look task one per allowed final answer, and every batch contains *all* of a task's
    episodes. The loss is thus minimised by emitting a well-formed call whose argument is uniform over the allowed
    values whatever the prompt says: the warm start teaches the format and the vocabulary of answers, not the answer.
    (Sampling one random argument per example has the same optimum but its label noise makes the model markedly
    slower to learn the prompt -> argument mapping afterwards.) Returns `{"loss", "seconds"}`.

    `episode_fn(task, rng) -> (tool_name, arguments, reply)` is the older, noisier alternative: one sampled episode
    per example (e.g. a uniformly random word). Pass exactly one of `episodes_fn` / `episode_fn`.
    """
    import torch

    if (episode_fn is None) == (episodes_fn is None):
        raise TypeError("pass exactly one of episodes_fn or episode_fn")
    start = time.perf_counter()
    rng = random.Random(seed)
    render = rendering(tokenizer)
    prompt_cache: dict[str, list[int]] = {}
    suffix_cache: dict[tuple[str, str], list[int]] = {}
    final_cache: dict[str, list[int]] = {}
    pad_id = tokenizer.pad_token_id

    def examples(task) -> list[tuple[list[int], list[int]]]:
        prompt = prompt_fn(task)
        key = prompt if isinstance(prompt, str) else repr(prompt)
        if key not in prompt_cache:
            prompt_cache[key] = prompt_ids(render, prompt, tools)
        p = prompt_cache[key]
        out = []
        episodes = episodes_fn(task) if episodes_fn is not None else [episode_fn(task, rng)]  # type: ignore[misc]
        for name, arguments, reply, final in map(episode_parts, episodes):
            call = tokenizer.encode(tool_call_text(tokenizer, name, arguments), add_special_tokens=False)
            if (name, reply) not in suffix_cache:
                suffix_cache[(name, reply)] = render.tool_suffix_ids([{"role": "tool", "name": name,
                                                                       "content": reply}])
            suffix = suffix_cache[(name, reply)]
            if final not in final_cache:
                final_cache[final] = tokenizer.encode(final + EOS_TOKEN, add_special_tokens=False)
            last = final_cache[final]
            ids = p + call + suffix + last
            mask = [0] * len(p) + [1] * len(call) + [0] * len(suffix) + [1] * len(last)
            out.append((ids, mask))
        return out

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    loss_value = float("nan")
    order: list[dict[str, Any]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            batch: list[tuple[list[int], list[int]]] = []
            while len(batch) < batch_size:
                if not order:  # walk the tasks in a fresh random order each epoch
                    order = list(tasks)
                    rng.shuffle(order)
                batch.extend(examples(order.pop()))
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (ids, mask) in enumerate(batch):  # right padding
                n = len(ids)
                input_ids[row, :n] = torch.tensor(ids)
                attention[row, :n] = 1
                labels[row, :n] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
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


def grpo_config_kwargs(
    steps: int = 200, seed: int = 0, output_dir: str = "outputs/demo", task: str = "echo", **overrides: Any
) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments that make the tiny model learn from the environment's reward on CPU.

    `task` picks the recipe ("echo" or "look", see `LOOK_RECIPE`). For echo, 200 steps x 64 rollouts take
    ~2.2 minutes on one CPU thread (in-process environment). `overrides` replace any entry.
    """
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": steps,
        "seed": seed,
        "data_seed": seed,
        "learning_rate": 3e-4,  # TRL's default 1e-6 does nothing at this scale; >= 5e-4 tends to break the format
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "per_device_train_batch_size": 64,  # rollouts per step: 8 prompts x 8 generations
        "num_generations": 8,  # with 4 (16 prompts), more groups got identical rewards and runs stalled more often
        "gradient_accumulation_steps": 1,
        # Counts the tool reply too: call (13 tokens) + tool suffix (~11) + "Done." (3) = ~27. A tight cap also bounds
        # the rambling that appears after wrong calls late in training (GRPO pushes "Done." down in failed rollouts).
        "max_completion_length": 32,
        "max_tool_calling_iterations": 1,  # one call is executed; the post-tool turn just closes the episode
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,  # no reference model: cheaper, and a KL anchor (0.05) stopped learning in a short test
        "num_iterations": 1,
        "scale_rewards": "group",
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        # GRPOConfig turns checkpointing on by default: pure overhead for a 0.5M model (~30% of a step). Newer
        # transformers renamed the option and warn on the old name.
        _checkpointing_option(): False,
        "bf16": False,
        "fp16": False,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "log_completions": False,
    }
    if task == "look":
        kwargs.update(LOOK_RECIPE)
    kwargs.update(overrides)
    return kwargs


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


def flat(messages: list[dict[str, Any]], flatten_system: bool) -> list[dict[str, Any]]:
    """The conversation as `spec.evaluate(..., flatten_prompt=flatten_system)` hands it to the policy."""
    if not (flatten_system and messages and messages[0].get("role") == "system"):
        return messages
    system, rest = messages[0], [dict(m) for m in messages[1:]]
    if rest and rest[0].get("role") == "user":
        rest[0]["content"] = f"{system['content']}\n\n{rest[0]['content']}"
        return rest
    return [{"role": "user", "content": system["content"]}, *rest]


def demo_policy(model, tokenizer, *, max_new_tokens: int = 32, temperature: float = 0.0) -> Any:
    """The evaluation policy (greedy unless `temperature`), rendering with the trainer's chat template and joining
    turns as GRPO does."""
    from ors_trl import LocalPolicy

    return LocalPolicy(model, tokenizer, temperature=temperature, max_new_tokens=max_new_tokens, seed=0,
                       chat_template=rendering(tokenizer).chat_template, name="demo-policy")


def evaluate_policy(model, tokenizer, spec: Any, *, max_new_tokens: int = 32, max_turns: int = 2,
                    flatten_system: bool = True, look_tool: str | None = None, output: str | None = None,
                    repeats: int = 1, temperature: float = 0.0) -> dict[str, Any]:
    """Roll the policy out once per task of `spec` (held-out) through `spec.evaluate`, the way GRPO renders it.

    Greedy, with the trainer's chat template (`rendering`), at most `max_new_tokens` per turn and `max_turns`
    model replies (the recipe's `max_tool_calling_iterations` + 1, the limit GRPO plays under); tool calls go through the same binding and episode core as training, and every
    turn's input ids are built as GRPO builds them (`LocalPolicy(join_turns=True)`). `output`: also write the episode records.

    Returns `success_rate` (`EvalReport.success_rate`: reward at or above the spec's `success_threshold`),
    `tool_call_rate` (episodes with a tool call), `tool_failure_rate` (failed calls / calls), `mean_reward` (unscored counted as 0), `n`, `seconds` and the `report`. With `look_tool`
    (a conversation task graded by a terminal tool) also: `look_rate` (episodes that called it before answering),
    `turns` (model turns per episode), `answered_rate` (episodes whose final message the terminal tool graded),
    `follow_rate` (answers naming what the tool showed, from the terminal tool's metadata), `no_look_n` and
    `no_look_success` (success of the episodes that answered without looking; None when there are none).
    """
    was_training = model.training
    model.eval()
    policy = demo_policy(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature)
    report = spec.evaluate(policy, concurrency=64, max_turns=max_turns, progress=False, flatten_prompt=flatten_system,
                           repeats=repeats,
                           **({"output": output, "overwrite": True} if output else {}))
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
