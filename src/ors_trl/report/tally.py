"""The recognised inputs (`Input`); the tallies: every episode counted once, per task and per run (`EpisodeStats`);
a bounded sample of bodies.

Record values are untrusted: labels are shortened, reserved kinds bounded. A run is a labelled input's episodes, else
the records sharing a run id, source, policy and step (two inputs holding one run's episodes of a task are refused).
The sample (`max_episodes`, `SAMPLE_BYTES`) reserves a few episodes per problem kind, environment and run, then takes
the smallest hashes. An environment is keyed by its name, whatever server ran it, so runs on two ports compare.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from ..core.metrics import EpisodeStats, _number
from ..core.records import jsonable
from ..core.stats import label
from ..core.stats import task_label as _task_label
from ..protocol.errors import ConfigurationError

#: Episode bodies embedded in the page unless told otherwise.
DEFAULT_MAX_EPISODES = 2000
SAMPLE_BYTES = 12 * 1024 * 1024  # embedded episode JSON stops here whatever max_episodes says (page < 20 MB)
EMBED_TEXT = 100_000  # an episode too large for what is left of the budget is embedded with its texts cut to this
_RESERVED_PER_KIND = 5  # episodes kept for each failure kind, unscored reason, end reason, environment, run
_MAX_KINDS = 200  # distinct kinds reserved for

_Item = tuple[int, int, dict[str, Any]]  # (-hash, sequence number, the episode as the page's script reads it)
#: A run: ("label", name) for a named input, else ("auto", source, policy, step, run id).
RunKey = tuple[str | None, ...]
#: Record sources whose episodes are training's (the rollouts a trainer scored).
TRAINING_SOURCES = ("trl", "engine")


def _calls(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tool call entry of a record, the terminal tool's `final` call last."""
    out = [c for t in record.get("turns") or [] if isinstance(t, dict)
           for c in (t.get("tool_calls") or []) if isinstance(c, dict)]
    final = record.get("final")
    if isinstance(final, dict) and final.get("tool"):
        out.append(final)
    return out


def _kind(error: Any, fallback: str) -> str:
    return label(error.get("kind") or fallback) if isinstance(error, dict) else fallback


@dataclass
class Input:
    """One recognised input: "episodes" or a "trainer_state" (parsed: `state`); `run`: the name the user gave it."""

    path: Path
    kind: str
    label: str
    state: dict[str, Any] | None = None
    run: str | None = None


@dataclass
class Sample:
    """The embedded episodes in input order; how many the byte bound cut the texts of, and left out."""

    episodes: list[dict[str, Any]]
    clipped: int
    left_out: int


class Tally:
    """Everything the page says about episodes, counted in one pass per task and per run (then merged)."""

    def __init__(self, max_episodes: int, success_threshold: float, labels: list[str] | None = None) -> None:
        self.max_episodes = max_episodes
        self.success_threshold = success_threshold
        self._stats = partial(EpisodeStats, success_threshold)
        self.tasks: defaultdict[tuple[str, str], EpisodeStats] = defaultdict(self._stats)  # (environment, task)
        self.runs: dict[RunKey, EpisodeStats] = {("label", name): self._stats() for name in labels or []}
        self.cells: dict[RunKey, dict[tuple[str, str], EpisodeStats]] = defaultdict(lambda: defaultdict(self._stats))
        # run -> environment -> (splits, hosts): where each run's episodes ran
        self.places: defaultdict[RunKey, dict[str, tuple[set[str], set[str]]]] = defaultdict(dict)
        self.run_failures: defaultdict[RunKey, Counter[str]] = defaultdict(Counter)  # tool-call and episode errors
        self.rewards: list[float] = []  # the lowest and highest reward seen
        self._claims: dict[tuple[Any, ...], str] = {}  # (run, environment, task, repeat) -> the input holding it
        self.embedded: Counter[tuple[str, str]] = Counter()  # per (environment, task)
        self.open_s: defaultdict[str, array[float]] = defaultdict(lambda: array("d"))
        self.call_s: defaultdict[str, array[float]] = defaultdict(lambda: array("d"))
        self.seq = 0
        self._sample: list[_Item] = []  # a max-heap by hash
        self._reserved: dict[str, list[_Item]] = {}

    def add(self, rec: dict[str, Any], source: str, run_name: str | None = None, origin: str | None = None) -> None:
        """Count one record (current shape) of the input `source` and offer it to the sample."""
        target = label(rec.get("target") or "")  # its server as a host (`127.0.0.1:8080`), a catalog name as it is
        host = (target.split("://", 1)[1].rstrip("/") if "://" in target else target) or None
        env, task = label(rec.get("environment") or host or "(unknown)"), _task_label(rec)
        run = self._run_of(rec, source, run_name, env, task, origin or source)
        splits, hosts = self.places[run].setdefault(env, (set(), set()))
        if len(splits) < _MAX_KINDS:
            splits.add(label(rec.get("split") or "-"))
        if host and len(hosts) < _MAX_KINDS:
            hosts.add(host)
        reward = _number(rec.get("reward"))
        if reward is not None:
            self.rewards = [min([reward, *self.rewards[:1]]), max([reward, *self.rewards[1:]])]
        error = rec.get("error")
        unscored = None if reward is not None else label(rec.get("unscored") or ("error" if error else "no_reward"))
        end = label(rec.get("end_reason") or "(none)")
        calls = _calls(rec)
        fails = [_kind(c["error"], "failed") for c in calls if c.get("error")]
        tags = sorted({f"failure: {k}" for k in fails} | ({f"error: {_kind(error, 'error')}"} if error else set())
                      | ({f"unscored: {unscored}"} if unscored else set()))

        counted = {**rec, "end_reason": end, "unscored": unscored}  # the labels, bounded
        self.tasks[(env, task)].add_record(counted)
        self.runs.setdefault(run, self._stats()).add_record(counted)
        self.cells[run][(env, task)].add_record(counted)
        self.run_failures[run].update(f"tool call failed: {k}" for k in fails)
        if error:
            self.run_failures[run][f"episode error: {_kind(error, 'error')}"] += 1
        timings = rec.get("timings")
        if isinstance(timings, dict) and (opened := _number(timings.get("open"))) is not None:
            self.open_s[env].append(opened)
        self.call_s[env].extend(s for c in calls if (s := _number(c.get("seconds"))) is not None)

        self.seq += 1
        run_text = "|".join(map(str, run))
        key = f"{self.seq}|{run_text}|{label(rec.get('started_at'))}|{env}|{task}".encode("utf-8", "replace")
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        item = (-h, self.seq, {"env": env, "task": task, "run": run, "reward": reward, "tags": tags, "rec": rec})
        self._offer(self._sample, item, self.max_episodes)
        if self.max_episodes:
            for kind in (*tags, f"end: {end}", f"env: {env}", f"run: {run_text}"):
                if kind in self._reserved or len(self._reserved) < _MAX_KINDS:
                    self._offer(self._reserved.setdefault(kind, []), item, _RESERVED_PER_KIND)

    def _run_of(self, rec: dict[str, Any], source: str, name: str | None, env: str, task: str, origin: str) -> RunKey:
        """The run a record belongs to; refuses a second input holding the same run's episode of a task."""
        if name is not None:
            return ("label", name)
        step = _number(rec.get("step"))
        run: RunKey = ("auto", label(rec.get("source") or "") or None, label(rec.get("policy") or "") or None,
                       None if step is None else f"step {step:g}", label(rec.get("run") or source))
        holder = self._claims.setdefault((run, env, task, label(rec.get("repeat"))), origin)
        if holder != origin:
            raise ConfigurationError(
                f"{holder} and {origin} both hold episodes of one run (run id {run[4]}, source {run[1] or '-'}, "
                f"policy {run[2] or '-'}) for the same task ({env} {task}), so they cannot be told apart; name them "
                f"with --label NAME=FILE (write_report(labels=...)), e.g. --label before={holder} --label "
                f"after={origin}")
        return run

    def hosts(self, env: str) -> list[str]:
        """The servers that ran an environment, over every run."""
        return sorted({h for envs in self.places.values() for h in envs.get(env, ((), ()))[1]})

    @cached_property
    def run_names(self) -> dict[RunKey, str]:
        """Each run's label, else the parts of its key that differ between runs (with the run id where needed); a
        training source (`trl`, `engine`) is said as such: `training`."""
        auto = [k for k in self.runs if k[0] == "auto"]
        varies = [len({k[i] for k in auto}) > 1 for i in (1, 2, 3)]
        names: dict[RunKey, str] = {}
        for k in self.runs:
            if k[0] == "label":
                names[k] = str(k[1])
                continue
            source = "training" if k[1] in TRAINING_SOURCES else k[1]
            parts = [str(p) for p, v in zip((source, *k[2:4]), varies, strict=True) if v and p]
            names[k] = " · ".join(parts) or str(source or k[4])
        alike = Counter(names[k] for k in auto)
        for k in auto:
            if alike[names[k]] > 1 and names[k] != k[4]:
                names[k] = f"{names[k]} · {k[4]}"
        return names

    @cached_property
    def envs(self) -> dict[str, EpisodeStats]:
        out: defaultdict[str, EpisodeStats] = defaultdict(self._stats)
        for (env, _), stats in self.tasks.items():
            out[env].merge(stats)
        return dict(out)

    @cached_property
    def total(self) -> EpisodeStats:
        out = self._stats()
        for stats in self.runs.values():
            out.merge(stats)
        return out

    @staticmethod
    def _offer(heap: list[_Item], item: _Item, size: int) -> None:
        if len(heap) < size:
            heapq.heappush(heap, item)
        elif size and item[0] > heap[0][0]:  # smaller hash than the largest kept
            heapq.heapreplace(heap, item)

    def sample(self) -> Sample:
        """The episodes to embed: round-robin over the kinds, the reserved ones (up to half the sample, at least one
        per kind where there is room), then the rest by hash. One too large for what is left of the byte budget is
        embedded with its texts cut (marked), else left out (the next still get their turn)."""
        by_hash = sorted(self._sample, reverse=True)
        buckets = [sorted(b, reverse=True) for _, b in sorted(self._reserved.items())]
        reserve = min(self.max_episodes, max(len(buckets), self.max_episodes // 2))
        order: dict[int, dict[str, Any]] = {}
        for r in range(_RESERVED_PER_KIND):
            for bucket in buckets:
                if len(order) < reserve and r < len(bucket):
                    order.setdefault(bucket[r][1], bucket[r][2])
        for _, seq, ep in by_hash:
            if len(order) >= self.max_episodes:
                break
            order.setdefault(seq, ep)
        chosen, size, clipped, left_out = [], 0, 0, 0
        for seq, ep in order.items():
            ep["run"] = self.run_names.get(ep["run"], ep["run"])
            rec = ep["rec"]
            for clip in ({}, {"max_text": EMBED_TEXT, "fields": None}):  # whole, else with its texts cut
                ep["rec"] = jsonable(rec, **clip)  # JSON.parse-able: no NaN, no lone surrogate, bounded depth
                if size + (n := len(json.dumps(ep, ensure_ascii=False))) <= SAMPLE_BYTES:
                    size, clipped = size + n, clipped + bool(clip)
                    chosen.append((seq, ep))
                    break
            else:
                left_out += 1
        chosen.sort(key=lambda x: x[0])
        self.embedded = Counter((ep["env"], ep["task"]) for _, ep in chosen)
        return Sample([dict(ep, id=i) for i, (_, ep) in enumerate(chosen)], clipped, left_out)
