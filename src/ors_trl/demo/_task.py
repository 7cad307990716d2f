"""The demo's tasks, as pure Python (no `openreward` import), so they can be wrapped in ORS `Environment` classes.

Both tasks draw on the closed vocabulary `TARGETS` (six short words, each one token for the demo's tokenizer).

**look** (the default `ors-trl demo`): one of the six words is hidden; the conversation (a system turn with the
rules, a short user turn) is the same whatever the word, and only the `look()` tool's output names it. The model
answers with a plain final message, which the environment's terminal tool grades (`grade`). Held-out tasks phrase
`look()`'s answer in ways never seen in training; the `blind` split (`look()` names a decoy) is the shortcut control.
`look_tasks` (per split), `look_messages` / `look_prompt` (the conversation, as messages or flattened as TRL's
`environment_factory` shows it) and `look_warm_start_episodes` are its interface.

**echo** (`ors-trl demo --task echo`), in the spirit of TRL's OpenReward echo environment: the prompt quotes one of
the `TARGETS` and the model must call `echo(text=...)` with exactly that word (reward 1.0, and the episode finishes).
A K-way choice conditioned on the prompt, not free-form copying, which a ~0.5M-parameter model does not learn in
minutes on CPU. Train and held-out tasks (`train_tasks`, `heldout_tasks`: `{"id", "target", "prompt"}`) use
disjoint phrasings and fillers over the shared words, so held-out success measures reading the word the prompt asks
for, whatever the wording. `prompt` gives a task's text, `score` maps `(task, tool_args)` to
`(reward, finished, reply_text)`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

TOOL_NAME = "echo"

# The closed vocabulary of target words. Short, common and distinct, so each one becomes a single BPE token.
TARGETS: tuple[str, ...] = ("apple", "river", "stone", "cloud", "tiger", "piano")

# Phrasings: train and held-out templates are disjoint. "{t}" is the quoted target. The held-out phrasings are new
# sentences built from words that occur in the training phrasings, so they test reading the target in unseen wording
# (tokenized differently from anything trained on, and in one template with the target further from the end than in
# any training prompt), not robustness to unseen symbols.
TRAIN_TEMPLATES: tuple[str, ...] = (
    'Echo the word "{t}".', 'Please echo "{t}" back.', 'The target is "{t}". Echo it.', '"{t}" is the word to echo.',
    'Send "{t}" to the echo tool.', 'Call echo with "{t}".', 'Use the echo tool on "{t}".',
    'Echo back the word "{t}" now.', 'Your task: echo "{t}".', 'Repeat the word "{t}" with echo.',
)
HELDOUT_TEMPLATES: tuple[str, ...] = ('The word to echo is "{t}".', 'Call the echo tool with "{t}".',
                                      'Send the word "{t}" back.', '"{t}" is the target. Echo it.')

# Filler sentences placed before the instruction: train and held-out sets are disjoint (again from shared words).
TRAIN_FILLERS: tuple[str, ...] = ("", "Hello.", "Task ready.", "Here is a job.", "Quick one.", "Good morning.",
                                  "Next task.", "Please help.")
HELDOUT_FILLERS: tuple[str, ...] = ("Here is one.", "Quick job.", "Hello. Task ready.")

# The tool's text reply is the echo itself, whether the call was right or wrong; correctness is reported only through
# the reward. (A "Correct"/"Wrong" reply hands the model an easy cue to tell failed rollouts apart in its post-tool
# turn, where GRPO's negative advantages then push it off its closing message; in early experiments that rambling
# preceded a collapse of the whole tool-call format.)
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
    """All training tasks (targets x train templates x train fillers), in a fixed shuffled order."""
    return _make_tasks("train", TRAIN_TEMPLATES, TRAIN_FILLERS, seed=0)


def heldout_tasks() -> list[dict[str, Any]]:
    """Held-out tasks: same target words, but phrasings and fillers never used in training."""
    return _make_tasks("heldout", HELDOUT_TEMPLATES, HELDOUT_FILLERS, seed=1)


def prompt(task: dict[str, Any]) -> str:
    """The prompt text for a task (TRL appends it to the user message)."""
    return task["prompt"]


def score(task: dict[str, Any], tool_args: dict[str, Any]) -> tuple[float, bool, str]:
    """Score one `echo` call: `(reward, finished, reply_text)`: 1.0 and finished when `text` is exactly the target,
    else 0.0 (the episode goes on); the reply is the echoed word either way (see `REPLY_INVALID`)."""
    text = tool_args.get("text")
    if not isinstance(text, str):
        return 0.0, False, REPLY_INVALID
    return (1.0, True, text) if text == task["target"] else (0.0, False, text)


def warm_start_episodes(task: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """Episodes the format-only warm start imitates for a task: one `echo` call per allowed word, equally weighted.

    Returned as `(tool_name, arguments, reply_text)`. Uniform over `TARGETS` whatever the prompt says, so
    imitating them teaches the call format and the answer vocabulary but not which word a prompt asks for.
    """
    return [(TOOL_NAME, {"text": word}, score(task, {"text": word})[2]) for word in TARGETS]


# ── the "look" task: the answer is only in a tool's output ──────────────────────────────────────────────────────────
#
# The "blind" split is the shortcut control: `look()` there names a decoy, drawn independently of the hidden word.
# Every (conversation, decoy sentence) pair occurs once with each of the six hidden words, so any policy scores
# exactly 1/6 there unless something other than the tool tells it the word. A policy that reads the tool answers the
# decoy (`follow` in the terminal tool's metadata).

LOOK_TOOL = "look"
ANSWER_TOOL = "answer"
ANSWER_DESCRIPTION = "The model's final message: the hidden word."

LOOK_SYSTEM = ("You play a hidden word game. The hidden word is one of: " + ", ".join(TARGETS) + ". "
               "Call the look tool to see it, then reply with the word alone.")
# The user turn. Held-out tasks ask the same questions: what is held out is the wording of look()'s answer. (With
# unseen questions too, GRPO's updates broke the tool-call format on them in some seeds: the first turn then depends
# on tokens it never trained on, which tests robustness to a new prompt, not reading the tool.)
LOOK_QUESTIONS: tuple[str, ...] = ("Which word is hidden?", "Find the hidden word.", "What is the word?",
                                   "Play one round.")

# What look() says; "{w}" is the word, bare (the demo tokenizer keeps each target word one token wherever it stands).
LOOK_TRAIN_REPLIES: tuple[str, ...] = (
    "The hidden word is {w}.", "You see {w}.", "{w} is written on the card.", "Under the cup: {w}.",
    "The card says {w}.", "It is {w}.", "Found it: {w}.", "The word on the card is {w}.",
    "You lift the cup and see {w}.", "Hidden here: {w}.",
)
LOOK_HELDOUT_REPLIES: tuple[str, ...] = ("The card under the cup says {w}.", "{w} is the hidden word.",
                                         "You see the word {w} on the card.", "Written here: {w}.")


def look_tasks(split: str) -> list[dict[str, Any]]:
    """The tasks of a split: `train` (train phrasings), `test` (held-out phrasings), `blind` (decoys), or a pool.

    A task is `{"id", "word", "shown", "question", "reply"}`: `word` is hidden, `shown` is what `look()`
    names (`word` except in `blind`), `reply` is `look()`'s whole answer.
    """
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


# ── task pools of mixed difficulty (`ors-trl demo --pool mixed`, benchmarks/bench_task_selection.py) ───────────────
#
# The conversation is the same for every task, so a policy cannot tell the kinds apart: it can only spend episodes
# on them. `look` tasks are the demo's (solvable by reading `look()`: at chance, then learnable); `free` tasks
# score 1.0 whatever the answer (any attempt solves them), `locked` ones 0.0 (none does); a `coin` task's
# `look()` shows nothing and three of the six words win (a policy solves it by chance, half the time).
# Every group of a free or locked task has zero reward spread: it costs sessions and teaches GRPO nothing.

POOL_KINDS: tuple[str, ...] = ("look", "free", "locked", "coin")
#: Split -> (kinds, tasks of each): `mixed` is the demo's mixed pool (a third look tasks), `sparse` a pool where, as
#: on most real environments, most tasks are already solved or beyond reach (a fifth look tasks), `kinds` part A's.
POOLS: dict[str, tuple[tuple[str, ...], int]] = {"mixed": (("look", "free", "locked"), 40),
                                                 "sparse": (("look", "free", "locked", "free", "locked"), 24),
                                                 "kinds": (POOL_KINDS, 30)}
COIN_REPLY = "The card is face down."
#: Every split the look environment serves.
LOOK_SPLITS: tuple[str, ...] = ("train", "test", "blind", *POOLS)


def pool_tasks(split: str) -> list[dict[str, Any]]:
    """The tasks of a mixed pool (`mixed` or `kinds`), kinds interleaved: look tasks are the first training
    tasks of the look task; every task has a `kind` (and a coin task its three `winners`)."""
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
    """The conversation as one text, as TRL's `environment_factory` path shows it (system turn first): the text
    `OpenRewardEnvironment.reset()` returns (`Prompt.flat`), which tests/test_turns.py checks against TRL's own ids."""
    return f"{LOOK_SYSTEM}\n\n{task['question']}"


def normalise_answer(message: str) -> str:
    """The model's final message as a bare lower-case word (surrounding space, quotes and a final period dropped)."""
    return message.strip().strip("\"'").rstrip(".!").strip().strip("\"'").lower()


def grade(task: dict[str, Any], message: str) -> tuple[float, str, dict[str, Any]]:
    """Grade a final message: `(reward, reply_text, metadata)`; 1.0 when it is the hidden word, else 0.0 (a pool
    task: 1.0 for any answer to a free task, never for a locked one, for one of a coin task's winners). `metadata`
    says what was hidden, shown and given, and whether the answer named what `look()` showed (`follow`)."""
    given = normalise_answer(message)
    kind = task.get("kind", "look")
    right = (kind == "free" or (kind == "look" and given == task["word"])
             or (kind == "coin" and given in task.get("winners", ())))
    meta = {"word": task["word"], "shown": task["shown"], "given": given, "follow": given == task["shown"]}
    return (1.0 if right else 0.0), ("right" if right else "wrong"), meta


def look_warm_start_episodes(task: dict[str, Any]) -> list[tuple[str, dict[str, Any], str, str]]:
    """`warm_start_episodes` for the look task, as `(tool_name, arguments, reply_text, final_message)`: call
    `look()`, then answer each allowed word once (the warm-started model answers at chance, about 1/6)."""
    return [(LOOK_TOOL, {}, task["reply"], word) for word in TARGETS]
