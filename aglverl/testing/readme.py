"""The README's code as code, for the tests that run it as written and the benchmark that times it.

:func:`shell_block` reads the ``sh`` block that follows a sentence of the README (the ``aglverl serve``
session); :func:`readme_snippet` reads the first ``python`` block under the README's ``## Training: `AsyncVERL``` heading;
:func:`with_steps` changes only its ``total_training_steps`` (a short run of the same code); :func:`load_snippet`
executes it as a module (its ``if __name__ == "__main__":`` part does not run) to reach its ``config``,
``agent`` and tasks.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

__all__ = ["README", "load_snippet", "readme_snippet", "shell_block", "with_steps"]

#: The project's README (beside the package, in a checkout).
README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "## Training: `AsyncVERL`"
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_SHELL = re.compile(r"```sh\n(.*?)```", re.DOTALL)
_STEPS = re.compile(r'"total_training_steps": (\d+)')


def readme_snippet(readme: Path = README) -> str:
    """The code of the first ``python`` block after :data:`HEADING`; ``LookupError`` if there is none."""
    text = readme.read_text()
    at = text.find(HEADING)
    match = _BLOCK.search(text, at) if at >= 0 else None
    if match is None:
        raise LookupError(f"{readme}: no python block under {HEADING!r}")
    return match.group(1)


def with_steps(code: str, steps: int) -> str:
    """``code`` with its one ``"total_training_steps": N`` set to ``steps``; ``LookupError`` unless there is
    exactly one."""
    if len(_STEPS.findall(code)) != 1:
        raise LookupError('the snippet must set "total_training_steps" exactly once')
    return _STEPS.sub(f'"total_training_steps": {steps}', code)


def load_snippet(code: str, name: str = "readme_snippet") -> types.ModuleType:
    """``code`` executed as the module ``name`` (not ``__main__``): its definitions, nothing run."""
    module = types.ModuleType(name)
    exec(compile(code, f"<{name}>", "exec"), module.__dict__)
    return module


def shell_block(after: str, readme: Path = README) -> str:
    """The first ``sh`` block after the text ``after``; ``LookupError`` if the text or the block is missing."""
    text = readme.read_text()
    at = text.find(after)
    match = _SHELL.search(text, at) if at >= 0 else None
    if match is None:
        raise LookupError(f"{readme}: no sh block after {after!r}")
    return match.group(1)
