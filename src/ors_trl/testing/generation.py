"""Scripted stand-ins for TRL's generation backend, for tests and benchmarks that drive a real `GRPOTrainer`.

They replace `trainer._generate_single_turn` so a step's time and outcome depend on the environment
alone. Replies use the qwen3 chat template's tool-call format, which TRL parses back into calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["tool_call_text", "work_turn_by_turn"]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One tool call as the qwen3 template writes it (without the closing `<|im_end|>`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def work_turn_by_turn(tokenizer: Any, turns: int) -> Callable[..., tuple[list[list[int]], None]]:
    """For `SlowEnvironment`: on turn k (k tool responses so far) call `work(step=k)`; after `turns` calls, "Done."."""
    calls = [tokenizer.encode(tool_call_text("work", {"step": k}) + "<|im_end|>", add_special_tokens=False)
             for k in range(turns)]
    done = tokenizer.encode("Done.<|im_end|>", add_special_tokens=False)
    response_id = tokenizer.convert_tokens_to_ids("<tool_response>")

    def generate(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        counts = [list(ids).count(response_id) for ids in prompt_ids]
        return [list(calls[k]) if k < turns else list(done) for k in counts], None

    return generate
