"""builder.lock.gitsrc against real git: local bare repos over file://, bundles, force-pushes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from builder.errors import ResolveError
from builder.foundation.canon import sha256_tree
from builder.inputs.pins import GitSource
from builder.lock import gitsrc, resolve
from builder.lock.lockfile import LockedSource, load_lock
from tests.lib import factory
from tests.lib.gitlib import BASE_TIME, Upstream, git_env, run_git


@pytest.fixture
def up(tmp_path: Path) -> Upstream:
    u = Upstream(tmp_path)
    u.commit({"README": "one\n", "src/main.zig": "pub fn main() void {}\n"})
    u.push()
    return u


def res(
    spec: GitSource,
    tmp_path: Path,
    *,
    offline: bool = False,
    previous: LockedSource | None = None,
    update: bool = False,
    name: str = "engine",
) -> LockedSource:
    return gitsrc.resolve(
        name, spec, root=tmp_path, cache=tmp_path / "cache", offline=offline, previous=previous, update=update
    )


def test_branch_head_is_locked_with_tree_hash(up: Upstream, tmp_path: Path) -> None:
    c2 = up.commit({"src/extra.txt": "x\n"})
    up.push()
    got = res(GitSource(url=up.url, ref="main"), tmp_path)
    assert got.commit == c2 and got.ref_head == c2 and got.on_ref
    assert got.commit_time == up.t
    assert got.patches == []
    dest = tmp_path / "export"
    mirror = gitsrc.mirror_path(tmp_path / "cache", up.url)
    assert mirror.is_dir()
    gitsrc.export_tree(mirror, c2, dest)
    assert (dest / "src" / "extra.txt").read_text() == "x\n"
    assert sha256_tree(dest) == got.tree_sha256
    # the same content in a different repo has the same tree hash
    other = Upstream(tmp_path, "other")
    for rel in ("README", "src/main.zig", "src/extra.txt"):
        (other.work / rel).parent.mkdir(parents=True, exist_ok=True)
        (other.work / rel).write_bytes((up.work / rel).read_bytes())
    other.commit({}, "different message")
    other.push()
    assert res(GitSource(url=other.url, ref="main"), tmp_path).tree_sha256 == got.tree_sha256


def test_tree_hash_covers_modes_and_symlinks(up: Upstream, tmp_path: Path) -> None:
    (up.work / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (up.work / "run.sh").chmod(0o755)
    os.symlink("src/main.zig", up.work / "link")
    c = up.commit({})
    up.push()
    a = res(GitSource(url=up.url, ref="main"), tmp_path)
    dest = tmp_path / "export"
    gitsrc.export_tree(gitsrc.mirror_path(tmp_path / "cache", up.url), c, dest)
    assert os.readlink(dest / "link") == "src/main.zig"
    assert os.access(dest / "run.sh", os.X_OK) and not os.access(dest / "README", os.X_OK)
    assert sha256_tree(dest) == a.tree_sha256
    (up.work / "run.sh").chmod(0o644)  # only the mode changes
    up.commit({})
    up.push()
    assert res(GitSource(url=up.url, ref="main"), tmp_path).tree_sha256 != a.tree_sha256


def test_short_rev_is_expanded_and_must_be_on_ref(up: Upstream, tmp_path: Path) -> None:
    c1 = run_git("rev-parse", "HEAD", cwd=up.work)
    c2 = up.commit({"b": "2\n"})
    up.push()
    got = res(GitSource(url=up.url, ref="main", rev=c1[:7]), tmp_path)
    assert got.commit == c1 and got.rev == c1[:7] and got.ref_head == c2 and got.on_ref


def test_missing_rev_and_ref_are_errors(up: Upstream, tmp_path: Path) -> None:
    with pytest.raises(ResolveError, match=r"sources\.engine: rev deadbeef not found in file://"):
        res(GitSource(url=up.url, ref="main", rev="deadbeef"), tmp_path)
    with pytest.raises(ResolveError, match=r"sources\.engine: ref nope not found"):
        res(GitSource(url=up.url, ref="nope"), tmp_path)


def test_ambiguous_prefix_is_refused(up: Upstream, tmp_path: Path) -> None:
    # make enough commits that two share a 4-hex prefix (plumbing keeps this fast)
    tree = run_git("rev-parse", "HEAD^{tree}", cwd=up.work)
    seen: dict[str, str] = {}
    pair = None
    for i in range(2000):
        c = (
            subprocess.run(
                ["git", "commit-tree", tree, "-m", f"n{i}"],
                cwd=up.work,
                env=git_env(BASE_TIME),
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .strip()
        )
        if c[:4] in seen:
            pair = (seen[c[:4]], c)
            break
        seen[c[:4]] = c
    assert pair is not None
    run_git("update-ref", "refs/heads/a", pair[0], cwd=up.work)
    run_git("update-ref", "refs/heads/b", pair[1], cwd=up.work)
    run_git("push", "-q", "origin", "refs/heads/a", "refs/heads/b", cwd=up.work)
    mirror = gitsrc.ensure_mirror(up.url, tmp_path / "cache", offline=False, name="engine")
    assert gitsrc.expand_rev(mirror, pair[0][:4]) == sorted(pair)
    assert gitsrc.expand_rev(mirror, pair[0][:12]) == [pair[0]]
    # pins need 7+ digits; a 4-digit rev (bypassing the schema) shows the resolver's own refusal
    spec = GitSource.model_construct(url=up.url, ref="main", rev=pair[0][:4], patches=[], note=None)
    with pytest.raises(
        ResolveError, match=rf"sources\.engine: rev {pair[0][:4]} is ambiguous .*pin more digits"
    ):
        res(spec, tmp_path)


def test_force_push_under_pinned_rev_is_refused(up: Upstream, tmp_path: Path) -> None:
    c1 = up.commit({"b": "2\n"})
    up.push()
    spec = GitSource(url=up.url, ref="main", rev=c1)
    first = res(spec, tmp_path)
    assert first.on_ref
    new_head = up.rewrite({"b": "rewritten\n"})
    with pytest.raises(ResolveError) as ei:
        res(spec, tmp_path, previous=first, update=True)
    msg = str(ei.value)
    assert msg == (
        f"sources.engine: pinned commit {c1[:12]} is no longer on ref main (ref now at {new_head[:12]}): "
        "the branch was force-pushed or rewritten; refusing to move it; re-pin rev after review"
    )
    assert "\n" not in msg


def test_unpinned_rewrite_needs_update(up: Upstream, tmp_path: Path) -> None:
    spec = GitSource(url=up.url, ref="main")
    first = res(spec, tmp_path)
    # a fast-forward moves without asking
    c2 = up.commit({"c": "3\n"})
    up.push()
    second = res(spec, tmp_path, previous=first)
    assert second.commit == c2
    # a rewrite does not
    new_head = up.rewrite({"c": "changed\n"})
    with pytest.raises(
        ResolveError,
        match=rf"locked commit {c2[:12]} is no longer on ref main \(ref now at "
        rf"{new_head[:12]}\).*--update engine",
    ):
        res(spec, tmp_path, previous=second)
    moved = res(spec, tmp_path, previous=second, update=True)
    assert moved.commit == new_head and moved.on_ref


def test_offline_uses_the_cache_only(up: Upstream, tmp_path: Path) -> None:
    url = "https://git.example.invalid/engine.git"  # never contacted: offline, and primed below
    spec = GitSource(url=url, ref="main")
    with pytest.raises(ResolveError) as ei:
        res(spec, tmp_path, offline=True)
    assert str(ei.value) == f"sources.engine: not in the cache and --offline was given ({url})"
    # a mirror already in the cache (made here from the local upstream) answers offline
    mirror = gitsrc.mirror_path(tmp_path / "cache", url)
    run_git("clone", "-q", "--mirror", str(up.bare), str(mirror), cwd=tmp_path)
    head = run_git("rev-parse", "HEAD", cwd=up.work)
    got = res(spec, tmp_path, offline=True)
    assert got.commit == head and got.url == url
    with pytest.raises(ResolveError, match=r"rev 1234567 not found in https://git\.example\.invalid"):
        res(GitSource(url=url, ref="main", rev="1234567"), tmp_path, offline=True)


def test_offline_still_reads_local_remotes(up: Upstream, tmp_path: Path) -> None:
    spec = GitSource(url=up.url, ref="main")
    offline = res(spec, tmp_path, offline=True)  # file:// is not network: no cache needed
    assert offline == res(spec, tmp_path)
    c2 = up.commit({"later": "x\n"})
    up.push()
    assert res(spec, tmp_path, offline=True, previous=offline).commit == c2


def test_unreachable_remote_is_one_line(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/no-such-repo.git"
    with pytest.raises(ResolveError) as ei:
        res(GitSource(url=url, ref="main"), tmp_path)
    msg = str(ei.value)
    assert msg.startswith(f"sources.engine: cannot fetch {url}: ")
    assert "\n" not in msg and "Traceback" not in msg
    assert not any((tmp_path / "cache").glob("*.git"))  # no half-made mirror


def test_credentials_in_url_are_not_shown(tmp_path: Path) -> None:
    url = "https://user:s3cret@127.0.0.1:9/repo.git"
    with pytest.raises(ResolveError) as ei:
        res(GitSource(url=url, ref="main"), tmp_path)
    assert "s3cret" not in str(ei.value) and "127.0.0.1:9/repo.git" in str(ei.value)


def test_relative_bundle_file_and_tags(up: Upstream, tmp_path: Path) -> None:
    run_git("tag", "v1", cwd=up.work)
    c1 = run_git("rev-parse", "HEAD", cwd=up.work)
    up.commit({"after": "tag\n"})
    proj = tmp_path / "proj"
    (proj / "engine-src").mkdir(parents=True)
    run_git("bundle", "create", str(proj / "engine-src" / "e.bundle"), "--all", cwd=up.work)
    got = gitsrc.resolve(
        "demo",
        GitSource(url="engine-src/e.bundle", ref="v1"),
        root=proj,
        cache=tmp_path / "cache",
        offline=False,
        previous=None,
        update=False,
    )
    assert got.commit == c1 and got.url == "engine-src/e.bundle"
    again = gitsrc.resolve(
        "demo",
        GitSource(url="engine-src/e.bundle", ref="v1"),
        root=proj,
        cache=tmp_path / "cache",
        offline=True,
        previous=None,
        update=False,
    )
    assert again == got


# --------------------------------------------------------------------------- a commit kept only by a pull ref


class DeletedBranch:
    """The dsv41-feat story in small: branch ``feat`` at ``pinned`` is opened as pull request 7 (GitHub keeps
    its head as ``refs/pull/7/head``), then force-pushed to ``rewritten``, merged into main and deleted. The
    pull ref still holds ``pinned``; no branch does."""

    def __init__(self, up: Upstream) -> None:
        self.base = run_git("rev-parse", "HEAD", cwd=up.work)
        run_git("checkout", "-q", "-b", "feat", cwd=up.work)
        self.pinned = up.commit({"src/feature.zig": "pub const v = 1;\n"}, "feature")
        up.push("feat")
        run_git("push", "-q", "origin", "HEAD:refs/pull/7/head", cwd=up.work)
        self.up = up

    def force_push_merge_delete(self) -> None:
        up = self.up
        (up.work / "src" / "feature.zig").write_text("pub const v = 2;\n")
        up.t += 60
        run_git("commit", "-q", "-a", "--amend", "-m", "feature, rewritten", cwd=up.work, t=up.t)
        self.rewritten = run_git("rev-parse", "HEAD", cwd=up.work)
        up.push("feat", force=True)  # the force-push: pinned leaves the branch
        up.push("main")  # the merge (a fast-forward of main)
        run_git("push", "-q", "origin", ":refs/heads/feat", cwd=up.work)  # the branch is deleted
        refs = run_git("for-each-ref", "--format=%(refname) %(objectname)", cwd=up.bare)
        assert f"refs/pull/7/head {self.pinned}" in refs.splitlines() and "refs/heads/feat" not in refs


@pytest.fixture
def story(up: Upstream) -> DeletedBranch:
    return DeletedBranch(up)


def test_commit_of_a_deleted_branch_locks_through_its_pull_ref(story: DeletedBranch, tmp_path: Path) -> None:
    up = story.up
    before = res(GitSource(url=up.url, ref="feat", rev=story.pinned), tmp_path)  # the mirror knew the branch
    assert before.commit == story.pinned
    story.force_push_merge_delete()
    # the branch is gone from the remote (the mirror's fetch prunes it): one line, saying what to do
    with pytest.raises(ResolveError) as ei:
        res(GitSource(url=up.url, ref="feat", rev=story.pinned), tmp_path)
    msg = str(ei.value)
    assert msg == (
        f"sources.engine: ref feat not found in {up.url}, but rev {story.pinned} is still there: the branch was "
        "deleted or renamed; pin a ref that holds the commit (a merged pull request keeps refs/pull/N/head) and "
        "keep the branch name in note"
    )
    # the pull request's ref keeps the commit: the lock resolves through it, short rev expanded
    spec = GitSource(url=up.url, ref="refs/pull/7/head", rev=story.pinned[:8],
                     note="branch feat, force-pushed, merged as #7 and deleted")
    got = res(spec, tmp_path)
    assert got.commit == story.pinned and got.ref_head == story.pinned and got.on_ref
    assert got.ref == "refs/pull/7/head" and got.rev == story.pinned[:8]
    assert got.tree_sha256 == before.tree_sha256  # the same tree as when the branch still held it
    dest = tmp_path / "export"
    gitsrc.export_tree(gitsrc.mirror_path(tmp_path / "cache", up.url), got.commit, dest)
    assert (dest / "src" / "feature.zig").read_text() == "pub const v = 1;\n"
    assert sha256_tree(dest) == got.tree_sha256
    # unpinned, the pull ref's head is the commit
    assert res(GitSource(url=up.url, ref="refs/pull/7/head"), tmp_path).commit == story.pinned


def test_rev_not_on_the_pull_ref_is_refused(story: DeletedBranch, tmp_path: Path) -> None:
    story.force_push_merge_delete()
    # the force-pushed commit is in the repository (main holds it) but not on the pull ref
    with pytest.raises(ResolveError) as ei:
        res(GitSource(url=story.up.url, ref="refs/pull/7/head", rev=story.rewritten), tmp_path)
    msg = str(ei.value)
    assert msg == (
        f"sources.engine: pinned commit {story.rewritten[:12]} is no longer on ref refs/pull/7/head (ref now at "
        f"{story.pinned[:12]}): the ref was force-pushed or rewritten; refusing to move it; re-pin rev after review"
    )
    assert "\n" not in msg
    # a pull ref written without refs/ is a missing branch: the message names the full ref
    with pytest.raises(ResolveError, match=r"^sources\.engine: ref pull/7/head not found in file://.*; a pull "
                       r"request's head is the full ref refs/pull/7/head$"):
        res(GitSource(url=story.up.url, ref="pull/7/head", rev=story.pinned), tmp_path)


def test_builder_lock_records_the_pull_ref(story: DeletedBranch, tmp_path: Path) -> None:
    story.force_push_merge_delete()
    proj = tmp_path / "proj"
    proj.mkdir()
    engine = {"url": str(story.up.url), "ref": "refs/pull/7/head", "rev": story.pinned,
              "note": "branch feat: force-pushed, merged as #7 and deleted; the pull ref keeps the commit"}
    factory.write_pins(proj, factory.pins(sources={"engine": engine}))
    report = resolve.resolve(proj / "pins.toml", proj / "pins.lock",
                             resolve.ResolveOptions(cache=tmp_path / "store"))
    assert report.failed == {} and report.resolved == ["sources.engine"] and report.written
    entry = load_lock(proj / "pins.lock").sources["engine"]
    assert (entry.ref, entry.commit, entry.ref_head, entry.on_ref) == (
        "refs/pull/7/head", story.pinned, story.pinned, True)
    # a pinned rev that is not on the named ref is refused by the lock too, and nothing is written for it
    factory.write_pins(proj, factory.pins(sources={"engine": engine | {"rev": story.rewritten}}))
    report = resolve.resolve(proj / "pins.toml", proj / "pins.lock",
                             resolve.ResolveOptions(cache=tmp_path / "store"))
    assert list(report.failed) == ["sources.engine"]
    assert "is no longer on ref refs/pull/7/head" in report.failed["sources.engine"]
    assert load_lock(proj / "pins.lock").sources["engine"].commit == story.pinned  # the last complete entry stays
