#!/usr/bin/env bash
# Regenerate engine-src/demo-engine.bundle (and patches/demo/0001-*.patch) from engine-src/demo-engine/.
#
# The bundle is a real git repository on branch main with two commits and the tag v0.1.0. Authors,
# dates and config are fixed, so the same source gives the same commits (and the same bundle bytes)
# on any machine. `builder lock` clones it over file://, like any other git source.
#
# usage: engine-src/make-bundle.sh [--check]     --check: fail if the committed files are stale
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$here/demo-engine"
bundle="$here/demo-engine.bundle"
patch_dir="$(cd "$here/.." && pwd)/patches/demo"
patch_name="0001-version-suffix-patched.patch"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A sealed git: no user or system config, fixed identity and dates.
export HOME="$work/home" GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
export GIT_AUTHOR_NAME="demo-engine" GIT_AUTHOR_EMAIL="demo-engine@example.invalid"
export GIT_COMMITTER_NAME="demo-engine" GIT_COMMITTER_EMAIL="demo-engine@example.invalid"
export TZ=UTC LC_ALL=C
mkdir -p "$HOME"
g() { git -C "$work/repo" -c core.autocrlf=false -c core.fileMode=true -c pack.threads=1 \
        -c commit.gpgSign=false -c tag.gpgSign=false "$@"; }
at() { export GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1"; }

git init -q -b main "$work/repo"
copy() {  # copy one path from the plain source folder, with a normalized mode
  local rel="$1"
  mkdir -p "$(dirname "$work/repo/$rel")"
  install -m 0644 "$src/$rel" "$work/repo/$rel"
}

# Commit 1: the engine itself.
copy build.zig
copy src/main.zig
g add build.zig src/main.zig
at "2025-01-01T00:00:00Z"
g commit -q -m "demo-engine: version, capabilities and a tiny OpenAI-style server"

# Commit 2: the README and ignore file; tagged v0.1.0.
copy README.md
copy .gitignore
g add README.md .gitignore
at "2025-01-02T00:00:00Z"
g commit -q -m "docs: README and .gitignore"
g tag -a v0.1.0 -m "demo-engine 0.1.0"

# The patch the pins apply on top of main: visible in --version as "+patched".
g checkout -q -b patched
sed -i 's/^pub const version_suffix = "";$/pub const version_suffix = "+patched";/' "$work/repo/src/main.zig"
grep -q '"+patched"' "$work/repo/src/main.zig" || { echo "make-bundle: version_suffix line not found" >&2; exit 1; }
g add src/main.zig
at "2025-01-03T00:00:00Z"
g commit -q -m "version: mark patched builds with a +patched suffix"
g format-patch -q --zero-commit --no-signature --no-stat -1 -o "$work/patches" HEAD
mv "$work/patches/"0001-*.patch "$work/patches/$patch_name"
g checkout -q main
g branch -q -D patched

g bundle create "$work/demo-engine.bundle" HEAD main v0.1.0 2>/dev/null
git bundle verify "$work/demo-engine.bundle" >/dev/null 2>&1

if [[ "${1:-}" == "--check" ]]; then
  cmp -s "$work/demo-engine.bundle" "$bundle" || { echo "make-bundle: $bundle is stale" >&2; exit 1; }
  cmp -s "$work/patches/$patch_name" "$patch_dir/$patch_name" || { echo "make-bundle: $patch_dir/$patch_name is stale" >&2; exit 1; }
  echo "up to date: main $(g rev-parse main)"
  exit 0
fi

mkdir -p "$patch_dir"
install -m 0644 "$work/demo-engine.bundle" "$bundle.tmp" && mv "$bundle.tmp" "$bundle"
install -m 0644 "$work/patches/$patch_name" "$patch_dir/$patch_name.tmp" && mv "$patch_dir/$patch_name.tmp" "$patch_dir/$patch_name"
echo "wrote $bundle (main $(g rev-parse main), tag v0.1.0) and $patch_dir/$patch_name"
