#!/bin/bash
# PID 1 of a builder test host (see tests/fleet/README.md).
# Env: TESTHOST_AUTHORIZED_KEY (public key for root and spark), TESTHOST_DOCKERD (1 = start dockerd, default 1).
set -eu
# Fresh host keys for every host, generated at start (never baked into the image).
rm -f /etc/ssh/ssh_host_*
ssh-keygen -q -t ed25519 -N '' -f /etc/ssh/ssh_host_ed25519_key
for home in /root /home/spark; do
    mkdir -p "$home/.ssh"
    printf '%s\n' "${TESTHOST_AUTHORIZED_KEY:-}" > "$home/.ssh/authorized_keys"
    chmod 700 "$home/.ssh"; chmod 600 "$home/.ssh/authorized_keys"
done
chown -R spark:spark /home/spark/.ssh
mkdir -p /run/sshd
if [ "${TESTHOST_DOCKERD:-1}" = 1 ]; then
    # The container is not --privileged (the outer engine may lack a capability in its bounding set), so
    # the cgroup hierarchies come read-only: make them writable for the inner dockerd's runc.
    for d in /sys/fs/cgroup/*/; do mount -o remount,bind,rw "$d" 2>/dev/null || true; done
    # Own image store per host on the anonymous volume at /var/lib/docker: overlay2 when the kernel
    # mounts overlay there (volume on ext4/xfs), vfs otherwise. No bridge, no iptables: containers run
    # with --network host and serve on this host's IP.
    driver=${TESTHOST_STORAGE:-}
    if [ -z "$driver" ]; then
        p=/var/lib/docker/.overlay-probe; mkdir -p $p/l $p/u $p/w $p/m
        if mount -t overlay overlay -o lowerdir=$p/l,upperdir=$p/u,workdir=$p/w $p/m 2>/dev/null; then
            umount $p/m; driver=overlay2
        else
            driver=vfs
        fi
        rm -rf $p
    fi
    dockerd --storage-driver="$driver" --iptables=false --ip6tables=false --bridge=none \
        --host=unix:///var/run/docker.sock >/var/log/dockerd.log 2>&1 &
fi
/usr/sbin/sshd -D -e >>/var/log/sshd.log 2>&1 &
trap 'exit 0' TERM INT
# Stay up as init (reaping children) even when sshd is stopped by a test.
while :; do sleep 3600 & wait $! || true; done
