"""Evaluation during training under two processes: `spec.eval_callback` with fewer held-out episodes than processes.

Launched by tests/test_distributed.py (`accelerate launch --multi_gpu --num_processes 2`, gloo on CPU). Each process
trains one step on the engine path with `eval_callback(tasks=1, every=1)`: one episode to split over two processes, so
one process has none. Generation is scripted (echo the target right). Each process writes
`<out>/report-eval-rank<r>.json` with the callback's history.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

torch.set_num_threads(1)

from ors_trl import OpenRewardSpec  # noqa: E402
from tests.fixtures.generation import cpu_grpo_trainer, replace_generation, tool_call_text, trl_tokenizer  # noqa: E402

_TARGET = re.compile(r'exactly this text: "([^"]+)"')


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    spec = OpenRewardSpec(args.url, env_name="echoenvironment", num_tasks=2, gather_window=1.0)
    callback = spec.eval_callback(tasks=1, split="test", every=1, at_start=False)
    trainer = cpu_grpo_trainer(args.model_dir, os.path.join(args.out, "trainer"), spec=spec, mode="engine", batch=2,
                               completion_length=64, callbacks=[callback], config={"max_steps": 1, "seed": 42})
    tok = trl_tokenizer(trainer)

    def generate(prompt_ids, *rest, **kwargs):
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            targets = _TARGET.findall(text)
            body = "Done." if not targets or "<tool_response>" in text else tool_call_text("echo", {"text": targets[0]})
            out.append(tok.encode(body + "<|im_end|>", add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    trainer.train()
    spec.close()
    with open(os.path.join(args.out, f"report-eval-rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "history": callback.history}, fh)
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
