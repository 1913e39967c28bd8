"""Real git for the tests: a work repo that pushes to a bare one (the remote under test), with fixed
author, committer and dates so that commits are the same on every run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BASE_TIME = 1_700_000_000


def git_env(t: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid",
            "GIT_AUTHOR_DATE": f"@{t} +0000",
            "GIT_COMMITTER_DATE": f"@{t} +0000",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
        }
    )
    return env


def run_git(*args: str, cwd: Path, t: int = BASE_TIME) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, env=git_env(t), capture_output=True, check=True)
    return p.stdout.decode().strip()


class Upstream:
    """A work repo that pushes to a bare repo; the bare repo is the remote under test."""

    def __init__(self, base: Path, name: str = "upstream") -> None:
        self.work = base / f"{name}-work"
        self.bare = base / f"{name}.git"
        self.work.mkdir(parents=True)
        self.t = BASE_TIME
        run_git("init", "-q", "--bare", "-b", "main", str(self.bare), cwd=base)
        run_git("init", "-q", "-b", "main", cwd=self.work)
        run_git("remote", "add", "origin", str(self.bare), cwd=self.work)

    @property
    def url(self) -> str:
        return f"file://{self.bare}"

    def commit(self, files: dict[str, str], msg: str = "c") -> str:
        for rel, text in files.items():
            p = self.work / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        self.t += 60
        run_git("add", "-A", cwd=self.work, t=self.t)
        run_git("commit", "-q", "-m", msg, cwd=self.work, t=self.t)
        return run_git("rev-parse", "HEAD", cwd=self.work)

    def push(self, branch: str = "main", force: bool = False) -> None:
        run_git(
            "push",
            "-q",
            *(["--force"] if force else []),
            "origin",
            f"HEAD:refs/heads/{branch}",
            cwd=self.work,
        )

    def rewrite(self, files: dict[str, str]) -> str:
        """Replace the last commit (amend) and force-push: the old head leaves the branch."""
        for rel, text in files.items():
            (self.work / rel).write_text(text)
        self.t += 60
        run_git("add", "-A", cwd=self.work, t=self.t)
        run_git("commit", "-q", "--amend", "-m", "rewritten", cwd=self.work, t=self.t)
        self.push(force=True)
        return run_git("rev-parse", "HEAD", cwd=self.work)
