"""The demo task, as pure Python (no ``openreward`` import), so it can be wrapped in an ORS ``Environment``.

Task design ("closed-vocabulary echo"):

The environment follows the spirit of TRL's OpenReward echo environment: the prompt names a target word and the
model must call ``echo(text=...)`` with exactly that word; the reward is 1.0 on a correct call and 0.0 otherwise, and
the episode finishes on success. To keep it learnable by a ~0.5M-parameter model in a CPU budget, the target is always
one of a small, fixed set of words (:data:`TARGETS`), quoted in the prompt. The model therefore has to *read which of
the K words the prompt asks for* and put it in the tool call: a K-way choice conditioned on the prompt, not free-form
copying of arbitrary text (which a model this small does not learn in minutes on CPU).

Train and held-out tasks use disjoint phrasings (templates) and disjoint filler sentences; the target words are shared
(closed vocabulary). Held-out success therefore measures whether the policy learned to pick the word the prompt asks
for, independent of the wording it was trained on.

The interface is deliberately trivial to wrap:

- tasks are JSON-able dicts ``{"id", "target", "prompt"}`` (:func:`train_tasks`, :func:`heldout_tasks`);
- :func:`prompt` returns the prompt text for a task;
- :func:`score` maps ``(task, tool_args)`` to ``(reward, finished, reply_text)``.
"""

from __future__ import annotations

import random
from typing import Any

TOOL_NAME = "echo"
TOOL_DESCRIPTION = "Echo a word back to the environment."
TEXT_PARAM_DESCRIPTION = "The word to echo."

# The closed vocabulary of target words. Short, common and distinct, so each one becomes a single BPE token.
TARGETS: tuple[str, ...] = ("apple", "river", "stone", "cloud", "tiger", "piano")

# Phrasings: train and held-out templates are disjoint. "{t}" is the quoted target. The held-out phrasings are new
# sentences built from words that occur in the training phrasings, so they test reading the target in unseen wording
# (tokenized differently from anything trained on, and in one template with the target further from the end than in
# any training prompt), not robustness to unseen symbols.
TRAIN_TEMPLATES: tuple[str, ...] = (
    'Echo the word "{t}".',
    'Please echo "{t}" back.',
    'The target is "{t}". Echo it.',
    '"{t}" is the word to echo.',
    'Send "{t}" to the echo tool.',
    'Call echo with "{t}".',
    'Use the echo tool on "{t}".',
    'Echo back the word "{t}" now.',
    'Your task: echo "{t}".',
    'Repeat the word "{t}" with echo.',
)
HELDOUT_TEMPLATES: tuple[str, ...] = (
    'The word to echo is "{t}".',
    'Call the echo tool with "{t}".',
    'Send the word "{t}" back.',
    '"{t}" is the target. Echo it.',
)

# Filler sentences placed before the instruction: train and held-out sets are disjoint (again from shared words).
TRAIN_FILLERS: tuple[str, ...] = (
    "",
    "Hello.",
    "Task ready.",
    "Here is a job.",
    "Quick one.",
    "Good morning.",
    "Next task.",
    "Please help.",
)
HELDOUT_FILLERS: tuple[str, ...] = ("Here is one.", "Quick job.", "Hello. Task ready.")

# The tool's text reply is the echo itself, whether the call was right or wrong; correctness is reported only through
# the reward. (A "Correct"/"Wrong" reply hands the model an easy cue to tell failed rollouts apart in its post-tool
# turn, where GRPO's negative advantages then push it off its closing message; in early experiments that rambling
# preceded a collapse of the whole tool-call format.)
REPLY_INVALID = "Invalid call: pass the word as text."


def _make_tasks(split: str, templates: tuple[str, ...], fillers: tuple[str, ...], seed: int) -> list[dict[str, Any]]:
    combos = [(t, tpl, fil) for t in TARGETS for tpl in templates for fil in fillers]
    random.Random(seed).shuffle(combos)  # fixed order, mixed targets
    tasks = []
    for i, (target, template, filler) in enumerate(combos):
        text = template.format(t=target)
        if filler:
            text = f"{filler} {text}"
        tasks.append({"id": f"{split}-{i:03d}", "target": target, "prompt": text})
    return tasks


def train_tasks() -> list[dict[str, Any]]:
    """All training tasks (targets x train templates x train fillers), in a fixed shuffled order."""
    return _make_tasks("train", TRAIN_TEMPLATES, TRAIN_FILLERS, seed=0)


def heldout_tasks() -> list[dict[str, Any]]:
    """Held-out tasks: same target words, but phrasings and fillers never used in training."""
    return _make_tasks("heldout", HELDOUT_TEMPLATES, HELDOUT_FILLERS, seed=1)


def prompt(task: dict[str, Any]) -> str:
    """The prompt text for a task (TRL appends it to the user message)."""
    return task["prompt"]


def score(task: dict[str, Any], tool_args: dict[str, Any]) -> tuple[float, bool, str]:
    """Score one ``echo`` call: ``(reward, finished, reply_text)``.

    Reward is 1.0 and the episode finishes when ``text`` is exactly the task's target word; otherwise the reward is
    0.0 and the episode continues. The reply text is the echoed word either way (it never reveals the target or
    whether the call was right).
    """
    text = tool_args.get("text")
    if not isinstance(text, str):
        return 0.0, False, REPLY_INVALID
    if text == task["target"]:
        return 1.0, True, text
    return 0.0, False, text


def warm_start_episodes(task: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """Episodes the format-only warm start imitates for a task: one ``echo`` call per allowed word, equally weighted.

    Returned as ``(tool_name, arguments, reply_text)``. Uniform over :data:`TARGETS` whatever the prompt says, so
    imitating them teaches the call format and the answer vocabulary but not which word a prompt asks for.
    """
    return [(TOOL_NAME, {"text": word}, score(task, {"text": word})[2]) for word in TARGETS]
