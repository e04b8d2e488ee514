"""Shared test fixtures: every async test runs on asyncio (aiohttp needs it) through the anyio plugin."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from helpers.overlay import Overlay

#: The Agent Lightning tier's Python (``make test-agl`` sets it): Python 3.12 with ``agentlightning==1.0.2``.
AGL_PYTHON_ENV = "AGL_PYTHON"


def agl_python() -> str | None:
    """The Agent Lightning venv's interpreter: ``$AGL_PYTHON``, else ``.venv-agl/bin/python`` if it was built."""
    given = os.environ.get(AGL_PYTHON_ENV)
    if given:
        return given
    built = Path(__file__).resolve().parents[1] / ".venv-agl" / "bin" / "python"
    return str(built) if built.exists() else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` need a real vLLM, tests marked ``agl`` Agent Lightning's venv, tests marked ``agl03``
    agentlightning 0.3 installed here: skipped (with the command that runs them) where it is missing."""
    import importlib.util

    marks = []
    if importlib.util.find_spec("vllm") is None:
        marks.append(("vllm", "vLLM is not installed here: the vLLM tier runs with `make test-vllm`"))
    if agl_python() is None:
        marks.append(
            ("agl", "Agent Lightning's venv is not built: the Agent Lightning tier runs with `make test-agl`")
        )
    if importlib.util.find_spec("agentlightning") is None:
        marks.append(
            ("agl03", "agentlightning 0.3 is not installed here: the tier runs with `make test-agl03`")
        )
    for name, reason in marks:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(name) is not None:
                item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The built-in tiny model, built once per session under a private ``AGLVERL_HOME`` (set for the session,
    so ``"tiny"`` resolves there in this process and in the CLI processes tests start)."""
    from aglverl.engine.tiny import HOME_ENV, tiny_model_path

    home = tmp_path_factory.mktemp("aglverl-home")
    old = os.environ.get(HOME_ENV)
    os.environ[HOME_ENV] = str(home)
    try:
        yield tiny_model_path()
    finally:
        if old is None:
            os.environ.pop(HOME_ENV, None)
        else:
            os.environ[HOME_ENV] = old


@pytest.fixture(scope="session")
def agent_framework(tmp_path_factory: pytest.TempPathFactory) -> Overlay:
    """Microsoft Agent Framework added beside Agent Lightning 0.3 with the constraints file, in an overlay venv of
    .venv-agl03 (``helpers.overlay``): built once per session for the ``agl03`` tests that use it (needs PyPI,
    ~50 s on a fresh machine); ``installed`` says whether pip added it."""
    from helpers.overlay import framework_overlay

    return framework_overlay(tmp_path_factory.mktemp("agent-framework") / "overlay")
