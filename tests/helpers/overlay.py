"""A framework added beside Agent Lightning 0.3 the way the README says (``pip install -c
.venv-agl03/constraints.txt FRAMEWORK``), into an overlay of the tier's venv: a venv whose site-packages adds
.venv-agl03's (its ``.pth`` files included: aglverl's editable install), so the venv the tier runs in is left as
it is while pip sees everything .venv-agl03 holds as installed and adds only what is missing there, as it would
in .venv-agl03 itself.

:func:`framework_overlay` builds it (~50 s from PyPI on a fresh machine, a few seconds from pip's cache): the
``agl03`` tier's session fixture ``agent_framework`` (``conftest.py``) builds it once for every test that needs
the framework. Runs in .venv-agl03 (``sys.prefix`` is the venv the overlay adds).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: Microsoft Agent Framework's lab package (its Agent Lightning samples) at the releases this was tried with, and
#: its OpenAI clients (``agent_framework.openai.OpenAIChatClient``, which the lab's samples import, is a lazy
#: re-export of agent-framework-openai in agent-framework-core 1.23: without it the import fails).
FRAMEWORK = [
    "agent-framework-lab==1.0.0b261022",
    "agent-framework-core==1.23.0",
    "agent-framework-openai==1.17.0",
]
#: What the overlay may gain, as pip spells names (PEP 503).
FRAMEWORK_NAMES = frozenset(re.sub(r"[-_.]+", "-", r.split("==")[0]).lower() for r in FRAMEWORK)


def run(*command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end with its output captured; pip's version check off and litellm offline."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def conflicts(python: str) -> set[str]:
    """``pip check``'s lines (one per requirement an installed distribution does not meet)."""
    lines = run(python, "-m", "pip", "check").stdout.splitlines()
    return {line for line in lines if " has requirement " in line or " requires " in line}


def purelib(python: str) -> Path:
    """The site-packages directory of ``python``'s venv."""
    return Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())


@dataclass(frozen=True)
class Overlay:
    """An overlay venv after :data:`FRAMEWORK` was added with the constraints file: its Python, the constraints
    file, ``pip check``'s lines before anything was added, the refused try of the ``[lightning]`` extra and the
    install itself (both as pip answered)."""

    python: str
    constraints: Path
    before: set[str]
    refused: subprocess.CompletedProcess[str]
    added: subprocess.CompletedProcess[str]

    @property
    def installed(self) -> bool:
        return self.added.returncode == 0

    def why_not(self) -> str:
        """What pip said when the framework did not install."""
        return f"pip could not add {FRAMEWORK}:\n{self.added.stdout[-2000:]}{self.added.stderr[-2000:]}"


def framework_overlay(root: Path) -> Overlay:
    """An overlay of this venv at ``root`` (see the module docstring), :data:`FRAMEWORK` added to it with
    ``.venv-agl03/constraints.txt``, after a try of agent-framework-lab's ``[lightning]`` extra (which pip must
    refuse). Raises ``AssertionError`` when the constraints file or the venv cannot be made."""
    constraints = Path(sys.prefix) / "constraints.txt"
    assert constraints.exists(), f"{constraints} is missing: `make venv-agl03` writes it"
    done = run(sys.executable, "-m", "venv", "--without-pip", str(root))
    assert done.returncode == 0, done.stderr
    python = str(root / "bin" / "python")
    base = sysconfig.get_paths()["purelib"]
    (purelib(python) / "agl03-venv.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    before = conflicts(python)
    refused = run(python, "-m", "pip", "install", "-c", str(constraints), "agent-framework-lab[lightning]")
    added = run(python, "-m", "pip", "install", "-q", "-c", str(constraints), *FRAMEWORK)
    return Overlay(python, constraints, before, refused, added)
