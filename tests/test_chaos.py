"""The chaos soak as part of the suite: `benchmarks/bench_chaos.py --quick`'s core, in-process.

112 GRPO episodes, half through the rollout engine and half through TRL's own tool loop (a real
`GRPOTrainer`, scripted generation), against a reference server behind a `FaultProxy` that injects
seeded 5xx bursts, resets, lost answers, slow answers, streams cut before and after their task id,
stalls past the stream-idle deadline and `503 starting` periods, and restarts the server mid-step.
Counted on the server by call id and in the episode records: nothing lost, no tool run twice, no
session left, no step crashed. The full soak (2,000 episodes) is `python benchmarks/bench_chaos.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chaos.py"


def load_bench() -> ModuleType:
    """The benchmark script as a module (`benchmarks/` is not a package)."""
    if "bench_chaos" in sys.modules:
        return sys.modules["bench_chaos"]
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_chaos"] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_the_bench_reads_the_settings_the_fixture_environment_reads() -> None:
    from tests.fixtures import environments

    bench = load_bench()
    assert (bench.CHAOS_LOG_ENV, bench.STEPS_ENV) == (environments.CHAOS_LOG_ENV, environments.STEPS_ENV)
    module, _, name = bench.ENV_CLASS.partition(":")
    assert (module, name) == (environments.__name__, environments.ChaosEnvironment.__name__)


@pytest.mark.timeout(240)  # a hang fails the test (the run itself takes ~20-30 s)
def test_quick_chaos_soak_loses_nothing() -> None:
    bench = load_bench()
    summary = bench.run(bench.parse_args(["--quick"]), log=lambda message: None)
    bench.report(summary)  # the table, for `pytest -s`
    totals, faults = summary["totals"], summary["faults"]
    assert totals["episodes"] == 112
    assert totals["lost"] == 0, summary["paths"]
    assert totals["duplicated_executions"] == 0, summary["examples"]
    assert totals["ok_not_executed"] == 0 and totals["orphan_executions"] == 0, summary["examples"]
    assert totals["sessions_left"] == 0
    assert totals["steps_crashed"] == 0, [p["crash_messages"] for p in summary["paths"].values()]
    assert totals["restarts"] == 1 and summary["paths"]["engine"]["restart"]["happened"]
    assert sum(faults[k] for k in ("gateway_5xx", "reset", "drop_before_id", "drop_after_id")) > 0
    assert summary["ok"], summary["checks"]
