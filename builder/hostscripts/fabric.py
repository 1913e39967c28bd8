"""On a host: the RDMA devices and network interfaces in sysfs, and each interface's IPv4 addresses.

argv[1] is the sysfs root (normally ``/sys``). Prints JSON ``{"dev_infiniband": bool, "rdma":
{device: {port: {"state", "gids": {index: {"gid", "type", "ndev"}}}}}, "net": {name: {"mtu",
"ipv4"}}}``; all-zero GIDs are left out. The addresses come from ``ip -j -4 addr`` (none when
``ip`` is missing or fails).

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def rdma_devices(sysfs: str) -> dict[str, dict[str, object]]:
    ib = os.path.join(sysfs, "class", "infiniband")
    devs: dict[str, dict[str, object]] = {}
    for d in sorted(_listdir(ib)):
        ports: dict[str, object] = {}
        pdir = os.path.join(ib, d, "ports")
        for p in sorted(_listdir(pdir)):
            base = os.path.join(pdir, p)
            gids = {}
            gdir = os.path.join(base, "gids")
            for i in sorted(_listdir(gdir), key=lambda s: int(s) if s.isdigit() else 0):
                g = read(os.path.join(gdir, i))
                if not g or g.replace("0", "").replace(":", "") == "":
                    continue
                gids[i] = {
                    "gid": g,
                    "type": read(os.path.join(base, "gid_attrs", "types", i)),
                    "ndev": read(os.path.join(base, "gid_attrs", "ndevs", i)),
                }
            ports[p] = {"state": read(os.path.join(base, "state")), "gids": gids}
        devs[d] = ports
    return devs


def interfaces(sysfs: str) -> dict[str, dict[str, object]]:
    net: dict[str, dict[str, object]] = {}
    ndir = os.path.join(sysfs, "class", "net")
    for n in sorted(_listdir(ndir)):
        mtu = read(os.path.join(ndir, n, "mtu"))
        net[n] = {"mtu": int(mtu) if mtu and mtu.isdigit() else None, "ipv4": []}
    try:
        ip = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, timeout=10)
        addrs = json.loads(ip.stdout or "[]")
    except (OSError, ValueError, subprocess.SubprocessError):
        addrs = []
    for a in addrs:
        name = a.get("ifname")
        if name is None:
            continue
        entry = net.setdefault(name, {"mtu": a.get("mtu"), "ipv4": []})
        entry["ipv4"] = [i["local"] for i in a.get("addr_info", []) if i.get("family") == "inet"]
    return net


def main(argv: list[str]) -> int:
    sysfs = argv[1] if len(argv) > 1 else "/sys"
    facts = {"dev_infiniband": os.path.isdir("/dev/infiniband"), "rdma": rdma_devices(sysfs),
             "net": interfaces(sysfs)}
    sys.stdout.write(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
