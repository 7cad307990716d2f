"""Self-contained demo: a tiny tool-calling Qwen3 trained with GRPO against a local ORS environment.

This package deliberately imports nothing heavy at import time. The pieces live in private modules:

- :mod:`ors_trl.demo._task`: the demo task (pure Python: tasks, prompt, scoring rule), no ``openreward`` import.
- :mod:`ors_trl.demo._model`: byte-level BPE tokenizer and tiny Qwen3 model built locally (no hub access).
- :mod:`ors_trl.demo._recipe`: supervised warm start, the GRPO configuration that learns, and policy evaluation.
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ors-trl demo` (see :mod:`ors_trl.demo._main`)."""
    from ._main import main as _main

    return _main(argv)
