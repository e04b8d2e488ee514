"""A framework added beside Agent Lightning 0.3 with ``pip install -c .venv-agl03/constraints.txt FRAMEWORK`` (the
file ``make venv-agl03`` writes: every distribution the recipe installed, pinned) keeps what the recipe solved.

The install goes into an overlay of the tier's venv (a venv whose site-packages adds .venv-agl03's), so the venv
the tier runs in is left as it is: pip sees everything .venv-agl03 holds as installed and adds only what is
missing there, as it would in .venv-agl03 itself. Needs PyPI (the ``agl03`` tier, in .venv-agl03).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.agl03

#: Microsoft Agent Framework's lab package (its Agent Lightning samples), at the releases this was tried with.
FRAMEWORK = ["agent-framework-lab==1.0.0b261022", "agent-framework-core==1.23.0"]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)


def _canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _conflicts(python: str) -> set[str]:
    """``pip check``'s lines (one per requirement an installed distribution does not meet)."""
    lines = _run(python, "-m", "pip", "check").stdout.splitlines()
    return {line for line in lines if " has requirement " in line or " requires " in line}


def _overlay(root: Path) -> str:
    """A venv whose site-packages adds this venv's (its ``.pth`` files included: aglverl's editable install);
    returns its Python."""
    done = _run(sys.executable, "-m", "venv", "--without-pip", str(root))
    assert done.returncode == 0, done.stderr
    python = str(root / "bin" / "python")
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    base = sysconfig.get_paths()["purelib"]
    Path(purelib, "agl03-venv.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    return python


def test_a_framework_added_with_the_constraints_file_adds_packages_and_moves_none(tmp_path: Path) -> None:
    """agent-framework-lab installs with the constraints file: only its own packages are added, ``pip check``
    finds no conflict the recipe did not already accept (agentops' ranges for packaging and psutil), and the
    framework imports beside agentlightning, aglverl's VERL and verl's tensordict. Its ``[lightning]`` extra, which
    asks pip to resolve agentlightning's dependencies again, is refused naming packaging, and changes nothing."""
    constraints = Path(sys.prefix) / "constraints.txt"
    assert constraints.exists(), f"{constraints} is missing: `make venv-agl03` writes it"
    pinned = dict(line.split("==", 1) for line in constraints.read_text().splitlines() if "==" in line)
    assert pinned["packaging"].startswith("25") and "tensordict" in pinned  # what the recipe solved
    python = _overlay(tmp_path / "overlay")
    before = _conflicts(python)
    assert all(line.startswith("agentops ") for line in before), before

    refused = _run(python, "-m", "pip", "install", "-c", str(constraints), "agent-framework-lab[lightning]")
    assert refused.returncode != 0 and "packaging" in refused.stdout + refused.stderr
    added = _run(python, "-m", "pip", "install", "-q", "-c", str(constraints), *FRAMEWORK)
    assert added.returncode == 0, added.stdout[-2000:] + added.stderr[-2000:]

    # nothing new: packaging, tensordict, psutil, litellm, openai as they were
    assert _conflicts(python) == before
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    new = {_canonical(p.name.split("-")[0]) for p in Path(purelib).glob("*.dist-info")}
    # added beside (nothing, where .venv-agl03 has them already); nothing the recipe installed is moved
    assert new <= {"agent-framework-lab", "agent-framework-core"} and not new & {
        _canonical(n) for n in pinned
    }
    check = (
        "import agent_framework, agentlightning, tensordict; from aglverl.agl03.verl import VERL; "
        "from importlib.metadata import version; "
        "print(version('agent-framework-lab'), version('packaging'), version('tensordict'), version('litellm'))"
    )
    imported = _run(python, "-c", check)
    assert imported.returncode == 0, imported.stderr[-2000:]
    lab, packaging, tensordict, litellm = imported.stdout.split()
    assert (lab, packaging, tensordict, litellm) == (
        "1.0.0b261022",
        pinned["packaging"],
        pinned["tensordict"],
        pinned["litellm"],
    )
