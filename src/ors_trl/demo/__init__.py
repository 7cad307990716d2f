"""`ors-trl demo` (docs/demo.md): a tiny tool-calling Qwen3 trained with GRPO against a local ORS environment.

Nothing heavy is imported here. `_task`: the tasks, pure Python; `_environments`: them as ORS environments;
`_model`: the local tokenizer and tiny model; `_recipe`: warm start, GRPO configuration, evaluation; `_main`: the CLI.

How the look recipe was tuned (held-out success after 100 GRPO steps, greedy, seeds 0/1/2; 2 shared CPU cores):
the echo recipe (lr 3e-4, 8 tasks x 8 rollouts, 32-token window, 80 warm-start steps): 0.83 / 0.31 / 0.17, the reward
at chance for ~45-60 steps (seed 2 stopped calling `look` then, and no signal brings it back); `top_p=0.95` (cuts rare
no-look and malformed first tokens): 0.67 / 0.99 / 0.83; lr 5e-4 no faster and broke the look call on held-out
questions, 1e-3 collapsed the format, `num_iterations=2` stalled near 0.45; a 16-token window: the plateau ~25 steps
(0.83 / 0.83 / 1.00 with 50 warm-start steps, which keep the format). That is the recipe (`_recipe.LOOK_RECIPE`,
`_recipe.LOOK_WARM_START`, `_model.LOOK_MODEL_DIMS`).
"""

import os

__all__ = ["main", "save_tiny_model"]


def save_tiny_model(path: str | os.PathLike[str] = "tiny-model", *, seed: int = 0) -> str:
    """Save the demo's tiny Qwen3 model and its tokenizer, untrained (a few hundred thousand random weights, built
    locally: nothing is downloaded), to the folder `path`: a model for trying ors-trl without a model hub.

    The folder is what `ors-trl eval --model DIR`, `LocalPolicy.from_pretrained(DIR)` and `GRPOTrainer(model=DIR,
    ...)` load (on CPU: `GRPOConfig(use_cpu=True, ...)`). It writes well-formed text, not sensible tool calls: to see
    a model learn, run `ors-trl demo --save-model DIR`, which saves the model it trained. The command line:
    `ors-trl demo --steps 0 --save-model DIR`.

    Args:
        path (`str` or `os.PathLike`, *optional*, defaults to `"tiny-model"`):
            The folder to write (made if missing; files of an earlier save are replaced).
        seed (`int`, *optional*, defaults to `0`):
            Seeds the tokenizer's corpus and the weights (the same seed gives the same model).

    Returns:
        `str`: `path`.

    Raises:
        ConfigurationError: `path` is a file.
    """
    from ._model import save_tiny_model as save

    return save(path, seed=seed)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ors-trl demo`."""
    from ._main import main as _main

    return _main(argv)
