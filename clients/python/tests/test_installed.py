"""webproxy_client as a user gets it: imported from the installed distribution (not
the source tree), with its version, its py.typed marker, and signatures that a
type checker sees: `mypy --strict` accepts typed_usage.py and refuses a misuse."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import webproxy_client

PYTHON_DIR = Path(__file__).resolve().parents[1]
MISUSE = '''

from webproxy_client import Client, Reply

def f(reply: Reply) -> str:
    return reply.status + "x"

async def g(client: Client) -> None:
    await client.request("GET", "http://h/", reply_too="app.r.1")

async def h(client: Client) -> None:
    await client.cancel("order-42", "WEBPROXY_POOL_DEFAULT:1")
'''


def test_the_package_is_imported_from_its_installation_not_the_source_tree():
    location = Path(webproxy_client.__file__).resolve()
    assert PYTHON_DIR not in location.parents, location
    assert "site-packages" in location.parts, location
    assert importlib.metadata.version("webproxy-client") == webproxy_client.__version__
    assert (location.parent / "py.typed").is_file()
    requires = importlib.metadata.requires("webproxy-client") or []
    assert any(r.startswith("nats-py") for r in requires), requires


def mypy(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    # From an empty directory: only the installed package can be found.
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         *map(str, files)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )


def test_a_typed_caller_passes_mypy_strict_and_a_misuse_does_not(tmp_path: Path):
    result = mypy(tmp_path, Path(__file__).with_name("typed_usage.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    misuse = tmp_path / "misuse.py"
    misuse.write_text(MISUSE)
    result = mypy(tmp_path, misuse)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'Unsupported operand types for + ("int" and "str")' in result.stdout, result.stdout
    assert 'Unexpected keyword argument "reply_too"' in result.stdout, result.stdout
    # A cancel takes a Submitted (or Reply), or all three of id, origin and msg_id.
    assert 'No overload variant of "cancel"' in result.stdout, result.stdout
