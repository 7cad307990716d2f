"""Training recipe for the demo: supervised warm start, the GRPO configuration that learns, and policy evaluation.

Everything here mirrors what TRL's ``GRPOTrainer`` does with ``environment_factory``, so that the warm start teaches
exactly the token sequences GRPO will sample and the evaluation measures exactly what GRPO rewards:

- prompts are rendered with the trainer's chat template (TRL swaps Qwen3's template for its prefix-preserving training
  variant, ``get_training_chat_template``) with the environment's tools and ``add_generation_prompt=True``;
- a rollout is ``prompt + assistant tool call + <tool suffix> + final assistant message``, concatenated at the token
  level exactly as TRL's tool loop concatenates them (the tool suffix computed the way TRL computes it);
- completions are parsed with ``trl.chat_template_utils.parse_response(tokenizer, ids, prefix=prompt_ids, tools=...)``.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._model import EOS_TOKEN, FINAL_MESSAGE, tool_call_message

# ── chat-template plumbing shared by SFT and evaluation ─────────────────────────────────────────────────────────────


def environment_tools(environment: Any) -> list[Callable]:
    """The tool methods TRL exposes for an environment instance (public methods other than reset/get_reward)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def prepare_tokenizer(tokenizer):
    """Attach the response template TRL uses to parse tool calls, and return the chat template GRPO renders with."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
    )

    if getattr(tokenizer, "response_template", None) is None:
        add_response_schema(tokenizer)
    if getattr(tokenizer, "response_template", None) is None:
        raise ValueError("TRL did not recognise the chat template; it must be trl/chat_templates/qwen3.jinja verbatim")
    if is_chat_template_prefix_preserving(tokenizer):
        return None
    return get_training_chat_template(tokenizer)


def prompt_ids(tokenizer, prompt_text: str, tools: Sequence, chat_template: str | None) -> list[int]:
    """Token ids of the rendered prompt, exactly as ``GRPOTrainer._tokenize_prompts`` builds them."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text}],
        tools=list(tools) or None,
        chat_template=chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    return list(out["input_ids"])


def tool_call_text(tokenizer, name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the template renders for one tool call, ending with the end-of-turn token.

    Rendered with the model's own template on a non-final assistant turn (no empty ``<think>`` block), e.g.
    ``<tool_call>\\n{"name": "echo", "arguments": {"text": "apple"}}\\n</tool_call><|im_end|>``.
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


def tool_suffix_ids(tokenizer, name: str, reply: str, chat_template: str | None) -> list[int]:
    """Token ids TRL inserts after a tool call: the tool reply turn plus the next assistant header.

    The same computation as TRL's tool loop (render with and without the tool turn, keep the difference).
    """
    dummy = [{"role": "user", "content": "dummy"}, tool_call_message(name, {})]
    prefix = tokenizer.apply_chat_template(
        dummy, add_generation_prompt=False, tokenize=True, chat_template=chat_template, return_dict=False
    )
    full = tokenizer.apply_chat_template(
        [*dummy, {"role": "tool", "name": name, "content": reply}],
        add_generation_prompt=True,
        tokenize=True,
        chat_template=chat_template,
        return_dict=False,
    )
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    assert full[: len(prefix)] == prefix
    return list(full[len(prefix) :])


def rollout_ids(
    tokenizer,
    prompt_text: str,
    tools: Sequence,
    name: str,
    arguments: dict[str, Any],
    reply: str,
    chat_template: str | None,
    final: str = FINAL_MESSAGE,
) -> tuple[list[int], list[int]]:
    """Token ids of one full rollout as GRPO builds it, and a loss mask (1 on model-written tokens)."""
    p = prompt_ids(tokenizer, prompt_text, tools, chat_template)
    call = tokenizer.encode(tool_call_text(tokenizer, name, arguments), add_special_tokens=False)
    suffix = tool_suffix_ids(tokenizer, name, reply, chat_template)
    last = tokenizer.encode(final + EOS_TOKEN, add_special_tokens=False)
    ids = p + call + suffix + last
    mask = [0] * len(p) + [1] * len(call) + [0] * len(suffix) + [1] * len(last)
    return ids, mask


# ── warm start (supervised) ─────────────────────────────────────────────────────────────────────────────────────────


def warm_start(
    model,
    tokenizer,
    tasks: Sequence[dict[str, Any]],
    seed: int,
    *,
    tools: Sequence,
    prompt_fn: Callable[[dict[str, Any]], str],
    episodes_fn: Callable[[dict[str, Any]], list[tuple[str, dict[str, Any], str]]] | None = None,
    episode_fn: Callable[[dict[str, Any], random.Random], tuple[str, dict[str, Any], str]] | None = None,
    steps: int = 80,
    batch_size: int = 36,
    learning_rate: float = 3e-3,
    warmup_steps: int = 5,
    weight_decay: float = 0.0,
    log_every: int = 0,
) -> dict[str, Any]:
    """Teach the tool-call *format* with a short supervised loop (assistant-only loss), not the answer.

    Each example is a full rollout rendered exactly the way GRPO will sample it (prompt, tool call, tool reply, final
    message). ``episodes_fn(task)`` returns the episodes to imitate for a task as ``(tool_name, arguments, reply)``
    triples; the demo returns one episode per allowed argument value, and every batch contains *all* of a task's
    episodes. The loss is thus minimised by emitting a well-formed call whose argument is uniform over the allowed
    values whatever the prompt says: the warm start teaches the format and the vocabulary of answers, not the answer.
    (Sampling one random argument per example has the same optimum but its label noise makes the model markedly
    slower to learn the prompt -> argument mapping afterwards.) Returns ``{"loss", "seconds"}``.

    ``episode_fn(task, rng) -> (tool_name, arguments, reply)`` is the older, noisier alternative: one sampled episode
    per example (e.g. a uniformly random word). Pass exactly one of ``episodes_fn`` / ``episode_fn``.
    """
    import torch

    if (episode_fn is None) == (episodes_fn is None):
        raise TypeError("pass exactly one of episodes_fn or episode_fn")
    start = time.perf_counter()
    rng = random.Random(seed)
    chat_template = prepare_tokenizer(tokenizer)
    prompt_cache: dict[str, list[int]] = {}
    suffix_cache: dict[tuple[str, str], list[int]] = {}
    last = tokenizer.encode(FINAL_MESSAGE + EOS_TOKEN, add_special_tokens=False)
    pad_id = tokenizer.pad_token_id

    def examples(task) -> list[tuple[list[int], list[int]]]:
        text = prompt_fn(task)
        if text not in prompt_cache:
            prompt_cache[text] = prompt_ids(tokenizer, text, tools, chat_template)
        p = prompt_cache[text]
        out = []
        episodes = episodes_fn(task) if episodes_fn is not None else [episode_fn(task, rng)]
        for name, arguments, reply in episodes:
            call = tokenizer.encode(tool_call_text(tokenizer, name, arguments), add_special_tokens=False)
            if (name, reply) not in suffix_cache:
                suffix_cache[(name, reply)] = tool_suffix_ids(tokenizer, name, reply, chat_template)
            suffix = suffix_cache[(name, reply)]
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
    steps: int = 200, seed: int = 0, output_dir: str = "outputs/demo", **overrides: Any
) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments that make the tiny model learn from the environment's reward on CPU.

    200 steps x 64 rollouts take ~2.2 minutes on one CPU thread (in-process environment). ``overrides`` replace
    any entry.
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
    kwargs.update(overrides)
    return kwargs


def _checkpointing_option() -> str:
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


# ── evaluation ──────────────────────────────────────────────────────────────────────────────────────────────────────


def evaluate_policy(model, tokenizer, spec: Any, *, max_new_tokens: int = 32, max_turns: int = 1) -> dict[str, Any]:
    """Roll the policy out once per task of `spec` (held-out) through `spec.evaluate`, the way GRPO renders it.

    Greedy, with the trainer's chat template (`prepare_tokenizer`), at most `max_new_tokens` per turn and
    `max_turns` model turns; tool calls go through the same binding and episode core as training.

    Returns `success_rate` (reward == 1), `tool_call_rate` (episodes with a tool call), `tool_failure_rate`
    (failed calls / calls), `mean_reward` (unscored counted as 0), `n`, `seconds` and the `report`.
    """
    from ors_trl import LocalPolicy

    was_training = model.training
    model.eval()
    policy = LocalPolicy(model, tokenizer, temperature=0.0, max_new_tokens=max_new_tokens, seed=0,
                         chat_template=prepare_tokenizer(tokenizer), name="demo-policy")
    report = spec.evaluate(policy, concurrency=64, max_turns=max_turns, progress=False)
    if was_training:
        model.train()
    episodes = report.episodes
    n = max(len(episodes), 1)
    calls = sum(e["tool_calls"] for e in episodes)
    return {
        "success_rate": sum(e.get("reward") == 1.0 for e in episodes) / n,
        "tool_call_rate": sum(e["tool_calls"] > 0 for e in episodes) / n,
        "tool_failure_rate": sum(e["tool_failures"] for e in episodes) / calls if calls else 0.0,
        "mean_reward": sum(e.get("reward") or 0.0 for e in episodes) / n,
        "n": len(episodes),
        "seconds": report.seconds,
        "report": report,
    }
