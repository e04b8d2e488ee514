"""A framework added beside Agent Lightning 0.3 with ``pip install -c .venv-agl03/constraints.txt FRAMEWORK`` (the
file ``make venv-agl03`` writes: every distribution the recipe installed, pinned) keeps what the recipe solved.

The install goes into an overlay of the tier's venv (``helpers.overlay``: a venv whose site-packages adds
.venv-agl03's), so the venv the tier runs in is left as it is: pip sees everything .venv-agl03 holds as installed
and adds only what is missing there, as it would in .venv-agl03 itself. The overlay is the session's
``agent_framework`` fixture, which ``test_agl03_agent_framework.py`` trains an agent in. Needs PyPI (the ``agl03``
tier, in .venv-agl03).
"""

from __future__ import annotations

import pytest
from helpers.overlay import FRAMEWORK_NAMES, Overlay, canonical, conflicts, purelib, run

pytestmark = pytest.mark.agl03


def test_a_framework_added_with_the_constraints_file_adds_packages_and_moves_none(
    agent_framework: Overlay,
) -> None:
    """agent-framework-lab (with agent-framework-openai, whose client its samples use) installs with the
    constraints file: only its own packages are added, ``pip check`` finds no conflict the recipe did not already
    accept (agentops' ranges for packaging and psutil), and the framework imports beside agentlightning, aglverl's
    VERL and verl's tensordict. Its ``[lightning]`` extra, which asks pip to resolve agentlightning's dependencies
    again, is refused naming packaging, and changes nothing."""
    overlay = agent_framework
    pinned = dict(
        line.split("==", 1) for line in overlay.constraints.read_text().splitlines() if "==" in line
    )
    assert pinned["packaging"].startswith("25") and "tensordict" in pinned  # what the recipe solved
    assert all(line.startswith("agentops ") for line in overlay.before), overlay.before

    refused = overlay.refused
    assert refused.returncode != 0 and "packaging" in refused.stdout + refused.stderr
    assert overlay.installed, overlay.why_not()

    # nothing new: packaging, tensordict, psutil, litellm, openai as they were
    python = overlay.python
    assert conflicts(python) == overlay.before
    new = {canonical(p.name.split("-")[0]) for p in purelib(python).glob("*.dist-info")}
    # added beside (nothing, where .venv-agl03 has them already); nothing the recipe installed is moved
    assert new <= FRAMEWORK_NAMES and not new & {canonical(n) for n in pinned}
    check = (
        "import agent_framework, agentlightning, tensordict; from aglverl.agl03.verl import VERL; "
        "from agent_framework.openai import OpenAIChatClient; "
        "from importlib.metadata import version; "
        "print(version('agent-framework-lab'), version('packaging'), version('tensordict'), version('litellm'))"
    )
    imported = run(python, "-c", check)
    assert imported.returncode == 0, imported.stderr[-2000:]
    lab, packaging, tensordict, litellm = imported.stdout.split()
    assert (lab, packaging, tensordict, litellm) == (
        "1.0.0b261022",
        pinned["packaging"],
        pinned["tensordict"],
        pinned["litellm"],
    )
