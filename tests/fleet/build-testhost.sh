#!/bin/bash
# Build the builder test host image (builder-testhost:<recipe hash>) from Debian bookworm with debootstrap.
# No registry pulls: debootstrap fetches .debs from the Debian mirror, `docker import` makes the image.
# Idempotent: exits at once when the image for this recipe exists. The debootstrap rootfs tarball is
# cached in $BUILDER_TEST_CACHE (default /var/cache/builder-test) so a rebuild skips the download.
# Prints the image tag on stdout (last line). Needs root (debootstrap, chroot) and a Docker Engine.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${BUILDER_TEST_CACHE:-/var/cache/builder-test}
suite=bookworm
default_mirror=http://deb.debian.org/debian

# The Debian mirror this machine's apt-get uses for "$suite main": the first such entry, in apt's order
# (the one-line sources.list, then sources.list.d: *.list one-line and *.sources deb822 files, by name),
# at the paths apt-config reports (so APT_CONFIG and Dir::Etc settings count). Only http(s) and file
# URIs qualify (what debootstrap can fetch); a trailing slash is dropped so the cache key stays stable.
# Prints nothing when there is no such entry.
apt_mirror() {
    local list=/etc/apt/sources.list parts=/etc/apt/sources.list.d f
    if command -v apt-config >/dev/null; then
        eval "$(apt-config shell list Dir::Etc::sourcelist/f parts Dir::Etc::sourceparts/d 2>/dev/null)" || true
    fi
    {
        [ -f "$list" ] && printf 'L %s\n' "$list"
        for f in "${parts%/}"/*.list "${parts%/}"/*.sources; do
            [ -f "$f" ] && printf '%s %s\n' "$([ "${f%.sources}" = "$f" ] && echo L || echo S)" "$f"
        done | sort -k2
    } | while read -r kind f; do
        if [ "$kind" = L ]; then
            sed -e 's/#.*//' -e 's/\[[^]]*\]//g' "$f" \
                | awk -v s="$suite" '$1 == "deb" && $3 == s { for (i = 4; i <= NF; i++) if ($i == "main") { print $2; exit } }'
        else
            awk -v s="$suite" '
                function has(list, w,   n, a, i) { n = split(list, a, /[ \t]+/); for (i = 1; i <= n; i++) if (a[i] == w) return 1; return 0 }
                function flush() { if (has(v["types"], "deb") && has(v["suites"], s) && has(v["components"], "main") && tolower(v["enabled"]) != "no") { x = v["uris"]; sub(/^[ \t]+/, "", x); split(x, u, /[ \t]+/); if (u[1] != "") { print u[1]; done = 1; exit } } delete v; key = "" }
                /^#/ { next }
                /^[ \t]*$/ { flush(); next }
                /^[ \t]/ { if (key != "") v[key] = v[key] " " $0; next }
                { i = index($0, ":"); if (!i) next; key = tolower(substr($0, 1, i - 1)); val = substr($0, i + 1); gsub(/^[ \t]+|[ \t]+$/, "", val); v[key] = val }
                END { if (!done) flush() }' "$f"
        fi
    done | sed -e 's/^[ \t]*//' -e 's:/*$::' | grep -E -m1 '^(https?://[^/]|file:/)' || true
}
mirror=${BUILDER_TEST_MIRROR:-$(apt_mirror)}
mirror=${mirror:-$default_mirror}
if [ "${1:-}" = --print-mirror ]; then echo "$mirror"; exit 0; fi
packages=openssh-server,python3,openssl,iproute2,procps,curl,ca-certificates,iptables,docker.io,busybox-static,sudo,psmisc

die() { echo "build-testhost: $*" >&2; exit 1; }
log() { echo "build-testhost: $*" >&2; }

# The recipe hash covers this script and the entrypoint; tests/lib/fleetlib.py computes the same value.
version=$(cat "$here/build-testhost.sh" "$here/entrypoint.sh" | sha256sum | cut -c1-16)
tag="builder-testhost:$version"

command -v docker >/dev/null || die "docker CLI not found"
docker info >/dev/null 2>&1 || die "Docker Engine not reachable (docker info failed)"
if docker image inspect "$tag" >/dev/null 2>&1; then
    log "$tag exists, nothing to do"
    echo "$tag"; exit 0
fi
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and chroot)"
if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 \
        || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2; } \
        || die "could not install debootstrap with apt-get"
fi

mkdir -p "$cache" || die "cannot create cache folder $cache"
rootkey=$(printf '%s\n' "$suite" "$mirror" "$packages" | sha256sum | cut -c1-16)
rootfs_tar="$cache/rootfs-$suite-$rootkey.tar"
work=$(mktemp -d "${TMPDIR:-/tmp}/builder-testhost.XXXXXX")
cleanup() { rm -rf --one-file-system "$work"; }
trap cleanup EXIT
root="$work/root"

if [ ! -s "$rootfs_tar" ]; then
    log "debootstrap $suite from $mirror (takes a few minutes)"
    debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --numeric-owner -cf "$rootfs_tar.tmp" . && mv "$rootfs_tar.tmp" "$rootfs_tar" \
        || die "could not write $rootfs_tar"
    log "cached rootfs in $rootfs_tar"
else
    log "using cached rootfs $rootfs_tar"
    mkdir -p "$root"
    tar -C "$root" --numeric-owner -xf "$rootfs_tar" || die "could not extract $rootfs_tar"
fi

log "configuring"
chroot "$root" /usr/sbin/useradd -m -s /bin/bash -G docker,sudo spark
echo 'spark ALL=(ALL) NOPASSWD: ALL' > "$root/etc/sudoers.d/spark"
chmod 440 "$root/etc/sudoers.d/spark"
chroot "$root" passwd -d root >/dev/null
chroot "$root" usermod -p '*' spark
cat > "$root/etc/ssh/sshd_config.d/builder-test.conf" <<'CONF'
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UseDNS no
MaxStartups 100:30:200
MaxSessions 50
HostKey /etc/ssh/ssh_host_ed25519_key
CONF
rm -f "$root"/etc/ssh/ssh_host_*
install -m 0755 "$here/entrypoint.sh" "$root/usr/local/sbin/testhost-init"
echo testhost > "$root/etc/hostname"
# the inner dockerd must not try legacy/nft mismatch: keep Debian's default (nft) and record it
chroot "$root" update-alternatives --query iptables 2>/dev/null | grep '^Value' >&2 || true

log "importing $tag"
tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENTRYPOINT ["/usr/local/sbin/testhost-init"]' \
    --change 'LABEL builder-test.testhost=1' \
    --change "LABEL builder-test.recipe=$version" \
    --change 'VOLUME /var/lib/docker' \
    - "$tag" >/dev/null || die "docker import failed"
log "built $tag"
echo "$tag"
