"""The demo's tiny tool-calling Qwen3 (random weights, ~0.5M parameters) and its byte-level BPE tokenizer, trained on
the fly on conversations in the installed TRL's Qwen3 chat template (so TRL parses the tool calls). No Hub access."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import cache
from importlib.resources import files
from typing import Any

# Qwen3's added tokens: the first three special (skip_special_tokens drops them), the tool/think markers plain.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CONTROL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                   "</think>")
EOS_TOKEN = "<|im_end|>"  # end of turn: generation stops here, and TRL aligns tool suffixes on it
PAD_TOKEN = "<|endoftext|>"

# A pre-token of its own: a double-quoted run of lowercase letters/underscores (JSON keys, enum-like string values).
QUOTED_WORD_PATTERN = r'"[a-z_]+"'

# The warm start's final message after the tool result (keeps the post-tool turn to a couple of tokens).
FINAL_MESSAGE = "Done."

# ~0.56M parameters with the default 640-token vocabulary (untied embeddings: 2 x 640 x 128 of them).
MODEL_DIMS: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    # Sliding window on both layers: full attention dilutes the one prompt token that matters among the tool preamble
    # (seed 0: 0.29 held out after 200 GRPO steps, not 1.0); 32 tokens reach the target (16-25 tokens back).
    "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0,
    # Untied: a tied model learned prompt -> argument far more slowly after the format-only warm start.
    "tie_word_embeddings": False,
}


#: The look task's window: the answer is 7-14 tokens back; with 16 in view GRPO found it after ~25 steps, not ~45-60.
LOOK_MODEL_DIMS: dict[str, Any] = {"sliding_window": 16}


@cache
def chat_template(name: str = "qwen3") -> str:
    """TRL's `trl/chat_templates/<name>.jinja` as the installed TRL ships it, which its response parser recognises."""
    return files("trl").joinpath("chat_templates", f"{name}.jinja").read_text(encoding="utf-8")


def tool_call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant message carrying one tool call, in the shape chat templates expect."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def episode_parts(episode: Sequence[Any]) -> tuple[str, dict[str, Any], str, str]:
    """`(tool_name, arguments, reply)` or `(..., final_message)` as a 4-tuple (default final: "Done.")."""
    name, arguments, reply, *rest = episode
    return name, arguments, reply, (rest[0] if rest else FINAL_MESSAGE)


def render_corpus(tasks: Sequence[dict[str, Any]], tools: Sequence[Callable | dict],
                  prompt_fn: Callable[[dict[str, Any]], str | list[dict[str, Any]]],
                  episode_fn: Callable[[dict[str, Any], random.Random], tuple[Any, ...]] | None = None, *,
                  episodes_fn: Callable[[dict[str, Any]], Sequence[tuple[Any, ...]]] | None = None, copies: int = 2,
                  seed: int = 0, template: str | None = None) -> list[str]:
    """Tokenizer-training text: each task's tool-calling conversation, `copies` times, rendered with `template`
    (default TRL's Qwen3) and `tools`; the episode `(tool_name, arguments, reply[, final])` is picked at random from
    `episodes_fn(task)` or drawn by `episode_fn(task, rng)`."""
    from transformers.utils.chat_template_utils import render_jinja_template

    if (episode_fn is None) == (episodes_fn is None):
        raise TypeError("pass exactly one of episode_fn or episodes_fn")
    rng = random.Random(seed)
    conversations = []
    for _ in range(copies):
        for task in tasks:
            episode = rng.choice(list(episodes_fn(task))) if episodes_fn else episode_fn(task, rng)  # type: ignore
            name, arguments, reply, final = episode_parts(episode)
            prompt = prompt_fn(task)
            head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            tail = [{"role": "tool", "name": name, "content": reply}, {"role": "assistant", "content": final}]
            conversations.append([*head, tool_call_message(name, arguments), *tail])
    rendered, _ = render_jinja_template(conversations, tools=list(tools), chat_template=template or chat_template())
    return rendered


def build_tokenizer(corpus: list[str], vocab_size: int = 640, isolate: Sequence[str] = (),
                    special: Sequence[str] = (), template: str | None = None):
    """A deterministic byte-level BPE tokenizer trained on `corpus`, Qwen3-style: at most `vocab_size` entries (640:
    the least that keeps every demo target word and JSON key one token), no BOS, left padding, `template` (default
    TRL's Qwen3). `isolate`: words that are pre-tokens of their own; `special`: more special tokens (image markers)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    added = SPECIAL_TOKENS + tuple(special) + CONTROL_TOKENS
    n_merged = vocab_size - len(added)
    if n_merged <= 256:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for BPE merges")

    # Train on the text between added tokens only, so no merge ever spans (or spells out) a control token.
    splitter = re.compile("|".join(re.escape(t) for t in added))
    pieces = [piece for text in corpus for piece in splitter.split(text) if piece]

    bpe = Tokenizer(models.BPE())
    # A quoted identifier is one token anywhere; other text merges across spaces (tool preamble: ~60 tokens, not 185).
    patterns = [QUOTED_WORD_PATTERN, *([rf"\b(?:{'|'.join(map(re.escape, isolate))})\b"] if isolate else [])]
    splits = [pre_tokenizers.Split(pattern=Regex(p), behavior="isolated") for p in patterns]
    bpe.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_merged, min_frequency=2, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(pieces, trainer=trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *special)])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in CONTROL_TOKENS])

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None,
                                        unk_token=None, clean_up_tokenization_spaces=False, padding_side="left",
                                        model_max_length=MODEL_DIMS["max_position_embeddings"])
    tokenizer.chat_template = template or chat_template()
    return tokenizer


def build_model(tokenizer, seed: int, **overrides: Any):
    """A randomly initialised tiny `Qwen3ForCausalLM` for `tokenizer` (deterministic for `seed`): `MODEL_DIMS`,
    `overrides` on top."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen3Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
                         **{**MODEL_DIMS, **overrides})
    return _random_model(Qwen3ForCausalLM, config, seed, eos_id, pad_id)


def _random_model(model_class: Any, config: Any, seed: int, eos_id: int, pad_id: int) -> Any:
    """`model_class(config)` initialised at random for `seed`, generating up to `eos_id`, padding with `pad_id`."""
    import torch

    with torch.random.fork_rng(devices=[]):  # seed the CPU generator without disturbing the caller's RNG state
        torch.manual_seed(seed)
        model = model_class(config)
    generation = model.generation_config
    generation.eos_token_id, generation.pad_token_id, generation.bos_token_id = eos_id, pad_id, None
    return model


#: The saved tiny model's context: room for another environment's prompt, tools and a few turns (costs no parameters).
SAVED_POSITIONS = 2048

#: The tool the saved tiny model's tokenizer was trained with (the demo's echo task: the format, not the task).
_ECHO_SCHEMA: dict[str, Any] = {"type": "function", "function": {
    "name": "echo", "description": "Echo a word back to the environment.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "The word to echo."}},
                   "required": ["text"]}}}


def save(model: Any, tokenizer: Any, path: str | Any) -> str:
    """Write `model` and `tokenizer` (its chat template included) to the folder `path`, made if missing; its path.
    What `ors-trl eval --model DIR`, `LocalPolicy.from_pretrained(DIR)` and `GRPOTrainer(model=DIR)` load."""
    import os

    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        from ..protocol.errors import ConfigurationError

        raise ConfigurationError(f"cannot save the model to {path!r}: it is a file, not a folder")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_model(path: str | Any = "tiny-model", *, seed: int = 0) -> str:
    """`ors_trl.demo.save_tiny_model`: the tokenizer learns the echo conversations (byte-level: any text encodes)."""
    from . import _task

    corpus = render_corpus(_task.train_tasks(), [_ECHO_SCHEMA], _task.prompt, episodes_fn=_task.warm_start_episodes,
                           seed=seed)
    tokenizer = build_tokenizer(corpus)
    tokenizer.model_max_length = SAVED_POSITIONS
    return save(build_model(tokenizer, seed=seed, max_position_embeddings=SAVED_POSITIONS), tokenizer, path)
