"""The `ors-trl` command line (also `python -m ors_trl`): look at an environment, evaluate a policy on it, report.

    ors-trl inspect http://127.0.0.1:8000
    ors-trl eval Eigent/SETA --base-url http://127.0.0.1:8001/v1 --model my-model --output episodes.jsonl
    ors-trl report episodes.jsonl ./trainer-output --output report.html

Heavy packages (torch, transformers, the openreward SDK) are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import math
import os
import re
import sys
import textwrap
import traceback
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol.errors import require_extra
from ..protocol.text import escape_controls, one_line, repair

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
#: Set to 1 for tracebacks on failure, as --debug does.
DEBUG_ENV = "ORS_TRL_DEBUG"

#: `ors-trl inspect`'s waits where --timeout/--retries are not given: someone at a terminal is waiting, so a server
#: that accepts and never answers is an error after about half a minute (3 tries of 10 s), not six minutes.
INSPECT_TIMEOUT = 10.0
INSPECT_RETRIES = 2

_EPILOG = """\
exit codes:
  0    success
  1    runtime or environment error: server unreachable, unknown environment or split, the environment
       or the policy failed; for eval, also when every episode ended in an error; for report, an
       --output that cannot be written; for cleanup, an orphaned session that could not be deleted
       (kept for the next run; names in the folder that are not registry files are skipped and
       listed, and do not change the exit code)
  2    usage error: invalid arguments, malformed target, missing API key, a missing extra (the error
       names it: pip install 'ors-trl[trl]', [demo], [report]), a --model path that is not a
       model directory, an existing --output without --resume/--overwrite, a --success-threshold
       outside the rewards seen; a report INPUT or --label file that is missing, unreadable, or not an
       episode log, eval output or trainer state, two INPUTs holding one run's episodes of a task
       (name them with --label), or a report --output that is one of its INPUTs
  130  interrupted (Ctrl-C); eval keeps every finished episode in --output, continue with --resume
Every failure is one line, "ors-trl COMMAND: error: ..."; --debug (or ORS_TRL_DEBUG=1) adds the traceback.

TARGET is the URL of a self-hosted ORS server (http://127.0.0.1:8000) or an OpenReward catalog name
(owner/name, needs OPENREWARD_API_KEY). Text from the environment is printed with its control
characters escaped (\\x1b, \\u202e), so it cannot retitle, clear or rewrite the terminal.
"""


class _UsageError(Exception):
    """A command-line problem found after parsing (exit code 2)."""


def _number(kind: type[int] | type[float], low: float, *, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: `kind` at least `low` (above it with `strict`), with a message naming the bound."""
    want = "an integer" if kind is int else "a number"
    if math.isfinite(low):
        want += f" {'>' if strict else '>='} {low:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if not (value > low if strict else value >= low) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


_non_negative_int = _number(int, 0)
_positive_int = _number(int, 1)
_positive_seconds = _number(float, 0, strict=True)
_finite_number = _number(float, -math.inf)


def _weights(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not math.isfinite(v) or v < 0 for v in values) or not sum(values) > 0:
        raise argparse.ArgumentTypeError(f"expected non-negative weights with a positive sum, got {text!r}")
    return values


def _label(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    return name.strip(), path


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_override(text: str) -> tuple[str, str]:
    """KEY=VALUE of --env-override; the text is never quoted back (the value may be a key)."""
    name, sep, value = text.partition("=")
    if not sep or not _ENV_NAME.fullmatch(name):
        want = "KEY=VALUE (no '=' in it" if not sep else ("KEY=VALUE with KEY an environment variable name (letters, "
                                                           "digits and underscores, not starting with a digit")
        raise argparse.ArgumentTypeError(f"expected {want}; the text is not shown: it may be a secret)")
    return name, value


def _indices(text: str) -> list[int]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part[1:]:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise argparse.ArgumentTypeError(f"bad index range {part!r} (use e.g. 0,3,5 or 0-9)")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"bad task index {part!r} (use e.g. 0,3,5 or 0-9)")
    if not out:
        raise argparse.ArgumentTypeError("no task index given")
    return out


def _tool_call(text: str) -> tuple[str, dict[str, Any]]:
    """NAME[=JSON] of `inspect --call`."""
    name, _, raw = text.partition("=")
    try:
        arguments = json.loads(raw) if raw else {}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: the arguments after '=' are not JSON") from None
    if not name or not isinstance(arguments, dict):
        raise argparse.ArgumentTypeError(f"{text}: give NAME or NAME='{{...}}' (a JSON object)")
    return name, arguments


def _difficulty_filter(text: str) -> tuple[str, Any]:
    """KEY=VALUE of `inspect --difficulty-filter`: a `PlatformDifficulty` filter."""
    key, sep, value = text.partition("=")
    if not sep or key not in ("model_name", "min_model_params", "max_model_params", "training_stage"):
        raise argparse.ArgumentTypeError(f"{text}: give model_name=, min_model_params=, max_model_params= or "
                                         "training_stage=")
    return key, _non_negative_int(value) if key.endswith("_params") else value


def _layout(description: str) -> dict[str, Any]:
    """A parser's help: `description` as one paragraph, then the exit codes (the common epilog)."""
    return {"description": textwrap.fill(description, width=100, break_on_hyphens=False), "epilog": _EPILOG,
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def _flag(p: Any, spec: str, text: str, **options: Any) -> None:
    """`p.add_argument`: `spec` names the flag and its metavar (`"--tasks K"`); without one, a switch (store_true)."""
    *names, last = spec.split()
    if last.startswith("-"):
        names.append(last)
        options.setdefault("action", "store_true")
    else:
        options["metavar"] = last
    p.add_argument(*names, help=text, **options)


def _add_output(p: argparse.ArgumentParser) -> None:
    _flag(p, "--json", "print one JSON document on stdout instead of text")
    _flag(p, "-v --verbose", "log debug details to stderr")


def _add_success_threshold(p: argparse.ArgumentParser) -> None:
    from ..core.metrics import DEFAULT_SUCCESS_THRESHOLD

    _flag(p, "--success-threshold X", f"an episode succeeded when its reward is at least X (default "
          f"{DEFAULT_SUCCESS_THRESHOLD:g}; one given must lie within the rewards seen)", type=_finite_number)


def _add_common(p: argparse.ArgumentParser, sessions: str, toolset: str, *, many: bool = False,
                timeout: float | None = None, retries: int | None = None) -> None:
    """TARGET (several with `many`), --env-name, the output flags and the client's flags (`_client_options`);
    `toolset` is --toolset's help, `sessions` the sessions --toolset-fallback and --env-override act on; `timeout`
    and `retries` the defaults of --timeout and --retries (None: the client's)."""
    several = "; several: a mix, reported per environment and weighted overall" if many else ""
    p.add_argument("target", metavar="TARGET", nargs="+" if many else None,
                   help=f"server URL (http://127.0.0.1:8000) or catalog name (owner/name){several}")
    each = "; once for every TARGET, once per TARGET, or several for one TARGET" if many else ""
    _flag(p, "--env-name N", f"environment on a server hosting several (default: the first){each}",
          action="append" if many else "store")
    _add_output(p)
    _flag(p, "--timeout S", f"seconds for connecting and for each request to the environment server other than a tool "
          f"call (default {'10 to connect, 60 per request' if timeout is None else f'{timeout:g}'})",
          type=_positive_seconds, default=timeout)
    _flag(p, "--retries N", "retries of a request after a network error or 429/502/503/504 (default "
          f"{5 if retries is None else retries})", type=_non_negative_int, default=retries)
    _flag(p, "--toolset NAME", toolset)
    _flag(p, "--toolset-fallback", f"when the server refuses --toolset, open {sessions} without it (one log line), "
          "not fail")
    _flag(p, "--env-override KEY=VALUE", f"an environment variable for {sessions} (repeatable; on the platform, "
          "non-owners may set only OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY); values "
          "are masked like secrets in every output", type=_env_override, action="append", default=[])


def _client_options(args: argparse.Namespace, tool_timeout: float | None = None) -> dict[str, Any]:
    """A client's keywords from `_add_common`'s flags (a name given twice, or a fallback without a toolset: usage
    errors); the waits from --timeout/--retries, else the client's defaults."""
    from ..protocol.transport import RetryPolicy, Timeouts

    overrides: dict[str, str] = {}
    for name, value in args.env_override:
        if name in overrides:
            raise _UsageError(f"--env-override {name} is given twice")
        overrides[name] = value
    if args.toolset_fallback and not args.toolset:
        raise _UsageError("--toolset-fallback needs --toolset (the toolset to fall back from)")
    options: dict[str, Any] = {"toolset": args.toolset, "toolset_fallback": args.toolset_fallback,
                               "env_overrides": overrides or None}
    timeout = args.timeout
    if timeout is not None or tool_timeout is not None:
        request = {} if timeout is None else {"connect": min(timeout, Timeouts.connect or timeout), "request": timeout}
        options["timeouts"] = Timeouts(**request, **({} if tool_timeout is None else {"tool_call": tool_timeout}))
    if args.retries is not None:
        options["retry"] = RetryPolicy(max_attempts=args.retries + 1)
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ors-trl", **_layout(
        "Inspect Open Reward Standard (ORS) environments and evaluate policies on them, through the same client and "
        "tool binding ors-trl uses for training with TRL."))
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"ors-trl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("inspect", **_layout(
        "Show what an ORS server offers and exactly what a model trained on it will see: environments, splits and "
        "task counts, a few tasks, shared and task-specific tools (listed from one probe session, closed again) with "
        "their JSON schemas, and the Python signatures and rendered schemas after binding, with binding warnings."),
        help="show environments, splits, tasks, tools and the tool signatures/schemas the model will see")
    _add_common(p, "the probe session", "give the probe session this platform toolset (e.g. codex) and list its tools",
                timeout=INSPECT_TIMEOUT, retries=INSPECT_RETRIES)
    _flag(p, "--split S", "split to show tasks of (default: train, else the first)")
    _flag(p, "--tasks K", "tasks to show (default 3)", type=_non_negative_int, default=3)
    _flag(p, "--probe-index I", "task whose session is probed for task-specific tools (default 0)",
          type=int, default=0)
    _flag(p, "--no-probe", "open no session (task-specific tools are not listed)")
    _flag(p, "--call NAME[=JSON]", "call this tool in the probe session (arguments: a JSON object, default {}) and "
          "show what its output holds (text, images); repeatable. Tools can have effects: only on request",
          type=_tool_call, action="append", default=[])
    _flag(p, "--difficulty SOURCE", "show the distribution of the split's per-task mean rewards, from an `ors-trl "
          "eval --output` file or an episode log, or (no SOURCE, catalog environments) the OpenReward platform's",
          nargs="?", const="platform")
    _flag(p, "--difficulty-filter KEY=VALUE", "narrow the platform's data: model_name, min_model_params, "
          "max_model_params, training_stage (pretrained, sft, rl); repeatable",
          type=_difficulty_filter, action="append", default=[])

    p = sub.add_parser("eval", **_layout(
        "Run a policy over tasks, concurrently, and report mean reward (over scored episodes), success rate and, with "
        "--repeats N, the unbiased pass@k for k = 1..N per task and over tasks (with a 95% interval for pass@1 over "
        "tasks), grading coverage, finished rate, tool calls and failures per episode, and tool-call health "
        "(episodes without a tool call, tool-call markup the parser missed, malformed arguments). Several TARGETs (or "
        "--env-name values) are evaluated one after the other and weighed together. The policy is a local "
        "transformers model directory (--model PATH) or a model behind an OpenAI-compatible chat-completions endpoint "
        "(--base-url URL --model NAME, e.g. vLLM). Every finished episode is appended to --output at once."),
        help="run a policy (local model or OpenAI-compatible endpoint) over tasks and report rewards")
    _add_common(p, "every session", "the platform toolset every session gets (e.g. codex, claude-code); its tools "
                "are bound too", many=True)
    _flag(p, "--model M", "local model directory, or the served model's name with --base-url (or --policy instead)")
    _flag(p, "--policy {random}", "no model: random (RandomPolicy) calls a random tool each turn with arguments drawn "
          "from its schema, seeded by --seed; to try an environment end to end", choices=("random",))
    _flag(p, "--base-url URL", "OpenAI-compatible API root, e.g. http://127.0.0.1:8001/v1")
    _flag(p, "--api-key KEY", "key for --base-url (default: $OPENAI_API_KEY); never logged or recorded")
    _flag(p, "--tool-markup TEXT", "with --base-url and a server without a tool-call parser: text that opens a tool "
          "call in the model's replies (a reply holding it counts as an unparsed tool call); repeatable (default: the "
          "major chat templates' markups, e.g. <tool_call>, [TOOL_CALLS], <|python_tag|>)", action="append")
    group = p.add_mutually_exclusive_group()
    _flag(group, "--num-tasks N", "the first N tasks (default: all)", type=_positive_int)
    _flag(group, "--indices LIST", "exactly these task indices, e.g. 0,3,5 or 0-9. First, one session per distinct "
          "listed task (task 0 without --indices) is opened and closed to find its task-specific tools, bound as "
          "training with the same selection binds them; --per-task-tools opens none", type=_indices)
    _flag(p, "--split S", "split to draw tasks from (default train)", default="train")
    _flag(p, "--repeats R", "episodes per task (default 1); pass@k is reported for k = 1..R",
          type=_positive_int, default=1)
    _add_success_threshold(p)
    _flag(p, "--weights W,W", "with several environments: their weights in the overall numbers (default: by episodes)",
          type=_weights)
    _flag(p, "--upload", "send every episode to the OpenReward rollout viewer (needs OPENREWARD_API_KEY and the "
          "openreward package); failures are counted, never fatal")
    _flag(p, "--concurrency C", "episodes (sessions) at once (default 8)", type=_positive_int, default=8)
    _flag(p, "--max-turns T", "policy replies per episode; the last one's calls are not run, as in TRL's loop (= "
          "max_tool_calling_iterations + 1; default 10)", type=_positive_int, default=10)
    _flag(p, "--tool-timeout S", "seconds one tool call may take before it fails (the episode is then unscored, "
          "counted as an error; default 3600)", type=_positive_seconds)
    _flag(p, "--episode-timeout S", "seconds one episode may take (policy replies and tool calls); past it the "
          "episode is closed, recorded with end reason timeout and scored None (default: no limit)",
          type=_positive_seconds)
    _flag(p, "--output FILE", "JSON-lines file receiving every episode")
    _flag(p, "--resume", "continue an interrupted evaluation from --output: run only the missing episodes")
    _flag(p, "--overwrite", "replace an existing --output")
    _flag(p, "--temperature X", "sampling temperature (default 0: greedy)", type=float, default=0.0)
    _flag(p, "--max-new-tokens K", "tokens per reply (local default 256; endpoint: max_tokens, not sent unless given)",
          type=_positive_int)
    _flag(p, "--seed S", "sampling seed (default 0)", type=int, default=0)
    _flag(p, "--device D", "device for a local model (default: cuda if available, else cpu)")
    _flag(p, "--max-tool-calls N", "tool calls per episode; later ones are refused (the model reads why), counted as "
          "refused failures as in training (default: no limit)", type=_non_negative_int)
    _flag(p, "--per-task-tools", "bind each episode's own tool list, not the tools training binds (no tool-discovery "
          "sessions are opened first)")
    _flag(p, "--score-groups", "also score each task's episodes (--repeats) together with the environment's "
          "/score_group")
    _flag(p, "--harness CMD", "play each episode with this agent command, which owns its loop: it runs once per "
          "episode with OPENAI_BASE_URL and OPENAI_API_KEY (the policy, served on loopback), ORS_MCP_URL and "
          "ORS_MCP_TOKEN (the episode's tools over MCP), ORS_PROMPT and ORS_MESSAGES set; its standard output is its "
          "final answer")
    _flag(p, "--no-progress", "no progress bar")

    p = sub.add_parser("serve-echo", **_layout(
        "Start the reference ORS server with the bundled demo environments (default: echo, TRL's guide task) on a "
        "loopback address, to try ors-trl without an environment of your own. Needs the openreward package (pip "
        "install 'ors-trl[demo]'). Stop it with Ctrl-C."),
        help="serve the bundled echo environment under the reference server on loopback (needs openreward)")
    _flag(p, "--port N", "TCP port to listen on", type=int, required=True)
    _flag(p, "--host HOST", "loopback address to bind (default 127.0.0.1)", default="127.0.0.1")
    _flag(p, "--envs ENVS", "comma-separated bundled environments (echo, demo, look, card: the answer only in an "
          "image, needs Pillow, and corridor: ~30 calls per episode, ORS_CORRIDOR_DEATH=CALL:EVERY kills sandboxes), "
          "or 'all' (default echo)", default="echo")
    _flag(p, "--log-level LOG_LEVEL", "server log level (default warning)", default="warning")

    from ..report.tally import DEFAULT_MAX_EPISODES

    p = sub.add_parser("report", **_layout(
        "Write one self-contained HTML page (nothing is fetched when it opens) on what the episodes did and how "
        "training went: a summary (rewards, grading, tool calls, failures by reason, end and unscored reasons, "
        "latency percentiles), curves over training steps from the trainer's log_history, a sortable per-task table "
        "and a browser of episode bodies (prompt, every tool call with its arguments, output, reward and failure, the "
        "final message and reward). It opens with the runs side by side (named with --label, else told apart by run "
        "id, source and policy): a row per run with success, pass@k and tool-call health and, against the first run, "
        "every shared task's change, the tasks that flipped and a paired test over tasks of whether the difference "
        "is beyond noise. Inputs are recognised by content: episode logs (episode_log=), eval outputs (ors-trl eval "
        "--output), trainer output folders (their trainer_state.json, also in checkpoint-*/) and trainer_state.json "
        "files. Every episode is counted; a deterministic sample of at most --max-episodes bodies is embedded."),
        help="write one self-contained HTML page from episode logs, eval outputs and trainer logs")
    p.add_argument("inputs", metavar="INPUT", nargs="*",
                   help="episode log or eval output (JSON lines), trainer output folder, or trainer_state.json")
    _flag(p, "--label NAME=FILE", "name the run FILE holds (an input too); repeat for each run, the first is the "
          "baseline the others are compared with, task by task", type=_label, action="append", default=[])
    _flag(p, "-o --output FILE", "the HTML file to write (default report.html; replaced if it exists)",
          default="report.html")
    _flag(p, "--max-episodes N", f"episode bodies embedded, a deterministic sample (default {DEFAULT_MAX_EPISODES})",
          type=_non_negative_int, default=DEFAULT_MAX_EPISODES)
    _add_success_threshold(p)
    _flag(p, "--title TEXT", "the page's title (default: names the environments)")
    _add_output(p)

    p = sub.add_parser("cleanup", **_layout(
        "Every process that opens ORS sessions registers each before creating it, in its working directory "
        "(.ors-trl/sessions, or $ORS_TRL_STATE_DIR/sessions). A process killed with SIGKILL (the out-of-memory "
        "killer, a pre-empted node, kill -9) cannot close its sessions: the next ors-trl process that opens a session "
        "there deletes them, and so does this command; only dead processes' sessions of this host, never a live "
        "process's. A catalog target needs OPENREWARD_API_KEY. ORS_TRL_SESSION_REGISTRY=0 turns the registry off."),
        help="delete the sessions that killed ors-trl processes left open (the orphan registry)")
    p.add_argument("dir", metavar="DIR", nargs="?", default=None,
                   help="the run's working directory, or a state folder (default: $ORS_TRL_STATE_DIR, else .)")
    _flag(p, "--any-host", "also treat registries written on other hosts as dead (a shared disk whose nodes are gone)")
    _add_output(p)

    for p in (parser, *sub.choices.values()):  # one flag before or after the command
        _flag(p, "--debug", f"on failure, also print the traceback (also: {DEBUG_ENV}=1)",
              default=False if p is parser else argparse.SUPPRESS)
    sub.add_parser("demo", help="the bundled GRPO demo (options are passed to it; `ors-trl demo --help`)",
                   add_help=False)
    return parser


class _EscapingFormatter(logging.Formatter):
    """Log lines with control characters escaped (they quote the environment), Python keywords as `parser`'s flags."""

    def __init__(self, fmt: str, parser: argparse.ArgumentParser | None = None) -> None:
        super().__init__(fmt)
        self.parser = parser

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(repair(_as_flags(super().format(record), self.parser)))


def _say(text: str, file: Any = None) -> None:
    """A line for the user (stderr by default), escaped and repaired: it quotes the environment's text."""
    print(escape_controls(repair(text)), file=file or sys.stderr)


def _show(args: argparse.Namespace, data: Any, text: str) -> None:
    """The result on stdout: `text` as `_say` writes it, or with --json `data` as one JSON document whose control and
    format characters (C1, U+202E...) and lone surrogates are `\\u` escapes too: harmless to a terminal."""
    if not args.json:
        _say(text, sys.stdout)
        return
    out = json.dumps(data, indent=2, ensure_ascii=False, default=str)
    if not out.isascii():
        out = "".join(c if c.isascii() or unicodedata.category(c) not in ("Cc", "Cf", "Cs") else json.dumps(c)[1:-1]
                      for c in out)
    print(out, flush=True)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..tasks.difficulty import PlatformDifficulty
    from .inspect import inspect_target, render_text

    if args.difficulty_filter and args.difficulty != "platform":
        raise _UsageError("--difficulty-filter narrows --difficulty's platform data (not a file's): pass --difficulty "
                          "without a SOURCE")
    difficulty = args.difficulty
    if difficulty == "platform":
        difficulty = PlatformDifficulty(**dict(args.difficulty_filter))
    client = _client_options(args)
    info = inspect_target(args.target, env_name=args.env_name, split=args.split, tasks=args.tasks,
                          probe=not args.no_probe, probe_index=args.probe_index, calls=args.call, **client)
    if difficulty is not None:
        from ..protocol.loop import get_loop
        from ..tasks.difficulty import describe

        info["difficulty"] = get_loop().run(describe(args.target, info.get("split") or "train", difficulty,
                                                     environment=info.get("environment"), **client))
    _show(args, info, render_text(info))
    return EXIT_OK


def _cmd_eval(args: argparse.Namespace) -> int:
    from ..evaluation.policies import OpenAIPolicy
    from ..evaluation.runner import EvalOptions
    from ..mix import OpenRewardMix
    from ..protocol.errors import ConfigurationError
    from ..spec import OpenRewardSpec

    if not args.base_url and not args.policy:
        require_extra("trl", "ors-trl eval --model DIR (a local model)")
    if args.upload:
        require_extra("demo", "ors-trl eval --upload", modules=("openreward",))
    if args.resume and not args.output:
        raise _UsageError("--resume needs --output (the episodes file to continue)")
    if args.resume and args.overwrite:
        raise _UsageError("--resume and --overwrite exclude each other")
    if args.harness is not None:
        import shlex

        from ..harness import Harness

        args.harness = Harness(shlex.split(args.harness))
    if args.policy:
        from ..evaluation.policies import RandomPolicy

        if args.model or args.base_url:
            raise _UsageError(f"--policy {args.policy} is the policy: it takes no --model or --base-url")
        policy: Any = RandomPolicy(args.seed)
    elif not args.model:
        raise _UsageError("give --model DIR (a local model), --base-url URL --model NAME (a served model) or "
                          "--policy random (no model)")
    elif args.base_url:
        policy = OpenAIPolicy(args.base_url, args.model, api_key=args.api_key, temperature=args.temperature,
                              max_tokens=args.max_new_tokens, seed=args.seed, tool_markup=args.tool_markup)
    else:
        if not os.path.isdir(args.model):
            raise _UsageError(f"--model {args.model!r} is not a local model directory; to evaluate a served model "
                              "pass --base-url http://HOST:PORT/v1 with --model NAME")
        for flag, given in (("--api-key", args.api_key), ("--tool-markup", args.tool_markup)):
            if given:
                raise _UsageError(f"{flag} is only used with --base-url")
        policy = args.model
    targets, names = args.target, args.env_name or [None]
    if len(targets) == 1 or len(names) == 1:
        pairs = [(target, name) for target in targets for name in names]
    elif len(names) == len(targets):
        pairs = list(zip(targets, names, strict=True))
    else:
        raise _UsageError(f"{len(names)} --env-name values for {len(targets)} TARGETs: give one for all, one per "
                          "TARGET, or several for one TARGET")
    if args.weights is not None and len(args.weights) != len(pairs):
        raise _UsageError(f"--weights has {len(args.weights)} values for {len(pairs)} environments")
    threshold = {} if args.success_threshold is None else {"success_threshold": args.success_threshold}
    client = _client_options(args, tool_timeout=args.tool_timeout)
    # Built as a training spec with the same selection: its probe sessions find the tools training binds (none with
    # --per-task-tools: each episode binds its own session's).
    specs = [OpenRewardSpec(target, split=args.split, env_name=env_name, num_tasks=args.num_tasks,
                            indices=args.indices, discover_task_tools=not args.per_task_tools,
                            score_groups=args.score_groups, max_tool_calls=args.max_tool_calls, **threshold, **client)
             for target, env_name in pairs]
    evaluated: Any = specs[0] if len(specs) == 1 else OpenRewardMix(specs, weights=args.weights)
    # the evaluation options are the flags named as `EvalOptions`' fields
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EvalOptions) if hasattr(args, f.name)}
    report = evaluated.evaluate(policy, progress=not args.no_progress, **options)
    if args.success_threshold is not None:
        from ..core.stats import check_threshold

        try:
            check_threshold(args.success_threshold, (e.get("reward") for e in report.episodes))
        except ConfigurationError as exc:
            kept = f"; the episodes are in {args.output}" if args.output else ""
            raise _UsageError(f"--success-threshold: {exc}{kept}") from None
    _show(args, report.to_dict(), report.summary())
    ran = report.num_episodes - report.num_resumed
    if ran and report.num_errors >= ran:  # resumed episodes are never errors: they would have been rerun
        first = next((e.get("error") for e in report.episodes if e.get("error")), None)
        _say(f"ors-trl eval: error: every episode ended in an error; first: {first}")
        return EXIT_ERROR
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    require_extra("report", "ors-trl report")
    from ..report import write_report

    try:
        if not args.inputs and not args.label:
            raise _UsageError("give at least one INPUT or --label NAME=FILE")
        summary = write_report(args.inputs, args.output, max_episodes=args.max_episodes, title=args.title,
                               success_threshold=args.success_threshold, labels=args.label)
    except OSError as exc:  # the inputs were readable (else ConfigurationError): the output is not writable
        _say(f"ors-trl report: error: cannot write {args.output}: {exc.strerror or exc}")
        return EXIT_ERROR
    envs = ", ".join(summary.environments) or "none"
    skipped = f"; {summary.skipped} record(s) skipped (see the page)" if summary.skipped else ""
    runs = ", ".join(summary.run_names) or "none"
    _show(args, dataclasses.asdict(summary),
          f"Wrote {summary.output} ({summary.bytes / 2**20:.1f} MB): {summary.episodes} episode(s) of "
          f"{len(summary.environments)} environment(s) ({envs}), {summary.runs} run(s) ({runs}), {summary.tasks} "
          f"task(s); {summary.embedded} episode bod{'y' if summary.embedded == 1 else 'ies'} embedded; curves from "
          f"{summary.trainer_states} trainer state(s), {summary.log_steps} logged step(s){skipped}")
    return EXIT_OK


def _cmd_cleanup(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from ..protocol.client import delete_orphans
    from ..protocol.registry import state_dir, sweep

    folder = Path(args.dir) if args.dir is not None else state_dir()
    if (folder / ".ors-trl").is_dir():
        folder = folder / ".ors-trl"
    if args.dir is not None and not folder.is_dir():
        raise _UsageError(f"{args.dir} is not a directory")
    result = asyncio.run(sweep(delete_orphans, folder / "sessions", any_host=args.any_host))
    _show(args, {"folder": str(folder / "sessions"), **dataclasses.asdict(result)},
          f"Deleted {result.deleted} session(s) left open by {result.processes} dead process(es) in "
          f"{folder / 'sessions'}; {result.failed} could not be deleted (kept: run again once the server is "
          f"reachable), {result.dropped} given up (older than a day, or their loopback server is gone); "
          f"{result.live} live process(es) and {result.other_hosts} other host(s)' registries left alone")
    if not args.json:
        for path, why in result.skipped.items():
            _say(f"ors-trl cleanup: skipped {path}: {why} (not a session registry file; left alone)")
    return EXIT_ERROR if result.failed else EXIT_OK


def _cmd_serve_echo(args: argparse.Namespace) -> int:
    require_extra("demo", "ors-trl serve-echo", modules=("openreward",))
    from ..testing import server

    try:
        server._require_loopback(args.host)
    except ValueError:
        raise _UsageError(f"serve-echo only binds to loopback addresses (127.0.0.1, ::1), not {args.host!r}") from None
    if not 0 < args.port < 65536:
        raise _UsageError(f"--port must be 1..65535, got {args.port}")
    os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    # before openreward is imported (below): its loggers read their level once, at import
    os.environ.setdefault("OPENREWARD_LOG_LEVEL", args.log_level.upper())
    from ..demo._environments import ENVIRONMENTS

    every = args.envs.strip() == "all"
    names = list(ENVIRONMENTS) if every else [n.strip() for n in args.envs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENVIRONMENTS]
    if unknown or not names:
        raise _UsageError(f"unknown environment(s) {unknown}; known: {', '.join(ENVIRONMENTS)}, all")
    missing = {n: why for n in names if (why := ENVIRONMENTS[n].unavailable())}  # type: ignore[attr-defined]
    for name, why in missing.items():  # named: an error; in 'all': left out, said
        _say(f"ors-trl serve-echo: {'note: leaving out' if every else 'error: cannot serve'} {name}: {why}")
    if missing and not every:
        return EXIT_ERROR
    names = [n for n in names if n not in missing]
    host = f"[{args.host}]" if ":" in args.host else args.host
    _say(f"ors-trl: serving {', '.join(names)} on http://{host}:{args.port} (Ctrl-C to stop)")
    paths = [f"{ENVIRONMENTS[n].__module__}:{ENVIRONMENTS[n].__qualname__}" for n in names]
    try:
        return int(server.main(["--port", str(args.port), "--host", args.host,
                                *(a for p in paths for a in ("--env", p)), "--log-level", args.log_level]) or 0)
    except SystemExit as exc:  # the server's own argument checks (e.g. an unknown --envs name)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises: Ctrl-C is how one stops it
        _say("ors-trl: server stopped")
        return EXIT_OK


def _cmd_demo(argv: list[str]) -> int:
    if not {"-h", "--help"} & set(argv):
        require_extra("demo", "ors-trl demo")
    try:
        run = importlib.import_module("ors_trl.demo").main
    except AttributeError as exc:  # this version has no demo
        _say(f"ors-trl demo: error: the demo is not available: {exc}")
        return EXIT_ERROR
    return int(run(argv) or 0)


#: Python keywords that a message may name and the CLI has no flag for under the same name (`api_key=` is the
#: platform's key; `--api-key` is the endpoint's).
_NOT_FLAGS = frozenset({"api_key"})
_KEYWORD = re.compile(r"\b([a-z][a-z0-9_]*)=(True\b|N\b|\[\.\.\.\]|(?![\w'\"{\[(]))")


def _as_flags(text: str, parser: argparse.ArgumentParser | None) -> str:
    """A library message as the command line says it: each Python keyword it names (`resume=True`, `env_name=`,
    `num_tasks=N`) as the command's flag (`--resume`, `--env-name`, `--num-tasks N`) where it has that flag."""
    flags = {o for a in parser._actions for o in a.option_strings} if parser else set()

    def flag(match: re.Match[str]) -> str:
        name, value = match.groups()
        option = "--" + name.replace("_", "-")
        if name in _NOT_FLAGS or option not in flags:
            return match.group(0)
        return option + {"N": " N", "[...]": " LIST"}.get(value, "")

    return _KEYWORD.sub(flag, text)


def _guarded(command: str, run: Callable[[], int], *, debug: bool, parser: argparse.ArgumentParser | None = None,
             interrupted: str = "") -> int:
    """`run()`'s exit code, and every failure as one line `ors-trl COMMAND: error: ...` with its exit code: a usage
    error, a bad configuration or a missing extra 2, an environment or runtime failure 1, Ctrl-C 130 (`interrupted`
    says what is kept). The traceback only with --debug or ORS_TRL_DEBUG=1."""
    from ..protocol.errors import ConfigurationError, ORSError, missing_extra

    try:
        return run()
    except SystemExit as exc:  # a parser's --help (0) or error (2, said already), or a message to print
        if isinstance(exc.code, int) or exc.code is None:
            return exc.code or EXIT_OK
        error, code = str(exc.code).removeprefix(f"ors-trl {command}: "), EXIT_USAGE
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        _say(f"ors-trl {command}: interrupted{interrupted}")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        extra = missing_extra(exc, f"ors-trl {command}")
        if extra is not None or isinstance(exc, _UsageError | ConfigurationError):
            error, code = str(extra or exc), EXIT_USAGE
        elif isinstance(exc, ORSError):
            error, code = str(exc), EXIT_ERROR
        else:  # not ors-trl's own error: its type says what it is
            error, code = f"{type(exc).__name__}: {exc}", EXIT_ERROR
            if not debug:
                error += f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
    error = error.removeprefix(f"ors-trl {command} ")  # a message naming the command it is written under
    _say(f"ors-trl {command}: error: {one_line(_as_flags(error, parser))}")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ors-trl` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    if argv and argv[0] == "demo":  # everything after `demo` belongs to the demo's own parser, but --debug
        rest = [a for a in argv[1:] if a != "--debug"]
        return _guarded("demo", lambda: _cmd_demo(rest), debug=debug or len(rest) < len(argv) - 1)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version exit 0, errors exit 2
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_EscapingFormatter("ors-trl: %(levelname)s: %(message)s", commands[args.command]))
    root = logging.getLogger("ors_trl")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING)
    root.propagate = False
    handlers = {"inspect": _cmd_inspect, "eval": _cmd_eval, "serve-echo": _cmd_serve_echo, "report": _cmd_report,
                "cleanup": _cmd_cleanup}
    kept = (f"; finished episodes are in {args.output}, continue with --resume"
            if args.command == "eval" and args.output else "")
    return _guarded(args.command, lambda: handlers[args.command](args), debug=debug or args.debug,
                    parser=commands[args.command], interrupted=kept)


if __name__ == "__main__":
    sys.exit(main())
