"""The rollout engine's side of TRL's vLLM contract (server and colocate modes), with a test double for vLLM.

No vLLM on a CPU machine, so `trainer.vllm_generation` is a fake with the real object's interface:
`generate(prompts, images, num_generations, profiler)` returns `(prompt_ids, completion_ids, logprobs,
logprob_token_ids)` with per-token top-k logprob lists (as `VLLMGeneration.generate` does), and in server mode it
gathers every process's prompts and hands each process back its slice by position, exactly like TRL's server
path. Everything between the engine and the fake is TRL's own code (its single-turn generation: weight sync,
top-1 logprob extraction). `examples/vllm_server.py` runs the real thing on GPUs.
"""

from __future__ import annotations

import copy
import re
import threading
from types import SimpleNamespace

import pytest

from ors_trl import OpenRewardSpec
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    generate_and_score,
    stub_trainer,
    tool_call_text,
    trl_tokenizer,
    use_vllm_generation,
    vllm_synced_step,
)

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

_TARGET = re.compile(r'exactly this text: "([^"]+)"')
WRONG_FIRST = ("hello", "delta", "gradient", "factory")  # a-m: echo "nope" first, then the right word
RIGHT_FIRST = ("world", "trl", "spec", "policy")  # the rest: the right word at once
OTHER_LOGPROB = -9.0  # the second entry of every top-k list; TRL must keep only the first


def expected_logprob(token_id: int) -> float:
    """The fake's logprob for a sampled token: a function of the token, so misalignment shows."""
    return -(1 + token_id) / 1000


def script(tok, prompt_ids: list[int]) -> list[int]:
    """The scripted policy, a function of the conversation so far (the server generates for every process)."""
    text = tok.decode(prompt_ids)
    target = _TARGET.findall(text)[0]
    replies = text.split("<tool_response>")[1:]
    if not replies:
        word = "nope" if target in WRONG_FIRST else target
    elif len(replies) == 1 and replies[0].strip().startswith("nope"):
        word = target
    else:
        return tok.encode("Done.<|im_end|>", add_special_tokens=False)
    return tok.encode(tool_call_text("echo", {"text": word}) + "<|im_end|>", add_special_tokens=False)


class ThreadGroup:
    """Stand-in for a process group: `world` threads exchange objects in lock step (a barrier per collective)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)  # a missing collective fails, never hangs
        self.slots: list = [None] * world

    def all_gather(self, rank: int, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class FakeAccelerator:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.process_index = group, rank
        self.num_processes = group.world
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")

    def gather(self, tensor):
        return torch.cat(self.group.all_gather(self.process_index, tensor))


class FakeVLLMGeneration:
    """`trainer.vllm_generation` double. Server mode: gathers all processes' prompts, returns this process's slice."""

    def __init__(self, tok, *, mode: str, group: ThreadGroup | None = None, rank: int = 0,
                 max_model_len: int = 1 << 20) -> None:
        self.tok, self.mode, self.group, self.rank = tok, mode, group, rank
        self.calls: list[dict] = []
        self.syncs = 0
        self.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len)))

    def sync_weights(self) -> None:
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        prompts = [list(p) for p in prompts]
        self.calls.append({"n": len(prompts), "num_generations": num_generations, "prompts": prompts})
        everyone = prompts
        if self.mode == "server" and self.group is not None:  # gather_object(prompts)
            everyone = [p for chunk in self.group.all_gather(self.rank, prompts) for p in chunk]
        unique = everyone[::num_generations]  # the server generates n per distinct prompt
        completions = [script(self.tok, p) for p in unique for _ in range(num_generations)]
        all_prompt_ids = [p for p in unique for _ in range(num_generations)]
        if self.mode == "server" and self.group is not None:  # each process takes its slice by position
            part = slice(self.rank * len(prompts), (self.rank + 1) * len(prompts))
            all_prompt_ids, completions = all_prompt_ids[part], completions[part]
        self.calls[-1]["completions"] = completions
        logprobs = [[[expected_logprob(t), OTHER_LOGPROB] for t in c] for c in completions]
        token_ids = [[[t, 0] for t in c] for c in completions]
        return all_prompt_ids, completions, logprobs, token_ids


def make_trainer(model_dir: str, spec, tmp_path, **config):
    return cpu_grpo_trainer(model_dir, str(tmp_path / "out"), completion_length=128, spec=spec, mode="engine",
                            config=config)


def use_fake_vllm(trainer, mode: str, **kwargs) -> FakeVLLMGeneration:
    """What `GRPOTrainer.__init__` sets up for `use_vllm=True`, with the double in place of `VLLMGeneration`."""
    return use_vllm_generation(trainer, FakeVLLMGeneration(trl_tokenizer(trainer), mode=mode, **kwargs), mode)


def prompts_for(spec, words, generations: int = 2) -> list:
    targets = list(spec.train_dataset["target"])
    rows = [spec.train_dataset[targets.index(w)] for w in words for _ in range(generations)]
    return [copy.deepcopy(r["prompt"]) for r in rows]


def segments(mask: list[int]) -> int:
    """Number of runs of environment tokens (0s) in an env_mask."""
    return sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))


def check_alignment(out: dict, tok) -> None:
    """logprobs line up with completion_ids: the fake's value on model tokens, 0.0 on environment tokens."""
    for ids, lps, mask in zip(out["completion_ids"], out["logprobs"], out["env_mask"], strict=True):
        assert len(ids) == len(lps) == len(mask)
        assert mask[0] == 1
        for t, lp, m in zip(ids, lps, mask, strict=True):
            assert lp == (expected_logprob(t) if m else 0.0)
        env_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert env_text.count("<tool_response>") == segments(mask)


@pytest.fixture
def echo_spec(ref_server):
    # A fixed gather window: every rollout of a turn joins its generation call, so the batches (and with them
    # the padded greedy numerics) are TRL's own, turn by turn; the automatic window would not wait for them.
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", gather_window=1.0)
    yield spec
    spec.close()


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_engine_output_is_aligned_through_vllm(tiny_model_dir, echo_spec, ref_server, tmp_path, mode):
    trainer = make_trainer(tiny_model_dir, echo_spec, tmp_path)
    fake = use_fake_vllm(trainer, mode)
    tok = trl_tokenizer(trainer)
    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    out = echo_spec.rollout_func(prompts_for(echo_spec, ["hello", "trl"]), trainer)

    check_alignment(out, tok)
    assert out["ors_reward"] == [1.0] * 4
    assert [segments(m) for m in out["env_mask"]] == [2, 2, 1, 1]  # "hello": wrong, then right; "trl": right
    assert ref_server.stats()["tool_calls"]["echoenvironment/echo"] - before == 6
    # One completion per prompt per call (the engine passes num_generations=1), all rollouts batched per turn.
    assert [(c["n"], c["num_generations"]) for c in fake.calls] == [(4, 1), (4, 1), (2, 1)]
    # The model tokens are exactly what vLLM returned, turn by turn.
    first = fake.calls[0]["completions"]
    assert [ids[: len(c)] for ids, c in zip(out["completion_ids"], first, strict=True)] == first


def test_weights_sync_once_per_step_not_per_call(tiny_model_dir, echo_spec, tmp_path):
    trainer = make_trainer(tiny_model_dir, echo_spec, tmp_path)
    fake = use_fake_vllm(trainer, "server")
    echo_spec.rollout_func(prompts_for(echo_spec, ["hello", "trl"]), trainer)
    assert len(fake.calls) == 3 and fake.syncs == 1  # three generation calls in step 0, one sync
    echo_spec.rollout_func(prompts_for(echo_spec, ["delta"]), trainer)
    assert fake.syncs == 1  # same step: the weights are current
    trainer.state.global_step = 1
    echo_spec.rollout_func(prompts_for(echo_spec, ["delta"]), trainer)
    assert fake.syncs == 2 and vllm_synced_step(trainer) == 1


def test_trl_consumes_engine_output_in_vllm_mode(tiny_model_dir, echo_spec, tmp_path):
    """A whole generate-and-score step with vLLM on: sampling logprobs and tool mask reach TRL aligned."""
    trainer = make_trainer(tiny_model_dir, echo_spec, tmp_path)
    fake = use_fake_vllm(trainer, "server")
    targets = list(echo_spec.train_dataset["target"])
    rows = [copy.deepcopy(echo_spec.train_dataset[targets.index(w)]) for w in ("hello", "trl") for _ in range(2)]
    out = generate_and_score(trainer, rows)
    assert fake.syncs == 1  # TRL's rollout_func path syncs before calling the engine; the engine adds none
    mask = out["completion_mask"].bool()
    for ids, lps, tm, m in zip(out["completion_ids"], out["sampling_per_token_logps"], out["tool_mask"], mask,
                               strict=True):
        ids, lps, tm = ids[m].tolist(), lps[m].tolist(), tm[m].tolist()
        assert [lp for lp, t in zip(lps, tm, strict=True) if not t] == [0.0] * (len(tm) - sum(tm))
        assert lps == pytest.approx([expected_logprob(t) if k else 0.0 for t, k in zip(ids, tm, strict=True)])
    assert "importance_sampling_ratio" in out


def test_colocate_honours_vllm_max_model_len(tiny_model_dir, echo_spec, ref_server, tmp_path):
    """In colocate mode the engine stops before the vLLM context is exceeded (as TRL's loop does); server mode
    reads the model's own limit instead."""
    trainer = make_trainer(tiny_model_dir, echo_spec, tmp_path)
    probe = use_fake_vllm(trainer, "server")
    prompts = prompts_for(echo_spec, ["trl"])
    echo_spec.rollout_func(copy.deepcopy(prompts), trainer)
    first = probe.calls[0]
    limit = max(len(p) + len(c) for p, c in zip(first["prompts"], first["completions"], strict=True)) + 2

    # Server mode ignores vLLM's max_model_len (the server owns it); the tool result is appended.
    server = use_fake_vllm(trainer, "server", max_model_len=limit)
    out = echo_spec.rollout_func(copy.deepcopy(prompts), trainer)
    assert len(server.calls) == 2 and all(segments(m) == 1 for m in out["env_mask"])

    colocate = use_fake_vllm(trainer, "colocate", max_model_len=limit)
    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    out = echo_spec.rollout_func(copy.deepcopy(prompts), trainer)
    assert len(colocate.calls) == 1  # no generation past the context: the tool result was rolled back
    assert out["completion_ids"] == colocate.calls[0]["completions"]
    assert all(m == [1] * len(m) for m in out["env_mask"])
    assert out["ors_reward"] == [None, None]  # the tool ran and scored, but the model never saw its result
    assert all(ep.turns[-1]["tool_calls"][-1]["unseen"] for ep in echo_spec.rollout_func.last_episodes)
    assert ref_server.stats()["tool_calls"]["echoenvironment/echo"] - before == 2
    check_alignment(out, trl_tokenizer(trainer))


def test_server_mode_two_processes_pass_the_same_number_of_prompts(tiny_model_dir, ref_server, tmp_path):
    """Two processes (threads with a barrier-backed gather) share one fake vLLM server. Rank 0's rollouts take
    two tool turns, rank 1's one, so rank 1 must join the last generation call with dummy prompts; otherwise the
    server's gather and per-position slicing would break (here: a broken barrier, or wrong completions)."""
    group = ThreadGroup(2)
    words = {0: WRONG_FIRST[:2], 1: RIGHT_FIRST[:2]}
    specs = {r: OpenRewardSpec(ref_server.url, env_name="echoenvironment", gather_window=1.0) for r in (0, 1)}
    trainers, fakes, outs, errors = {}, {}, {}, {}
    try:
        for rank in (0, 1):
            trainers[rank] = make_trainer(tiny_model_dir, specs[rank], tmp_path / str(rank))
            trainers[rank].accelerator = FakeAccelerator(group, rank)
            fakes[rank] = use_fake_vllm(trainers[rank], "server", group=group, rank=rank)

        def run(rank: int) -> None:
            try:
                outs[rank] = specs[rank].rollout_func(prompts_for(specs[rank], words[rank]), trainers[rank])
            except BaseException as exc:
                errors[rank] = exc
                group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a process is stuck in a collective"
        assert not errors, errors
    finally:
        for spec in specs.values():
            spec.close()

    counts = {r: [c["n"] for c in fakes[r].calls] for r in (0, 1)}
    assert counts[0] == counts[1] == [4, 4, 4], counts
    # rank 1's last call carried only padding: first-turn prompts, whose completions the engine dropped
    assert all(tok_count == 0 for tok_count in
               [trl_tokenizer(trainers[1]).decode(p).count("<tool_response>") for p in fakes[1].calls[2]["prompts"]])
    for rank in (0, 1):
        check_alignment(outs[rank], trl_tokenizer(trainers[rank]))
        assert outs[rank]["ors_reward"] == [1.0] * 4
    assert [segments(m) for m in outs[0]["env_mask"]] == [2] * 4
    assert [segments(m) for m in outs[1]["env_mask"]] == [1] * 4


class _ScriptedAccelerator:
    """Two processes as seen from process 0: `gather` appends what the other process contributes."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other: int) -> None:
        self.other = other

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor([self.other])])


@pytest.mark.parametrize(("local", "other", "called_with"), [
    (1, 3, 3),  # fewer prompts here: padded up to the other's count
    (0, 2, 2),  # nothing here: joins with dummy prompts
    (3, 1, 3),  # more here: no padding
    (0, 0, None),  # nobody has work: no call at all
])
def test_generate_pads_to_the_largest_process(local, other, called_with):
    from ors_trl.trl.backend import Backend

    calls = []

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append([list(p) for p in prompt_ids])
        return [[7, i] for i in range(len(prompt_ids))], [[-0.5, -0.25] for _ in prompt_ids]

    trainer = stub_trainer(generate_single_turn, accelerator=_ScriptedAccelerator(other))
    backend = Backend.of(trainer)
    prompts = [[1, 2 + i] for i in range(local)]
    out = backend.generate([(p, []) for p in prompts], fallback=([9], []))
    assert out == [([7, i], [-0.5, -0.25]) for i in range(local)]  # only this process's own
    if called_with is None:
        assert calls == []
    else:
        assert len(calls) == 1 and len(calls[0]) == called_with
        assert calls[0][:local] == prompts
        assert calls[0][local:] == [prompts[0] if prompts else [9]] * (called_with - local)
    assert bool(backend.most(local)) is bool(local or other)
