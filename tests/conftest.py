"""Shared test fixtures: every async test runs on asyncio (aiohttp needs it) through the anyio plugin."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` need a real vLLM: skipped (with the command that runs them) where it is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: the vLLM tier runs with `make test-vllm`")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
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
