"""The live webproxy the client tests share: one per test module (see clients/live_env.py)."""

import pytest

from live_env import LiveEnv


@pytest.fixture(scope="module")
def live():
    with LiveEnv() as env:
        yield env
