"""The same sandbox run by an ordinary user: the harness itself runs under a non-root uid
(via setpriv), builds its own launcher, and still contains hostile programs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import megacpp
from tests.eval.hostile_programs import (
    CONNECT,
    FORK_BOMB,
    MOUNT_TMPFS_ESCAPE,
    READ_OUTSIDE,
    WRITE_OUTSIDE,
    c_strings,
)

USER = 4242  # an unprivileged uid with no home and no other processes

WHOAMI = r"""
#include <cstdio>
#include <unistd.h>
int main() { std::printf("%d\n", (int)getuid()); return 0; }
"""

HARNESS = r"""
import json, subprocess, sys
from megacpp.eval import BuildOptions, CppVerifier, Limits, Sandbox
limits = Limits(cpu_s=1, wall_s=4.0, memory_bytes=512 << 20, processes=16, output_bytes=1 << 16)
verifier = CppVerifier(BuildOptions(), Sandbox("namespaces"), run_limits=limits)
verdicts = {name: verifier.verify(src).to_json() for name, src in json.load(sys.stdin).items()}
subprocess.run(["true"], check=True)  # the user can still start processes after the fork bomb
print(json.dumps(verdicts))
"""

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to start the harness as an ordinary user",
)


@pytest.fixture
def user_dir():
    """A scratch directory owned by the unprivileged user, holding a secret of its own."""
    path = Path(tempfile.mkdtemp(prefix="megacpp-nonroot-"))
    os.chown(path, USER, USER)
    path.chmod(0o700)
    yield path
    shutil.rmtree(path)


def _run_as_user(programs: dict[str, str], home: Path) -> dict[str, dict]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "MEGACPP_CACHE_DIR": str(home / "cache"),
           "PYTHONPATH": str(Path(megacpp.__file__).parents[1])}  # the megacpp under test
    done = subprocess.run(
        ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
         sys.executable, "-c", HARNESS],
        input=json.dumps(programs), capture_output=True, text=True, env=env, timeout=240,
        check=False,
    )
    if done.returncode != 0 and "Permission denied" in done.stderr and "python" in done.stderr:
        pytest.skip(f"uid {USER} cannot run this Python: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_non_root_harness_still_contains_hostile_programs(user_dir, loopback_server):
    user_secret = user_dir / "secret.txt"
    user_secret.write_text("the user's own secret")
    os.chown(user_secret, USER, USER)
    user_secret.chmod(0o600)
    escape = Path("/tmp") / f"megacpp_nonroot_escape_{os.getpid()}"
    port, accepted = loopback_server
    programs = {
        "whoami": WHOAMI,
        "fork_bomb": FORK_BOMB,
        "read": READ_OUTSIDE.replace("PATHS", c_strings([user_secret, "/etc/shadow"])),
        "write": WRITE_OUTSIDE.replace("PATHS", c_strings([escape, user_dir / "escape"])),
        "connect": CONNECT.replace("PORT", str(port)),
        "mount_tmpfs": MOUNT_TMPFS_ESCAPE,
    }
    verdicts = _run_as_user(programs, user_dir)
    assert verdicts["whoami"]["status"] == "passed"
    assert verdicts["whoami"]["stdout"].strip() == str(USER)  # its own uid, no root
    assert verdicts["fork_bomb"]["status"] == "timeout"
    assert verdicts["read"]["status"] == "passed", verdicts["read"]["stdout"]
    assert verdicts["write"]["status"] == "passed"
    assert not escape.exists() and not (user_dir / "escape").exists()
    assert verdicts["connect"]["status"] == "passed", verdicts["connect"]["stdout"]
    assert accepted == []
    assert verdicts["mount_tmpfs"]["status"] == "failed", verdicts["mount_tmpfs"]
    assert "unshare: Operation not permitted" in verdicts["mount_tmpfs"]["stderr"]
