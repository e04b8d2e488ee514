"""Shared test fixtures: every async test runs on asyncio (aiohttp needs it) through the anyio plugin."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
