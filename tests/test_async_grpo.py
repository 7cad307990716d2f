"""TRL's asynchronous trainer (`AsyncGRPOTrainer`, wherever TRL keeps it) with ors-trl's factory and reward functions,
on CPU.

`AsyncGRPOTrainer` runs rollouts in a spawned worker process (`AsyncRolloutWorker`) that receives
`environment_factory` and `reward_funcs` by pickle, generates through a vLLM server and trains on what
comes back. Here everything that touches the environment is TRL's own code and ours, for real: the
spawned worker unpickles the factory and the reward function, opens sessions on the reference server,
calls tools and scores. Three things are replaced, because they need a GPU: the vLLM server (a
`VLLMDouble` on loopback, scripted tokens with logprobs scored by the same tiny model), the NCCL
weight transfer (a no-op `WeightTransferProtocol`), and the flash-attention-3 kernel TRL's tree-packed
training forward calls (a reference implementation in torch, below).
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import types
from collections.abc import Iterator
from typing import Any

import pytest

from ors_trl import OpenRewardMix, OpenRewardSpec

#: Bounds every wait on a spawned process (its imports are the slow part on a 2-core machine).
CHILD_TIMEOUT_S = 60.0


# -- stand-ins for the GPU parts -------------------------------------------------------------------


class NoWeightTransfer:
    """TRL's `WeightTransferProtocol`, doing nothing: the scripted server has no weights to update.

    Counts the calls, so the test can see TRL's weight-sync schedule ran.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {"init_weight_transfer": 0, "pause": 0, "send_weights": 0, "resume": 0,
                                      "destroy": 0}
        self.tensors = 0

    def init_weight_transfer(self) -> None:
        self.calls["init_weight_transfer"] += 1

    def pause(self) -> None:
        self.calls["pause"] += 1

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        self.calls["send_weights"] += 1
        self.tensors += sum(1 for _ in iterator)  # drain it, as a real transfer would

    def resume(self) -> None:
        self.calls["resume"] += 1

    def destroy(self) -> None:
        self.calls["destroy"] += 1


class TorchVarlenAttention:
    """`flash_attn_varlen_func` in plain torch, for TRL's tree attention (`packing.tree_attention`) on CPU.

    TRL loads flash-attention 3 from the Hugging Face kernel hub (`kernels`), which needs a GPU and the
    network. Same contract: per segment, queries `q[cu_q[s]:cu_q[s+1]]` attend keys `k[cu_k[s]:cu_k[s+1]]`,
    causal with the diagonal aligned bottom-right, an optional left window, grouped-query heads.
    """

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               softmax_scale=None, causal=True, window_size=(-1, -1), **kwargs):
        import torch
        import torch.nn.functional as F

        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for s in range(len(cu_seqlens_q) - 1):
            q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[s], cu_seqlens_q[s + 1], cu_seqlens_k[s], cu_seqlens_k[s + 1]))
            lq, lk = q1 - q0, k1 - k0
            row = torch.arange(lq).unsqueeze(1) + (lk - lq)  # each query's position among the keys
            col = torch.arange(lk).unsqueeze(0)
            mask = col <= row if causal else torch.ones(lq, lk, dtype=torch.bool)
            if window_size[0] >= 0:
                mask &= col >= row - window_size[0]
            qs = q[q0:q1].transpose(0, 1)
            ks = k[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
            vs = v[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
            out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
        return out


# -- 1. AsyncGRPOTrainer end to end ----------------------------------------------------------------


def _worker_pid(record: dict[str, Any]) -> int:
    """The pid of the process that wrote an episode record (its run id is host-pid-time)."""
    return int(record["run"].rsplit("-", 2)[1])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", ["uniform", "adaptive"])
def test_async_grpo_trainer_trains_against_the_reference_server(tiny_model_dir, make_server, tmp_path, monkeypatch,
                                                                sampling):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from ors_trl.core.records import read_records
    from ors_trl.trl.backend import async_grpo
    from tests.fixtures.generation import bounded_worker_stop, use_flash_attention
    from tests.fixtures.vllm_server import VLLMDouble

    found = async_grpo()  # trl.AsyncGRPOTrainer, or the experimental path before TRL 1.18
    if found is None:
        pytest.skip("the installed TRL has no AsyncGRPOTrainer")
    AsyncGRPOConfig, AsyncGRPOTrainer = found.config, found.trainer
    async_grpo_trainer, async_rollout_worker = found.trainer_module, found.worker_module

    # vLLM itself is never imported (the worker talks HTTP to the double), but TRL checks it is installed.
    monkeypatch.setattr(async_rollout_worker, "is_vllm_available", lambda: True)
    use_flash_attention(monkeypatch, TorchVarlenAttention)
    # TRL's MFU probe asks CUDA for the device name unconditionally; None is its own "peak FLOPs unknown".
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *args, **kwargs: None)

    server = make_server("echo")
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(server.url, env_name="echoenvironment", episode_log=str(log), task_sampling=sampling)
    dataset, factory = spec.train_dataset, spec.environment_factory  # tool discovery happens here, in this process
    before = server.stats()
    transfer = NoWeightTransfer()
    trainer: Any = None
    worker_processes: list[Any] = []
    with VLLMDouble(tiny_model_dir) as vllm:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "async"),
            use_cpu=True,
            bf16=False,
            activation_checkpointing=False,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=48,
            max_tool_calling_iterations=2,
            max_steps=3,
            max_inflight_tasks=4,  # also the most sessions the worker holds at once
            token_budget=0,  # fixed-count micro-batches of per_device_train_batch_size samples
            vllm_server_base_url=vllm.url,
            vllm_server_timeout=10,
            request_timeout=30,
            heartbeat_stale_after_s=60,
            learning_rate=1e-3,
            report_to="none",
            save_strategy="steps" if sampling == "adaptive" else "no",
            save_steps=3,
            disable_tqdm=True,
        )
        try:
            trainer = AsyncGRPOTrainer(
                model=tiny_model_dir,
                args=args,
                processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                train_dataset=dataset,
                environment_factory=factory,
                reward_funcs=spec.reward_funcs,
                weight_transfer=transfer,
                callbacks=spec.callbacks,  # task sampling's state and metrics come from the worker through them
            )
            bounded_worker_stop(trainer.rollout_worker, worker_processes)
            trainer.train()
        finally:
            if trainer is not None and trainer.rollout_worker is not None:
                trainer.rollout_worker.stop()  # idempotent; the trainer already stopped it unless it failed
        served = vllm.stats()

    # the trainer completed its steps, on rewards that came from the environment through the worker
    assert trainer.state.global_step == 3
    steps = [h for h in trainer.state.log_history if "rewards/outcome_reward" in h]
    assert len(steps) == 3
    rewards = [h["rewards/outcome_reward"] for h in steps]
    assert all(r is not None and 0.0 <= r <= 1.0 for r in rewards), rewards
    assert all(h["reward"] == h["rewards/outcome_reward"] for h in steps)  # counted once, not again by get_reward
    assert any(h["grad_norm"] > 0 for h in steps)  # each group had a 1.0 and a 0.0: a real policy gradient
    assert sum(h.get("tools/echo/call_total", 0) for h in trainer.state.log_history) > 0
    assert all(h.get("tools/failure_frequency", 0) == 0 for h in steps)
    assert transfer.calls["init_weight_transfer"] == 1 and transfer.calls["send_weights"] == 1 + 3  # cold + per step
    assert transfer.calls["destroy"] == 1
    assert served["requests"]["/v1/completions"] > 0 and served["errors"] == []

    # the worker process exited cleanly (TRL stopped it), and left nothing open on the server
    (process,) = worker_processes
    assert not process.is_alive() and process.exitcode == 0
    server.wait_for_stats(lambda st: st["open_sessions"] == 0, timeout=15)
    after = server.stats()
    calls = after["tool_calls"].get("echoenvironment/echo", 0) - before["tool_calls"].get("echoenvironment/echo", 0)
    setups = after["setups"] - before["setups"]
    assert calls > 0 and setups > 0
    assert after["teardowns"] - before["teardowns"] == setups

    # every session was opened, used, scored and closed by the worker: one record per session, all from its pid
    records = list(read_records(log))
    assert len(records) == setups
    assert {_worker_pid(r) for r in records} == {process.pid}
    assert {r["source"] for r in records} == {"trl"}  # no trainer in the worker, yet training's episodes
    assert sum(r["tool_calls"] for r in records) == calls
    scored = [r["reward"] for r in records if r["reward"] is not None]
    assert scored and set(scored) <= {0.0, 1.0} and 0.0 in scored and 1.0 in scored
    if sampling == "adaptive":
        # the worker drew the tasks (unseen first: no task twice before every one was drawn) and learnt from their
        # rewards; what it learnt reached this process's logs and checkpoint
        logged = [h for h in trainer.state.log_history if h.get("curriculum/echoenvironment/groups")]
        assert logged and sum(h["curriculum/echoenvironment/groups"] for h in logged) > 0
        saved = json.loads((tmp_path / "async" / "checkpoint-3" / "trainer_state.json").read_text())
        sampler = saved["stateful_callbacks"]["ors_trl.task_sampling"]["curricula"][""]["sampler"]
        drawn = {int(t): n for t, n in sampler["drawn"].items()}
        assert max(drawn.values()) == 1 or len(drawn) == 16  # unseen first: none twice before all were drawn
        assert sampler["history"] and {int(t) for t in sampler["history"]} <= set(drawn)
        assert {int(t) for t in sampler["history"]} <= {r["task_index"] for r in records if r["reward"] is not None}
    spec.close()


def _run_worker_loop(found: Any, spec: OpenRewardSpec, tokenizer: Any, vllm_url: str, log: Any, rollouts: int,
                     max_tokens: int) -> tuple[list[dict[str, Any]], BaseException | None]:
    """TRL's rollout loop (`_AsyncRolloutLoop`, what the spawned worker runs) in this process, on a thread, until
    `rollouts` episode records are written (bounded); the records and what the loop raised, if anything."""
    import threading
    import time

    from accelerate import PartialState

    from ors_trl.core.records import read_records

    PartialState()  # as TRL's worker child starts (its loop logs through accelerate)
    ctx = multiprocessing.get_context("spawn")
    queues = [ctx.Queue(), ctx.Queue(maxsize=1), ctx.Queue()]
    factory, reward = pickle.loads(pickle.dumps((spec.environment_factory, spec.reward_funcs)))  # as TRL hands them
    loop = found.worker_module._AsyncRolloutLoop(
        model_name="tiny", dataset=spec.train_dataset, reward_funcs=[reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")], rollout_buffer=queues[0],
        model_version_value=ctx.Value("i", 0), heartbeat_value=ctx.Value("d", 0.0), failed_event=ctx.Event(),
        exception_info_queue=queues[1], metrics_queue=queues[2], environment_factory=factory,
        num_generations=2, max_inflight_tasks=2, vllm_server_url=vllm_url, max_tokens=max_tokens,
        max_tool_calling_iterations=40, request_timeout=30)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:  # what kills TRL's worker
            raised.append(exc)

    thread = threading.Thread(target=run, name="rollout-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline and thread.is_alive() and len(list(read_records(log))) < rollouts:
        time.sleep(0.1)
    if thread.is_alive():
        loop._loop.call_soon_threadsafe(loop._stop_event.set)
        thread.join(CHILD_TIMEOUT_S)
    for queue in queues:
        queue.cancel_join_thread()
    return list(read_records(log))[:rollouts], raised[0] if raised else None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_async_worker_ends_a_rollout_at_the_models_context(tiny_model_dir, make_server, tmp_path, monkeypatch):
    """TRL's async worker re-renders the whole conversation each turn and asks vLLM for `max_tokens` more; past the
    context vLLM answers 400 and the worker dies. ors-trl bounds it: every request fits, the rollout ends
    `context_length`, and results no reply saw set no reward."""
    import re

    from transformers import AutoTokenizer

    from ors_trl.trl.backend import async_grpo
    from tests.fixtures.generation import tool_call_text
    from tests.fixtures.vllm_server import VLLMDouble

    found = async_grpo()
    if found is None:
        pytest.skip("the installed TRL has no AsyncGRPOTrainer")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "grpo-rollout-worker-child")  # TRL's worker's name
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts: list[int] = []

    def open_the_door(prompt_ids: list[int], seed: int) -> list[int]:  # always opens the last door it was shown
        prompts.append(len(prompt_ids))
        text = tokenizer.decode(prompt_ids)
        reply = "Out." if text.rfind("out of the corridor") > text.rfind("says:") else \
            tool_call_text("open_door", {"word": re.findall(r"says: (\w+)\.", text)[-1]})
        return tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)

    server = make_server("corridor")
    max_tokens = 48
    runs: dict[str, Any] = {}
    sizes: list[int] = []
    for name in ("roomy", "prompt", "reply"):
        sizes = sizes if name != "prompt" else sorted(set(prompts))  # the roomy run's prompt at each turn
        if name != "roomy" and len(sizes) < 12:
            pytest.fail(f"the roomy run did not walk the corridor: {runs}")
        # "prompt": the 5th turn's prompt fills the context; "reply": it leaves room for half a reply
        limit = 1 << 16 if name == "roomy" else sizes[4] + (max_tokens // 2 if name == "reply" else 0)
        prompts.clear()
        log = tmp_path / f"{name}.jsonl"
        spec = OpenRewardSpec(server.url, env_name="shortcorridorenvironment", num_tasks=1, episode_log=str(log))
        with VLLMDouble(tiny_model_dir, open_the_door, model_name="tiny", max_model_len=limit,
                        score_logprobs=False) as vllm:
            records, raised = _run_worker_loop(found, spec, tokenizer, vllm.url, log, 2, max_tokens)
            runs[name] = (records, raised, vllm.stats(), limit)
        spec.close()
        assert raised is None, (name, raised)  # the worker lives on
        assert vllm.stats()["errors"] == [] and vllm.stats()["longest"] <= limit  # no request past the context
        assert len(records) == 2

    roomy = runs["roomy"][0]
    assert [r["end_reason"] for r in roomy] == ["finished", "finished"]  # room for all twelve rooms
    assert all(r["reward"] == 1.0 for r in roomy)
    for name in ("prompt", "reply"):
        for record in runs[name][0]:
            assert record["end_reason"] == "context_length" and "context" in record["stop_detail"]
            calls = [c for t in record["turns"] for c in t["tool_calls"]]
            assert [c["status"] for c in calls] == ["ok"] * 4  # four doors before the context was full
            if name == "prompt":  # the 4th door's result fills the context: no reply saw it, its reward does not count
                assert [bool(c.get("unseen")) for c in calls] == [False] * 3 + [True]
                assert record["reward"] == pytest.approx(calls[2]["reward"]) and calls[3]["reward"] == 0.1
            else:  # the 5th reply was cut by the context: no call ran, every result was seen
                assert not any(c.get("unseen") for c in calls) and record["turns"][-1]["tool_calls"] == []
                assert record["reward"] == pytest.approx(calls[3]["reward"])
    server.wait_for_stats(lambda st: st["open_sessions"] == 0, timeout=15)


# -- 1b. AsyncGRPOTrainer through an agent harness ------------------------------------------------


async def echo_agent(ep: Any) -> str | None:
    """A harness agent (module level: it travels to TRL's rollout process by pickle): the OpenAI client for the model,
    the episode's tools over MCP (plain aiohttp), until the model answers without a call."""
    import aiohttp
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    messages, reply = list(ep.messages), None
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ep.mcp_token}"}) as http:
        for _ in range(4):
            answer = await client.chat.completions.create(model="policy", messages=messages, tools=ep.tools)
            reply = answer.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                body = {"jsonrpc": "2.0", "id": call.id, "method": "tools/call",
                        "params": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                async with http.post(ep.mcp_url, json=body) as response:
                    result = (await response.json())["result"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result["content"][0]["text"]})
    await client.close()
    return None if reply is None else reply.content


class _Recorded:
    """The trainer's end of the rollout queue, keeping every sample it hands to training."""

    def __init__(self, queue: Any) -> None:
        self.queue, self.samples = queue, []

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self.queue.get(*args, **kwargs)
        self.samples.append(sample)
        return sample

    def qsize(self) -> int:
        return self.queue.qsize()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_async_grpo_trains_through_a_harness(tiny_model_dir, make_server, tmp_path, monkeypatch):
    """`Harness.rollout_worker(spec)`: TRL's spawned rollout process plays each row's episode with the harness, its
    model calls generated by vLLM (the double); the trainer trains on exactly the generated ids, rewarded by the
    environment, and every session closes."""
    pytest.importorskip("openai")
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from ors_trl.core.records import read_records
    from ors_trl.harness import Harness
    from ors_trl.trl.backend import async_grpo
    from ors_trl.trl.engine import task_of
    from tests.fixtures.generation import bounded_worker_stop, use_flash_attention
    from tests.fixtures.vllm_server import VLLMDouble

    found = async_grpo()
    if found is None:
        pytest.skip("the installed TRL has no AsyncGRPOTrainer")
    monkeypatch.setattr(found.worker_module, "is_vllm_available", lambda: True)
    use_flash_attention(monkeypatch, TorchVarlenAttention)
    monkeypatch.setattr(found.trainer_module, "get_peak_flops_per_device", lambda *args, **kwargs: None)

    server = make_server("echo")
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(server.url, env_name="echoenvironment", episode_log=str(log))
    worker = Harness(echo_agent).rollout_worker(spec)
    before, transfer, processes = server.stats(), NoWeightTransfer(), []
    generated: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, ids, logprobs) the double served
    trainer: Any = None
    with VLLMDouble(tiny_model_dir) as vllm:
        score = vllm._score

        def scored(prompt: list[int], ids: list[int]) -> list[float]:
            logprobs = score(prompt, ids)
            generated.append((list(prompt), list(ids), list(logprobs)))
            return logprobs

        vllm._score = scored
        args = found.config(
            output_dir=str(tmp_path / "async"), use_cpu=True, bf16=False, activation_checkpointing=False,
            per_device_train_batch_size=4, num_generations=2, max_completion_length=48, max_steps=2,
            max_inflight_tasks=4, token_budget=0, vllm_server_base_url=vllm.url, vllm_server_timeout=10,
            request_timeout=30, heartbeat_stale_after_s=60, learning_rate=1e-3, report_to="none",
            save_strategy="no", disable_tqdm=True)
        try:
            trainer = found.trainer(model=tiny_model_dir, args=args,
                                    processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                                    train_dataset=spec.train_dataset, rollout_worker=worker, weight_transfer=transfer)
            assert trainer.rollout_worker is worker
            recorded = trainer.rollout_queue = _Recorded(trainer.rollout_queue)
            bounded_worker_stop(worker, processes)
            trainer.train()
        finally:
            if trainer is not None and trainer.rollout_worker is not None:
                trainer.rollout_worker.stop()
        served = vllm.stats()

    # two real steps, on the environment's rewards (a group of a task gets the target word and a wrong one)
    assert trainer.state.global_step == 2 and served["errors"] == []
    steps = [h for h in trainer.state.log_history if "rewards/outcome_reward" in h]
    assert len(steps) == 2 and all(0.0 <= h["rewards/outcome_reward"] <= 1.0 for h in steps)
    assert any(h["grad_norm"] > 0 for h in steps)
    assert any(h.get("env/echoenvironment/episodes") for h in trainer.state.log_history)
    # every row trains exactly the ids the double generated, with its logprobs, and nothing else
    assert recorded.samples and generated
    for sample in recorded.samples:
        ids, mask = sample.input_ids.tolist(), sample.completion_mask.tolist()
        turns = sorted((g for g in generated if ids[: len(g[0]) + len(g[1])] == g[0] + g[1]), key=lambda g: len(g[0]))
        assert turns and [t for t, m in zip(ids, mask, strict=True) if m] == [t for g in turns for t in g[1]]
        trained = [lp for lp, m in zip(sample.old_log_probs.tolist(), mask, strict=True) if m]
        assert trained == pytest.approx([lp for g in turns for lp in g[2]], abs=1e-5)
        assert len(turns) == 2 and "<tool_response>" in vllm.tokenizer.decode(turns[1][0][len(turns[0][0]):])

    # the process exited cleanly; one record per session, from it, with the harness's calls; every session closed
    (process,) = processes
    assert not process.is_alive() and process.exitcode == 0
    server.wait_for_stats(lambda st: st["open_sessions"] == 0, timeout=15)
    after = server.stats()
    setups = after["setups"] - before["setups"]
    assert setups > 0 and after["teardowns"] - before["teardowns"] == setups
    records = list(read_records(log))
    assert len(records) == setups and {_worker_pid(r) for r in records} == {process.pid}
    scored = [r for r in records if r["reward"] is not None]  # (a rollout in flight when training ended: not)
    assert {r["source"] for r in records} == {"trl"} and all(r["harness"]["model_calls"] == 2 for r in scored)
    assert {r["reward"] for r in scored} == {0.0, 1.0} and all(r["tokens"]["exact"] for r in scored)
    rewards = {(r["task_index"], r["reward"]) for r in scored}
    assert all((task_of(s.prompt).index, s.metrics["reward"]) in rewards for s in recorded.samples)
    spec.close()


def test_a_harness_that_cannot_travel_to_the_rollout_process_is_refused(ref_server) -> None:
    """TRL takes the worker's arguments to its spawned process by pickle: a closure is refused up front, saying how."""
    from ors_trl.harness import Harness
    from ors_trl.protocol.errors import ConfigurationError

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    with pytest.raises(ConfigurationError, match="module-level functions"):
        Harness(echo_agent, score=lambda episode, calls: 1.0).rollout_worker(spec)
    spec.close()


def test_harness_workers_of_one_process_share_the_classes_pickle_finds(monkeypatch) -> None:
    """The worker's classes are built over TRL's once per process: a second worker (another trainer, a second run)
    must not replace them, or the first one's class is no longer the one pickle finds and cannot travel."""
    from ors_trl.trl import backend

    found = backend.async_grpo()
    if found is None:
        pytest.skip("the installed TRL has no AsyncGRPOTrainer")
    monkeypatch.setattr(found.worker_module, "is_vllm_available", lambda: True)  # never imported: not started
    first, second = backend.harness_worker(echo_agent), backend.harness_worker(echo_agent)
    assert type(first) is type(second)
    for cls in (type(first), backend._HarnessLoop):
        assert pickle.loads(pickle.dumps(cls)) is cls


# -- 2. the pickled factory and reward functions in a spawned process -----------------------------


def _run_episodes(jobs: list[dict[str, Any]], conn: Any) -> None:
    """In a spawned process: what TRL's rollout worker does with the factories and reward functions it unpickled.

    Each job: a `factory` (or a `{name: factory}` dict and the row's `environment`), the `reward_funcs`, dataset
    `rows` and per row one tool call. Resets one adapter per row, makes its call, then scores all rows at once with
    `environments=` and `completions=` as TRL passes them. Sends back what it saw.
    """
    import os

    out: list[dict[str, Any]] = []
    try:
        for job in jobs:
            envs, completions, seen = [], [], []
            for row, (tool, arguments) in zip(job["rows"], job["calls"], strict=True):
                factory = job["factory"]
                if isinstance(factory, dict):  # TRL routes by the row's `environment` and does not pass it on
                    factory = factory[row["environment"]]
                    row = {k: v for k, v in row.items() if k != "environment"}
                env = factory()
                prompt = env.reset(**row)
                try:
                    text = getattr(env, tool)(**arguments)
                except Exception as exc:  # as TRL does: the model sees the error
                    text = str({"error": str(exc)})
                envs.append(env)
                completions.append([
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": tool, "arguments": arguments}}]},
                    {"role": "tool", "name": tool, "content": text},
                    {"role": "assistant", "content": "Done."},
                ])
                seen.append({"class": type(env).__name__, "prompt": prompt, "output": text})
            rewards = job["reward_funcs"](environments=envs, completions=completions)
            out.append({"pid": os.getpid(), "episodes": seen, "rewards": rewards,
                        "adapter_rewards": [env.reward for env in envs]})
        conn.send(out)
    except BaseException as exc:
        conn.send(repr(exc))
        raise
    finally:
        conn.close()


def test_pickled_factories_and_reward_funcs_run_in_a_spawned_process(make_server, tmp_path) -> None:
    import os

    from ors_trl.core.records import read_records

    server = make_server("echo,sparse")
    spec = OpenRewardSpec(server.url, env_name="echoenvironment")
    log = tmp_path / "mix.jsonl"
    mix = OpenRewardMix({"echo": OpenRewardSpec(server.url, env_name="echoenvironment"),
                         "sparse": OpenRewardSpec(server.url, env_name="sparseenvironment")}, episode_log=str(log))
    echo_rows, mix_rows = spec.train_dataset, mix.train_dataset
    echo_row = echo_rows[0]
    mix_echo = next(r for r in mix_rows if r["environment"] == "echo")
    mix_sparse = next(r for r in mix_rows if r["environment"] == "sparse")
    jobs = [
        {"factory": spec.environment_factory, "reward_funcs": spec.reward_funcs, "rows": [echo_row, echo_row],
         "calls": [("echo", {"text": echo_row["target"]}), ("echo", {"text": "nope"})]},
        {"factory": mix.environment_factory, "reward_funcs": mix.reward_funcs, "rows": [mix_echo, mix_sparse],
         "calls": [("echo", {"text": mix_echo["target"]}), ("submit", {"answer": mix_sparse["a"] + mix_sparse["b"] + 1})]},
    ]
    pickle.dumps(jobs)  # what TRL's worker checks before it spawns
    before = server.stats()  # after tool discovery, which ran here

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run_episodes, args=(jobs, send), name="ors-trl-spawn-test", daemon=True)
    child.start()
    send.close()
    try:
        assert receive.poll(CHILD_TIMEOUT_S), "the spawned process sent nothing in time"
        result = receive.recv()
        child.join(CHILD_TIMEOUT_S)
        assert not child.is_alive(), "the spawned process did not exit"
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
        receive.close()
    assert not isinstance(result, str), result
    assert child.exitcode == 0

    solo, mixed = result
    assert solo["pid"] == mixed["pid"] != os.getpid()
    assert [e["class"] for e in solo["episodes"]] == [spec.environment_factory.__name__] * 2
    assert all(echo_row["target"] in e["prompt"] for e in solo["episodes"])
    assert [e["output"] for e in solo["episodes"]] == [echo_row["target"], "nope"]
    assert solo["rewards"] == solo["adapter_rewards"] == [1.0, 0.0]
    assert [e["class"] for e in mixed["episodes"]] == [mix.environment_factory[n].__name__ for n in ("echo", "sparse")]
    assert f'{mix_sparse["a"]} + {mix_sparse["b"]}' in mixed["episodes"][1]["prompt"]
    assert mixed["episodes"][1]["output"].strip() == "Incorrect."
    assert mixed["rewards"] == mixed["adapter_rewards"] == [1.0, 0.0]

    # the child used the tools discovered here: it set up exactly one session per episode (no probes), and closed
    # every one of them when it exited
    server.wait_for_stats(lambda st: st["open_sessions"] == 0, timeout=15)
    after = server.stats()
    assert after["setups"] - before["setups"] == 4
    assert after["teardowns"] - before["teardowns"] == 4
    grew = {k: after["tool_calls"].get(k, 0) - before["tool_calls"].get(k, 0) for k in after["tool_calls"]}
    assert grew == {"echoenvironment/echo": 3, "sparseenvironment/submit": 1}
    # the mix's episodes were recorded by the child, under the mix's names, in the mix's log, when it exited
    records = list(read_records(log))
    assert sorted((r["environment"], r["reward"]) for r in records) == [("echo", 1.0), ("sparse", 0.0)]
    assert {_worker_pid(r) for r in records} == {mixed["pid"]}
    spec.close()
    mix.close()


# -- 3. the get_reward hook, in process ------------------------------------------------------------


def test_get_reward_hook_hands_the_episode_to_the_reward_function_or_scores_itself(ref_server, monkeypatch) -> None:
    """Replays TRL's async worker in this process: `_generate_loop` awaits `environment.get_reward()` as each rollout
    ends, and later calls the reward functions with `completions=` only (no adapters)."""
    import asyncio
    import inspect

    from ors_trl.trl import backend as _trl
    from ors_trl.trl.adapter import _HANDOVER, for_this_process

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2)
    row = spec.train_dataset[0]
    plain = spec.environment_factory
    assert for_this_process(plain) is plain and "get_reward" not in dir(plain)  # GRPOTrainer sees no get_reward
    monkeypatch.setattr(_trl, "in_async_worker", lambda: True)
    worker_class = for_this_process(plain)
    assert worker_class is not plain and issubclass(worker_class, plain) and worker_class.__name__ == plain.__name__
    assert inspect.iscoroutinefunction(worker_class.get_reward) and for_this_process(plain) is worker_class

    def trl_tools(cls: type) -> list[str]:  # what TRL's worker exposes as tools
        return sorted(n for n, _ in inspect.getmembers(cls, inspect.isfunction)
                      if n not in ("reset", "get_reward") and not n.startswith("_"))

    assert trl_tools(worker_class) == trl_tools(plain) == ["echo"]

    class Worker:  # what `finished_rollout` reads off TRL's loop
        def __init__(self, reward_funcs: list[Any]) -> None:
            self.reward_funcs, self.eos_token_ids, self.tokenizer = reward_funcs, [7], None

    async def _generate_loop(self: Worker, environment: Any, completion: list, completion_ids: list) -> Any:
        return await environment.get_reward()  # as TRL's loop does, for an async get_reward

    def rollout(word: str) -> tuple[Any, list[dict[str, Any]]]:
        env = worker_class()
        env.reset(**row)
        env.echo(text=word)
        return env, [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "echo", "arguments": {"text": word}}}]},
            {"role": "tool", "name": "echo", "content": word}, {"role": "assistant", "content": "Done."}]

    # with ors-trl's reward function in the worker: get_reward leaves the reward to it (None), the session is freed
    right, wrong = rollout(row["target"]), rollout("nope")
    loop_self = Worker([spec.reward_funcs])
    assert [asyncio.run(_generate_loop(loop_self, env, messages, [1, 7])) for env, messages in (right, wrong)] == \
        [None, None]
    assert right[0].episode.end_reason == "finished" and wrong[0].episode.end_reason == "no_tool_calls"
    other = [{"role": "assistant", "content": "Done."}]  # a rollout get_reward never saw
    assert spec.reward_funcs(completions=[right[1], wrong[1], other], task_index=[0, 0, 0]) == [1.0, 0.0, None]
    # read once by the one reading reward function, then forgotten
    assert not [ep for _, ep, _ in _HANDOVER.values() if ep.env is spec.runtime]

    # without one (the environment owns the reward in TRL's terms), or when TRL's loop cannot be read: get_reward
    # returns the reward itself
    env, messages = rollout(row["target"])
    assert asyncio.run(_generate_loop(Worker([]), env, messages, [1, 7])) == 1.0
    env, _ = rollout("nope")
    assert asyncio.run(env.get_reward()) == 0.0
    spec.close()
    ref_server.wait_for_stats(lambda st: st["open_sessions"] == 0, timeout=10)


# -- 4. where TRL keeps the trainer ------------------------------------------------------------------


class _Tripwire(types.ModuleType):
    """`trl.experimental.async_grpo` as a TRL >= 1.18 has it (deprecated, warns): any use of it fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the experimental path was used ({self.__name__}.{name})")


def test_the_stable_async_trainer_is_found_before_the_experimental_one(monkeypatch) -> None:
    """TRL 1.18 exports `AsyncGRPOTrainer` from `trl` itself and keeps `trl.experimental.async_grpo` only as a warning
    alias: simulated here (a trainer module and a worker module at new places, the trainer on `trl`, the experimental
    package a tripwire), ors-trl finds the stable one, its config and its worker's module, and never touches the
    experimental path. On the installed TRL (1.16) it finds the experimental one."""
    pytest.importorskip("trl")
    import sys

    import trl

    from ors_trl.trl.backend import async_grpo

    installed = async_grpo()
    assert installed is not None and installed.trainer.__name__ == "AsyncGRPOTrainer"
    assert installed.worker_module.AsyncRolloutWorker.__name__ == "AsyncRolloutWorker"
    assert installed.config.__name__ == "AsyncGRPOConfig"

    worker = types.ModuleType("trl.trainer.async_rollout_worker")
    stable = types.ModuleType("trl.trainer.async_grpo_trainer")
    for module, names in ((worker, ["AsyncRolloutWorker"]), (stable, ["AsyncGRPOTrainer", "AsyncGRPOConfig"])):
        for name in names:
            setattr(module, name, type(name, (), {"__module__": module.__name__}))
        monkeypatch.setitem(sys.modules, module.__name__, module)
    stable.AsyncRolloutWorker = worker.AsyncRolloutWorker  # as the trainer module imports it
    monkeypatch.setattr(trl, "AsyncGRPOTrainer", stable.AsyncGRPOTrainer, raising=False)
    monkeypatch.setitem(sys.modules, "trl.experimental.async_grpo", _Tripwire("trl.experimental.async_grpo"))
    found = async_grpo()
    assert found is not None and found.trainer is stable.AsyncGRPOTrainer and found.config is stable.AsyncGRPOConfig
    assert found.trainer_module is stable and found.worker_module is worker
