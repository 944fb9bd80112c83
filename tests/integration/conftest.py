"""The integration tests' launcher (tests/integration/cli_launcher.py) starts its forkserver once per test
process, before any test's reaper (tests/conftest.py) notes the children that were already there: session
fixtures are set up before function ones."""

import pytest

from tests.integration import cli_launcher


@pytest.fixture(scope="session", autouse=True)
def cli_forkserver():
    cli_launcher.context()
