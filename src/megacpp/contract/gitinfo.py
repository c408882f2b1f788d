"""The project's git state: commit, dirty flag, and a hash of everything uncommitted.

``diff_sha256`` covers ``git diff HEAD --binary`` (staged and unstaged changes to tracked
files) *and* every untracked, not-ignored file (its path and the sha256 of its content):
a new source file that nobody committed changes behaviour just as much as an edit.
Ignored files (``.venv/``, build outputs) are not part of it. A clean tree has
``diff_sha256 = None``.

Outside a git repository, without ``git`` on PATH, or in a checkout without history
(a vendored copy), the fields that cannot be known are ``None``; nothing raises.

A copy of a tree run elsewhere (a GPU machine handed the working tree with a stale ``.git``,
or none) can say which commit it was copied from in ``MEGACPP_SOURCE_COMMIT``; that claim is
recorded as ``declared_commit``, next to (never instead of) what git itself reports, and is
not verified. Like the rest of the git block it is informational, not a contract field.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megacpp._io import sha256_file
from megacpp.contract.probes import which

_GIT_TIMEOUT_S = 60
SOURCE_COMMIT_ENV = "MEGACPP_SOURCE_COMMIT"


def default_project_root() -> Path:
    """The directory holding the running ``megacpp`` package (a checkout, when editable)."""
    import megacpp

    return Path(megacpp.__file__).resolve().parent


def capture_git(
    root: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """``{"root", "sha", "dirty", "diff_sha256", "untracked_files"}`` or ``None`` (no repo/git);
    plus ``declared_commit`` when ``MEGACPP_SOURCE_COMMIT`` is set (then never ``None``: the
    fields git cannot give are ``None``)."""
    env = os.environ if env is None else env
    state = _capture_git(root, env)
    declared = (env.get(SOURCE_COMMIT_ENV) or "").strip()
    if not declared:
        return state
    unknown = dict.fromkeys(("root", "sha", "dirty", "diff_sha256", "untracked_files"))
    return {**(state or unknown), "declared_commit": declared}


def _capture_git(root: str | os.PathLike[str] | None, env: Mapping[str, str]
                 ) -> dict[str, Any] | None:
    git = which("git", env)
    start = Path(root) if root is not None else default_project_root()
    if git is None or not start.is_dir():
        return None
    toplevel = _git(git, start, env, "rev-parse", "--show-toplevel")
    if toplevel is None:
        return None
    top = Path(toplevel.decode().strip())
    sha_out = _git(git, top, env, "rev-parse", "--verify", "-q", "HEAD")
    sha = sha_out.decode().strip() if sha_out else None
    status = _git(git, top, env, "status", "--porcelain=v1", "--untracked-files=all")
    untracked = _untracked(git, top, env)
    dirty = None if status is None else bool(status.strip())
    return {
        "root": str(top),
        "sha": sha,
        "dirty": dirty,
        "diff_sha256": _diff_sha256(git, top, env, sha, untracked) if dirty else None,
        "untracked_files": len(untracked) if untracked is not None else None,
    }


def _git(git: str, cwd: Path, env: Mapping[str, str], *args: str) -> bytes | None:
    try:
        done = subprocess.run(
            [git, "-C", str(cwd), *args], capture_output=True, check=False,
            timeout=_GIT_TIMEOUT_S, env=dict(env),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _untracked(git: str, top: Path, env: Mapping[str, str]) -> list[str] | None:
    out = _git(git, top, env, "ls-files", "--others", "--exclude-standard", "-z")
    return None if out is None else sorted(p for p in out.decode().split("\0") if p)


def _diff_sha256(
    git: str, top: Path, env: Mapping[str, str], sha: str | None, untracked: list[str] | None
) -> str | None:
    digest = hashlib.sha256()
    if sha is not None:
        diff = _git(git, top, env, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff")
        if diff is None:
            return None
        digest.update(diff)
    for rel in untracked or []:
        path = top / rel
        content = sha256_file(path) if path.is_file() else "not-a-file"
        digest.update(f"\0untracked\0{rel}\0{content}\n".encode())
    return digest.hexdigest()
