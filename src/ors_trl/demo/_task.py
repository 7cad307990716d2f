"""The demo's tasks as pure Python over `TARGETS` (six words, one token each); `_environments` serves them.

**look** (the default): a hidden word only the `look()` tool's output names (the conversation is the same whatever the
word); the final message is graded (`grade`). Held-out tasks phrase `look()`'s answer in unseen ways; in `blind` it
names a decoy (the shortcut control). **echo**: call `echo(text=...)` with the word the prompt quotes.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

TOOL_NAME = "echo"

# Short, common and distinct, so each one becomes a single BPE token.
TARGETS: tuple[str, ...] = ("apple", "river", "stone", "cloud", "tiger", "piano")

# Disjoint train and held-out phrasings ("{t}": the target): new sentences of the training words, no unseen symbols.
TRAIN_TEMPLATES: tuple[str, ...] = (
    'Echo the word "{t}".', 'Please echo "{t}" back.', 'The target is "{t}". Echo it.', '"{t}" is the word to echo.',
    'Send "{t}" to the echo tool.', 'Call echo with "{t}".', 'Use the echo tool on "{t}".',
    'Echo back the word "{t}" now.', 'Your task: echo "{t}".', 'Repeat the word "{t}" with echo.',
)
HELDOUT_TEMPLATES: tuple[str, ...] = ('The word to echo is "{t}".', 'Call the echo tool with "{t}".',
                                      'Send the word "{t}" back.', '"{t}" is the target. Echo it.')

# Sentences before the instruction, again disjoint over shared words.
TRAIN_FILLERS: tuple[str, ...] = ("", "Hello.", "Task ready.", "Here is a job.", "Quick one.", "Good morning.",
                                  "Next task.", "Please help.")
HELDOUT_FILLERS: tuple[str, ...] = ("Here is one.", "Quick job.", "Hello. Task ready.")

# The tool replies with the echo, right or wrong: only the reward tells (a "Correct"/"Wrong" reply let GRPO push failed
# rollouts off their closing message, and the tool-call format collapsed after).
REPLY_INVALID = "Invalid call: pass the word as text."


def _shuffled(seed: int, *axes: Sequence[str]) -> list[tuple[str, ...]]:
    """Every combination of one item per axis, in a fixed shuffled order (mixed targets)."""
    combos = list(itertools.product(*axes))
    random.Random(seed).shuffle(combos)
    return combos


def _make_tasks(split: str, templates: tuple[str, ...], fillers: tuple[str, ...], seed: int) -> list[dict[str, Any]]:
    return [{"id": f"{split}-{i:03d}", "target": target,
             "prompt": (f"{filler} " if filler else "") + template.format(t=target)}
            for i, (target, template, filler) in enumerate(_shuffled(seed, TARGETS, templates, fillers))]


def train_tasks() -> list[dict[str, Any]]:
    """Every target x train template x train filler, in a fixed shuffled order (`{"id", "target", "prompt"}`)."""
    return _make_tasks("train", TRAIN_TEMPLATES, TRAIN_FILLERS, seed=0)


def heldout_tasks() -> list[dict[str, Any]]:
    """The same targets in phrasings and fillers never used in training."""
    return _make_tasks("heldout", HELDOUT_TEMPLATES, HELDOUT_FILLERS, seed=1)


def prompt(task: dict[str, Any]) -> str:
    """The prompt text for a task (TRL appends it to the user message)."""
    return task["prompt"]


def score(task: dict[str, Any], tool_args: dict[str, Any]) -> tuple[float, bool, str]:
    """One `echo` call's `(reward, finished, reply_text)`: 1.0 and finished when `text` is exactly the target."""
    text = tool_args.get("text")
    if not isinstance(text, str):
        return 0.0, False, REPLY_INVALID
    return (1.0, True, text) if text == task["target"] else (0.0, False, text)


def warm_start_episodes(task: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """What the format-only warm start imitates, `(tool_name, arguments, reply_text)`: one `echo` call per word of
    `TARGETS` whatever the prompt says (the format and the vocabulary, not which word a prompt asks for)."""
    return [(TOOL_NAME, {"text": word}, score(task, {"text": word})[2]) for word in TARGETS]


# The look task: the answer is only in a tool's output.
LOOK_TOOL = "look"
ANSWER_TOOL = "answer"
ANSWER_DESCRIPTION = "The model's final message: the hidden word."

LOOK_SYSTEM = ("You play a hidden word game. The hidden word is one of: " + ", ".join(TARGETS) + ". "
               "Call the look tool to see it, then reply with the word alone.")
# The user turn. Held-out tasks ask the same questions (unseen ones broke the call format in some seeds).
LOOK_QUESTIONS: tuple[str, ...] = ("Which word is hidden?", "Find the hidden word.", "What is the word?",
                                   "Play one round.")

# What look() says; "{w}" is the word, bare (one token wherever it stands).
LOOK_TRAIN_REPLIES: tuple[str, ...] = (
    "The hidden word is {w}.", "You see {w}.", "{w} is written on the card.", "Under the cup: {w}.",
    "The card says {w}.", "It is {w}.", "Found it: {w}.", "The word on the card is {w}.",
    "You lift the cup and see {w}.", "Hidden here: {w}.",
)
LOOK_HELDOUT_REPLIES: tuple[str, ...] = ("The card under the cup says {w}.", "{w} is the hidden word.",
                                         "You see the word {w} on the card.", "Written here: {w}.")


def look_tasks(split: str) -> list[dict[str, Any]]:
    """A split's tasks (`train`, `test`: held-out phrasings, `blind`, or a pool): `{"id", "word", "shown", "question",
    "reply"}`, `shown` what `look()`'s `reply` names. In `blind` it names a decoy, every (question, sentence) once with
    each hidden word: any policy scores exactly 1/6 unless it learns the word elsewhere."""
    if split in ("train", "test"):
        seed, replies = (2, LOOK_TRAIN_REPLIES) if split == "train" else (3, LOOK_HELDOUT_REPLIES)
        tasks = [{"word": w, "shown": w, "question": q, "reply": r.format(w=w)}
                 for w, r, q in _shuffled(seed, TARGETS, replies, LOOK_QUESTIONS)]
    elif split == "blind":  # the sentence and the question depend on the decoy only
        tasks = [{"word": w, "shown": decoy, "question": LOOK_QUESTIONS[i % len(LOOK_QUESTIONS)],
                  "reply": LOOK_HELDOUT_REPLIES[i % len(LOOK_HELDOUT_REPLIES)].format(w=decoy)}
                 for i, decoy in enumerate(TARGETS) for w in TARGETS]
    elif split in POOLS:
        return pool_tasks(split)
    else:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(LOOK_SPLITS)}")
    return [{"id": f"look-{split}-{i:03d}", **task} for i, task in enumerate(tasks)]


# Pools of mixed difficulty (`--pool`, bench_task_selection.py), one conversation for all kinds: `look`: the look task;
# `free`: any answer scores 1.0, `locked`: none does (no reward spread); `coin`: `look()` shows nothing, 3 words win.
POOL_KINDS: tuple[str, ...] = ("look", "free", "locked", "coin")
#: Split -> (kinds, tasks of each): `sparse` is like most real environments (most tasks solved or beyond reach).
POOLS: dict[str, tuple[tuple[str, ...], int]] = {"mixed": (("look", "free", "locked"), 40),
                                                 "sparse": (("look", "free", "locked", "free", "locked"), 24),
                                                 "kinds": (POOL_KINDS, 30)}
COIN_REPLY = "The card is face down."
#: Every split the look environment serves.
LOOK_SPLITS: tuple[str, ...] = ("train", "test", "blind", *POOLS)


def pool_tasks(split: str) -> list[dict[str, Any]]:
    """A pool's tasks, kinds interleaved, each with its `kind` (a coin task its `winners`); look tasks are the first
    training tasks."""
    kinds, per_kind = POOLS[split]
    rng, look = random.Random(4), look_tasks("train")
    by_kind = [[{**{key: look[(i + k * per_kind) % len(look)][key] for key in ("word", "shown", "question", "reply")},
                 "kind": kind} for i in range(per_kind)] for k, kind in enumerate(kinds)]  # a kind may come twice
    for task in (task for tasks in by_kind for task in tasks if task["kind"] == "coin"):
        task.update(shown="", reply=COIN_REPLY, winners=sorted(rng.sample(TARGETS, 3)))
    ordered = [by_kind[k][i] for i in range(per_kind) for k in range(len(kinds))]
    return [{"id": f"look-{split}-{i:03d}", **task} for i, task in enumerate(ordered)]


def look_messages(task: dict[str, Any]) -> list[dict[str, str]]:
    """The task's conversation as chat messages: the rules as a system turn, then the user's question."""
    return [{"role": "system", "content": LOOK_SYSTEM}, {"role": "user", "content": task["question"]}]


def look_prompt(task: dict[str, Any]) -> str:
    """The conversation as one text, as `environment_factory`'s `reset()` returns it (`Prompt.flat`)."""
    return f"{LOOK_SYSTEM}\n\n{task['question']}"


def normalise_answer(message: str) -> str:
    """The model's final message as a bare lower-case word (surrounding space, quotes and a final period dropped)."""
    return message.strip().strip("\"'").rstrip(".!").strip().strip("\"'").lower()


def grade(task: dict[str, Any], message: str) -> tuple[float, str, dict[str, Any]]:
    """A final message's `(reward, reply_text, metadata)`: 1.0 for the hidden word (or by the pool kind's rule);
    `metadata`: what was hidden, shown, given, and whether the answer named what `look()` showed (`follow`)."""
    given = normalise_answer(message)
    kind = task.get("kind", "look")
    right = (kind == "free" or (kind == "look" and given == task["word"])
             or (kind == "coin" and given in task.get("winners", ())))
    meta = {"word": task["word"], "shown": task["shown"], "given": given, "follow": given == task["shown"]}
    return (1.0 if right else 0.0), ("right" if right else "wrong"), meta


def look_warm_start_episodes(task: dict[str, Any]) -> list[tuple[str, dict[str, Any], str, str]]:
    """`warm_start_episodes` of the look task, `(..., final_message)`: `look()`, then each word once (so chance)."""
    return [(LOOK_TOOL, {}, task["reply"], word) for word in TARGETS]
