"""Beyond one process: real two-process GRPO training (DDP, gloo on CPU) against one ORS server.

`tests/distributed/grpo_run.py` is launched twice with `accelerate launch --num_processes 2`, once per
integration path (`environment_factory` with the spec's three properties, and `spec.rollout_func`),
against one reference server started here. Each process writes a JSON report; the tests below read
them and the server's own counters.

Note on the launcher: in accelerate 1.15 `accelerate launch --cpu --num_processes 2` starts ONE process
(its simple launcher ignores `--num_processes` without an MPI hostfile). `--multi_gpu` goes through
torchrun and starts two; the script's `GRPOConfig(use_cpu=True)` then makes accelerate use gloo on CPU.
`test_two_processes_really_ran` checks that.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ors_trl.testing.server import free_port
from tests.fixtures.environments import server as fixture_server

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "distributed" / "grpo_run.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
MODES = ("env", "engine")
STEPS = 2
LAUNCH_TIMEOUT_S = 150
ECHO_KEY = "echoenvironment/echo"
METRIC = "env/echoenvironment/"


def launch(url: str, model_dir: str, out: Path, mode: str, *extra: str, state: Path | None = None,
           script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """`accelerate launch` two processes; bounded, and the whole process group is killed on timeout. `state`: the
    processes' own `ORS_TRL_STATE_DIR` (their orphan registry); `script`: another script of tests/distributed/, which
    takes --url, --model-dir, --out and `extra` (`mode` names its log)."""
    own = ("--mode", mode, "--steps", str(STEPS)) if script == SCRIPT else ()
    cmd = [
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(script), "--url", url, "--model-dir", model_dir, "--out", str(out), *own, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENREWARD_DISABLE_UPDATE_CHECK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
               p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)}
    if state is not None:
        env["ORS_TRL_STATE_DIR"] = str(state)
    log = out / f"launch-{mode}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pytest.fail(f"accelerate launch ({mode}) did not finish in {LAUNCH_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    return subprocess.CompletedProcess(cmd, rc, log.read_text(errors="replace"))


@pytest.fixture(scope="module")
def echo_server():
    """The module's one reference server (echo environment)."""
    with fixture_server("echo") as server:
        yield server


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory, echo_server):
    """Both launches against ONE reference server; per mode: the two reports and the server's counters."""
    out = tmp_path_factory.mktemp("distributed")
    results = {}
    server = echo_server
    for mode in MODES:
        before = server.stats()
        extra = ("--fork-check",) if mode == "engine" else ()
        started = time.monotonic()
        proc = launch(server.url, tiny_model_dir, out, mode, *extra)
        seconds = time.monotonic() - started
        assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout[-6000:]}"
        # The processes have exited; their closes were awaited before exit, so this should hold at once.
        after = server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
        reports = []
        for rank in (0, 1):
            with open(out / f"report-{mode}-rank{rank}.json") as fh:
                reports.append(json.load(fh))
        results[mode] = {"reports": reports, "before": before, "after": after, "seconds": seconds}
    return results


def _each(runs):
    for mode in MODES:
        yield mode, runs[mode]["reports"]


def test_two_processes_really_ran(runs):
    for mode, reports in _each(runs):
        assert [r["rank"] for r in reports] == [0, 1] == [r["process_index"] for r in reports], mode
        assert all(r["num_processes"] == 2 and r["backend"] == "gloo" for r in reports), mode
        assert reports[0]["pid"] != reports[1]["pid"], mode
        assert [r["global_step"] for r in reports] == [STEPS, STEPS], mode


def test_dataset_is_identical_on_every_process(runs):
    for mode, reports in _each(runs):
        assert reports[0]["dataset_fingerprint"] == reports[1]["dataset_fingerprint"], mode
        assert reports[0]["sampler_task_order"] == reports[1]["sampler_task_order"], mode
    assert runs["env"]["reports"][0]["dataset_fingerprint"] == runs["engine"]["reports"][0]["dataset_fingerprint"]


def test_rollouts_are_split_the_way_trl_splits_them(runs):
    for mode, reports in _each(runs):
        order = reports[0]["sampler_task_order"]  # RepeatSampler's indices, as task indices
        per_device = reports[0]["per_device_batch"]
        global_batch = reports[0]["generation_batch_size"]
        assert global_batch == 2 * per_device
        for step in range(STEPS):
            trl_batch = order[step * global_batch:(step + 1) * global_batch]
            union = []
            for rank, report in enumerate(reports):
                rows = [b["task_index"] for b in report["batches"] if b["step"] == step]
                assert len(rows) == 1, (mode, rank, step, report["batches"])  # generated once per step
                expected = trl_batch[rank * per_device:(rank + 1) * per_device]  # accelerate's shard of the batch
                assert rows[0] == expected, (mode, rank, step)
                # every rollout handed to this process opened exactly one session of its task, in this step
                opened = [o["index"] for o in report["opened"] if o["phase"] == f"step{step}"]
                assert sorted(opened) == sorted(expected), (mode, rank, step, opened)
                union += opened
            assert sorted(union) == sorted(trl_batch), (mode, step)  # no rollout lost, none run twice
        for report in reports:  # nothing opened during training outside the steps' batches
            assert {o["phase"] for o in report["opened"]} <= {"setup", "after", *(f"step{s}" for s in range(STEPS))}


def test_each_process_opens_its_own_sessions(runs):
    for mode, reports in _each(runs):
        sids = [{o["sid"] for o in r["opened"]} for r in reports]
        assert all(len(s) == len(r["opened"]) for s, r in zip(sids, reports, strict=True)), mode  # no sid reused
        assert not sids[0] & sids[1], mode  # no session shared between processes
        assert all(o["pid"] == r["pid"] for r in reports for o in r["opened"]), mode
        # Everything the server set up in this run was opened by exactly one of the processes (or the fork's child).
        child = reports[0].get("fork", {}).get("child", {}).get("sids", [])
        setups = runs[mode]["after"]["setups"] - runs[mode]["before"]["setups"]
        assert setups == len(sids[0]) + len(sids[1]) + len(child), mode
        if mode == "engine":  # the engine's episodes ran in sessions their own process opened
            for report, own in zip(reports, sids, strict=True):
                assert {ep["sid"] for ep in report["engine_last_episodes"]} <= own


def test_tools_ran_and_rewards_came_back_on_every_process(runs):
    for mode, reports in _each(runs):
        for report in reports:
            assert [r["step"] for r in report["rewards"]] == list(range(STEPS)), mode
            # even positions echo the right word (1.0), odd ones "nope" (0.0): scored by the server, per process
            assert all(r["rewards"] == [1.0, 0.0, 1.0, 0.0] for r in report["rewards"]), (mode, report["rewards"])
        local_calls = sum(m["value"] for r in reports for m in r["local_metrics"] if m["name"] == METRIC + "tool_calls")
        fork_calls = 2 if mode == "engine" else 0  # one call in the forked child, one in the parent after the fork
        server_calls = runs[mode]["after"]["tool_calls"].get(ECHO_KEY, 0) - runs[mode]["before"]["tool_calls"].get(
            ECHO_KEY, 0)
        # rank 0 retries its wrong echoes once: 6 calls a step, rank 1: 4 calls a step
        assert local_calls == STEPS * (6 + 4) == server_calls - fork_calls, mode


def test_ddp_keeps_the_replicas_in_sync(runs):
    for mode, reports in _each(runs):
        assert reports[0]["params_before"] == reports[1]["params_before"], mode
        assert reports[0]["params_after"] == reports[1]["params_after"], mode  # gradients were all-reduced
        assert reports[0]["params_after"] != reports[0]["params_before"], mode  # and an optimizer step happened


def test_environment_metrics_are_gathered_and_logged_once_per_step(runs):
    for mode, reports in _each(runs):
        histories = []
        for report in reports:
            entries = [{k: v for k, v in e.items() if k.startswith("env/")} for e in report["log_history"]]
            histories.append([(e["step"], m) for e, m in zip(report["log_history"], entries, strict=True) if m])
        # One entry with environment metrics per optimizer step (not one per process), identical on every rank.
        assert [s for s, _ in histories[0]] == list(range(1, STEPS + 1)), (mode, histories[0])
        assert histories[0] == histories[1], mode
        for step, logged in histories[0]:
            local = [{m["name"]: m["value"] for m in r["local_metrics"] if m["step"] == step - 1} for r in reports]
            assert set(logged) == set(local[0]) | set(local[1]), (mode, step)
            for name, value in logged.items():
                values = [loc[name] for loc in local if name in loc]
                if any(v != v for v in values):  # NaN is logged as None
                    continue
                assert value == pytest.approx(sum(values) / len(values)), (mode, step, name)
            # the gathered value is neither process's own: rank 0 made 6 calls, rank 1 made 4
            assert [loc[METRIC + "tool_calls"] for loc in local] == [6.0, 4.0], mode
            assert logged[METRIC + "tool_calls"] == 5.0
            assert logged[METRIC + "episodes"] == 4.0
        # Trackers (report_to) write from the world-process-zero only; that is rank 0 alone.
        assert [r["is_world_process_zero"] for r in reports] == [True, False], mode


def test_engine_makes_every_process_join_every_generation_call(runs):
    reports = runs["engine"]["reports"]
    sizes = [[(c["step"], c["n"]) for c in r["generate_calls"]] for r in reports]
    assert sizes[0] == sizes[1] == [(s, n) for s in range(STEPS) for n in (4, 4, 2)]
    # rank 1 had nothing left for the third turn: it joined with dummy prompts (fresh prompts, no tool response)
    third = [c for c in reports[1]["generate_calls"] if c["n"] == 2]
    assert all(c["responses"] == [0, 0] for c in third)
    assert all(c["responses"] == [2, 2] for c in reports[0]["generate_calls"] if c["n"] == 2)


def test_no_session_is_left_open(runs):
    for mode, reports in _each(runs):
        after = runs[mode]["after"]
        assert after["open_sessions"] == 0 and after["sessions"] == [], mode
        assert after["setups"] == after["teardowns"], mode
        for report in reports:
            assert report["client_open_sessions_after_train"] == 0, mode  # closed by the trainer's end, not by exit
            assert report["client_open_sessions_after_close"] == 0, mode


def test_fork_gives_the_child_its_own_loop_and_sessions(runs):
    fork = runs["engine"]["reports"][0]["fork"]
    child, parent = fork["child"], fork["parent"]
    assert "error" not in child, child.get("error")
    assert child["exit_status"] == 0
    assert child["pid"] != runs["engine"]["reports"][0]["pid"]
    assert child["loop_reset_after_fork"] is True  # ors_trl.protocol.loop dropped the parent's loop in the child
    assert child["fresh_loop"] is True  # and started its own on first use
    assert child["reward"] == 1.0  # a session opened, called and closed from the child
    assert parent["sid"] not in child["sids"]
    # After the child exited: the session it left open was closed by its own exit hook; the parent's is untouched.
    live = parent["server_sessions_after_child_exit"]
    assert parent["sid"] in live
    assert not set(child["sids"]) & set(live)
    assert parent["reward_after_fork"] == 0.0 and parent["loop_same"] is True  # the parent's session still works
    # The parent's objects fail fast in the child instead of waiting forever on a loop no thread runs.
    for key in ("inherited_client", "inherited_reset_cached", "inherited_tool_call", "inherited_reset_uncached"):
        assert child[key].startswith("raised "), (key, child[key])


def test_sessions_per_process_scale_with_the_per_device_batch(runs):
    """Each process opens one probe session (tool discovery) plus one session per rollout it runs, and holds at
    most its own per-device batch of them: sessions scale per process, not with the global batch."""
    for mode, reports in _each(runs):
        for report in reports:
            batch = report["per_device_batch"]
            phases = collections.Counter(o["phase"] for o in report["opened"])
            assert phases["setup"] == 1, (mode, phases)
            assert all(phases[f"step{s}"] == batch for s in range(STEPS)), (mode, phases)
            if mode == "engine":
                assert report["peak_open"] == batch  # the whole batch's episodes run at once
                assert report["open_at_step_end"] == [0] * STEPS  # and their sessions close when they end
            else:
                # adapters keep unfinished episodes' sessions until the step's end (spec.callbacks release them)
                assert report["peak_open"] <= 2 * batch
                assert all(n <= batch for n in report["open_at_step_end"]), report["open_at_step_end"]


@pytest.fixture(scope="module")
def adaptive_run(tiny_model_dir, tmp_path_factory):
    """One two-process launch with `task_sampling="adaptive"` (TRL's own loop): the two reports."""
    out = tmp_path_factory.mktemp("distributed-adaptive")
    with fixture_server("echo") as server:
        proc = launch(server.url, tiny_model_dir, out, "env", "--sampling", "adaptive")
        assert proc.returncode == 0, f"adaptive run failed:\n{proc.stdout[-6000:]}"
        server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
    reports = []
    for rank in (0, 1):
        with open(out / f"report-env-adaptive-rank{rank}.json") as fh:
            reports.append(json.load(fh))
    return reports


def test_every_process_draws_the_same_tasks_from_the_same_statistics(adaptive_run):
    """Adaptive sampling across two processes: each one's rewards reach one sampler state that every process
    holds alike, so every process draws the same tasks and TRL hands each its own share of them."""
    reports = adaptive_run
    assert [r["num_processes"] for r in reports] == [2, 2] and [r["global_step"] for r in reports] == [STEPS, STEPS]
    first, second = (r["sampler_state"] for r in reports)
    assert first == second  # the same draws, the same groups: identical states (random generator included)
    assert sum(first["drawn"].values()) >= STEPS * 4 and len(first["history"]) >= STEPS * 4
    for step in range(STEPS):  # the step's 4 groups (2 per process), distinct tasks: the processes did not overlap
        rows = [b["task_index"] for r in reports for b in r["batches"] if b["step"] == step]
        tasks = [t for part in rows for t in part[::2]]
        assert len(tasks) == 4 == len(set(tasks)), (step, rows)
    for report in reports:  # the groups of both processes were counted, on both: 4 a step, not each one's 2
        groups = [e["curriculum/echoenvironment/groups"] for e in report["log_history"]
                  if "curriculum/echoenvironment/groups" in e]
        assert groups == [4.0] * STEPS, groups


@pytest.fixture(scope="module")
def credit_run(tiny_model_dir, tmp_path_factory, echo_server):
    """One two-process launch of the engine with `credit="turn"` and `scale_rewards="batch"`: the two reports."""
    out = tmp_path_factory.mktemp("distributed-credit")
    proc = launch(echo_server.url, tiny_model_dir, out, "engine", "--credit")
    assert proc.returncode == 0, f"credit run failed:\n{proc.stdout[-6000:]}"
    echo_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
    return [json.loads((out / f"report-engine-credit-rank{rank}.json").read_text()) for rank in (0, 1)]


def _turn_advantages(returns: list[list[float]], group: int) -> list[list[float]]:
    """Per rollout and turn, the return against its group's mean at that turn, over the std of every such residual
    of the whole batch (TRL's `scale_rewards="batch"`), computed here from the returns alone."""
    residuals = []
    for g in range(0, len(returns), group):
        rows = returns[g:g + group]
        for row in rows:
            residuals.append([x - statistics.mean(r[t] for r in rows if len(r) > t) for t, x in enumerate(row)])
    flat = [x for row in residuals for x in row]
    scale = statistics.stdev(flat) if len(flat) > 1 else 0.0
    return [[x / (scale + 1e-4) for x in row] for row in residuals]


def test_turn_credit_is_normalised_over_both_processes(credit_run):
    """`credit="turn"` under two processes: each process's turn advantages are its rows' share of the ones computed
    over the whole gathered batch (the processes' rollouts have different turn counts, so a per-process computation
    gives other numbers), and the collective gather lets both processes finish every step."""
    reports = credit_run
    assert [r["global_step"] for r in reports] == [STEPS, STEPS]
    per_device, group = reports[0]["per_device_batch"], 2
    for step in range(STEPS):
        parts = [[row for c in r["credit"] if c["step"] == step for row in c["rows"]] for r in reports]
        assert [len(p) for p in parts] == [per_device, per_device], step
        rows = parts[0] + parts[1]  # TRL's global batch: rank 0's rows, then rank 1's
        returns = [row["returns"] for row in rows]
        assert max(map(len, returns[:per_device])) > max(map(len, returns[per_device:])), returns  # rank 0: 3 turns
        expected = _turn_advantages(returns, group)
        local = [x for row in _turn_advantages(returns[:per_device], group) for x in row]
        assert local != pytest.approx([x for row in expected[:per_device] for x in row], abs=1e-3)  # not one process's
        for i, (row, want) in enumerate(zip(rows, expected, strict=True)):
            spans = row["spans"]
            assert len(spans) == len(want) and all(len(set(span)) == 1 for span in spans), (step, i, row)
            got = [span[0] - spans[0][0] for span in spans]  # (A_episode + A_turn(t)) / 2, less its first turn's
            assert got == pytest.approx([(a - want[0]) / 2 for a in want], abs=1e-4), (step, i, row)
        assert any(len(set(map(round, w, [4] * len(w)))) > 1 for w in expected)  # turns told apart somewhere
    for report in reports:
        logged = [e["credit/turns"] for e in report["log_history"] if "credit/turns" in e]
        assert len(logged) == STEPS and all(v > 1 for v in logged), logged


@pytest.fixture(scope="module")
def harness_run(tiny_model_dir, tmp_path_factory, echo_server):
    """One two-process launch with `rollout_func=Harness(agent).rollout_func(spec)`: the reports, the server's counters
    and the processes' orphan registry folder."""
    out = tmp_path_factory.mktemp("distributed-harness")
    before = echo_server.stats()
    proc = launch(echo_server.url, tiny_model_dir, out, "harness", state=out / "state")
    assert proc.returncode == 0, f"harness run failed:\n{proc.stdout[-6000:]}"
    after = echo_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
    reports = [json.loads((out / f"report-harness-rank{rank}.json").read_text()) for rank in (0, 1)]
    return {"reports": reports, "before": before, "after": after, "state": out / "state"}


def test_a_harness_trains_under_two_processes(harness_run):
    """An agent harness (the OpenAI Agents SDK over the capture endpoint and MCP) as GRPOTrainer's rollout_func under
    `accelerate launch`: each process plays its own share of the batch as harness episodes scored by the server."""
    reports, before, after = harness_run["reports"], harness_run["before"], harness_run["after"]
    assert [r["rank"] for r in reports] == [0, 1] == [r["process_index"] for r in reports]
    assert all(r["num_processes"] == 2 and r["backend"] == "gloo" for r in reports)
    assert reports[0]["pid"] != reports[1]["pid"] and [r["global_step"] for r in reports] == [STEPS, STEPS]
    order, per_device = reports[0]["sampler_task_order"], reports[0]["per_device_batch"]
    assert reports[1]["sampler_task_order"] == order
    seen = set()
    for rank, report in enumerate(reports):
        for step in range(STEPS):
            batch = order[step * 2 * per_device:(step + 1) * 2 * per_device][rank * per_device:(rank + 1) * per_device]
            episodes = [e for e in report["harness_episodes"] if e["step"] == step]
            assert sorted(e["task_index"] for e in episodes) == sorted(batch), (rank, step)
            for e in episodes:  # played by the harness (the agent's model calls, trained)
                assert e["harness"] is not None and e["harness"]["model_calls"] >= 2 and e["harness"]["trained_calls"] >= 2, e
            rewards = [r["rewards"] for r in report["rewards"] if r["step"] == step]
            assert rewards == [[e["reward"] for e in episodes]], (rank, step, rewards)  # the server's, to TRL
            # the first agent of a group to ask echoes the right word (1.0), the other "nope" (0.0)
            assert all(sorted(rewards[0][i:i + 2]) == [0.0, 1.0] for i in range(0, per_device, 2)), rewards
            seen |= set(rewards[0])
        assert report["client_open_sessions_after_train"] == 0 == report["client_open_sessions_after_close"]
    assert seen == {0.0, 1.0}
    sids = [{e["sid"] for e in r["harness_episodes"]} for r in reports]
    assert not sids[0] & sids[1] and all(len(s) == STEPS * per_device for s in sids)  # each process its own sessions
    assert reports[0]["params_before"] == reports[1]["params_before"]
    assert reports[0]["params_after"] == reports[1]["params_after"] != reports[0]["params_before"]  # DDP in sync
    # rank 0 retries its wrong echoes (a third turn): rank 1 joins those generation calls too, as with the engine
    calls = [collections.Counter(c["step"] for c in r["generate_calls"]) for r in reports]
    assert calls[0] == calls[1] and all(calls[0][s] >= 3 for s in range(STEPS)), calls
    for report in reports:
        logged = [e for e in report["log_history"] if METRIC + "episodes" in e]
        assert [e["step"] for e in logged] == list(range(1, STEPS + 1)) and all(
            e[METRIC + "episodes"] == per_device for e in logged), logged
    assert after["open_sessions"] == 0 and after["sessions"] == []
    assert after["setups"] - before["setups"] == after["teardowns"] - before["teardowns"] > 0
    assert (harness_run["state"] / "sessions").is_dir()  # the processes kept their orphan registry there
    assert list(harness_run["state"].glob("sessions/*.sessions")) == []  # and left it empty


def test_eval_callback_with_fewer_held_out_episodes_than_processes(tiny_model_dir, tmp_path, echo_server):
    """`eval_callback(tasks=1)` under two processes: one process has no held-out episode, yet it must join every
    collective call of the evaluation (the engine's generation rounds, the gathering of the episodes), else the
    processes wait on each other. Both end the step with the same evaluation: one episode, logged at step 1."""
    run = launch(echo_server.url, tiny_model_dir, tmp_path, "eval", script=SCRIPT.with_name("eval_run.py"))
    assert run.returncode == 0, run.stdout[-4000:]
    for rank in (0, 1):
        history = json.loads((tmp_path / f"report-eval-rank{rank}.json").read_text())["history"]
        assert [(h["step"], h[f"{METRIC.replace('env/', 'eval/')}episodes"]) for h in history] == [(1, 1)]
