"""Training rows from a harness's model calls, token-exactly (design decision 16): as TRL's `_chain_to_sequences`
with `fork_threshold_tokens=0`, but a row is never realigned, so no generated token is ever silently masked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..trl.tokens import Tokens
from .server import ModelCall

__all__ = ["build_rows"]


def build_rows(calls: Sequence[ModelCall], train: Callable[[ModelCall], bool] | None = None) -> list[Tokens]:
    """The rows of `calls` (in the order they were made), each call's `row` set: a call whose prompt ids extend a row's
    joins it (the ids between, tool results and scaffolding, masked context), else it forks a new row. `train(call)`
    says which calls train (default: every call with ids; leave out a harness's auxiliary calls, e.g. titles)."""
    rows: list[Tokens] = []
    for call in calls:
        call.row = None
        if call.prompt_ids is None or call.completion_ids is None or (train is not None and not train(call)):
            continue
        prompt = call.prompt_ids
        index = next((i for i in range(len(rows) - 1, -1, -1)
                      if prompt[: len(rows[i].ids)] == rows[i].ids), None)  # the latest row it extends
        if index is None:
            rows.append(Tokens(list(prompt), [], 0))
            index = len(rows) - 1
        row = rows[index]
        row.add(prompt[len(row.ids):], generated=False)  # what came between: context
        row.add(call.completion_ids, call.logprobs)
        call.row = index
    return rows
