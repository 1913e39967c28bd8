#!/usr/bin/env python3
"""Delay and drop packets from an NFQUEUE: a stand-in for `tc qdisc ... netem` on kernels built without
sch_netem. Runs inside a test host; pure standard library (raw nfnetlink_queue protocol).

    nfdelay.py QUEUE DELAY_MS LOSS_PCT

Pair it with `iptables -I OUTPUT ! -o lo -j NFQUEUE --queue-num QUEUE --queue-bypass`: every packet the
host sends is held DELAY_MS milliseconds (order kept), and LOSS_PCT percent of them are dropped.
"""

from __future__ import annotations

import collections
import random
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
CMD_BIND = 1
COPY_META = 1
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def message(kind: int, queue: int, body: bytes, seq: int) -> bytes:
    nfgen = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue)
    payload = nfgen + body
    return (
        struct.pack("=IHHII", 16 + len(payload), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, seq, 0)
        + payload
    )


def packet_ids(data: bytes):
    off = 0
    while off + 16 <= len(data):
        length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
        if length < 16:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = off + 16 + 4
            end = off + length
            while a + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x3FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, a + 4)[0]
                a += (alen + 3) & ~3
        elif kind == NLMSG_ERROR:
            code = struct.unpack_from("=i", data, off + 16)[0]
            if code != 0:
                print(f"nfdelay: netlink error {code}", file=sys.stderr, flush=True)
        off += (length + 3) & ~3


def main() -> int:
    queue, delay_ms, loss_pct = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    sock.send(
        message(
            NFQNL_MSG_CONFIG,
            queue,
            attr(NFQA_CFG_CMD, struct.pack("=BB", CMD_BIND, 0) + struct.pack("!H", 0)),
            1,
        )
    )
    sock.send(message(NFQNL_MSG_CONFIG, queue, attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, COPY_META)), 2))
    sock.send(message(NFQNL_MSG_CONFIG, queue, attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)), 3))
    print(f"nfdelay: queue {queue} delay {delay_ms} ms loss {loss_pct}%", file=sys.stderr, flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    delay = delay_ms / 1000.0
    seq = 10
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select([sock], [], [], timeout)
        now = time.monotonic()
        if ready:
            try:
                data = sock.recv(1 << 20)
            except OSError:  # ENOBUFS under a burst: the kernel dropped some, carry on
                continue
            for pid in packet_ids(data):
                if loss_pct and random.random() * 100.0 < loss_pct:
                    seq += 1
                    sock.send(
                        message(
                            NFQNL_MSG_VERDICT,
                            queue,
                            attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_DROP, pid)),
                            seq,
                        )
                    )
                else:
                    held.append((now + delay, pid))
        while held and held[0][0] <= time.monotonic():
            _, pid = held.popleft()
            seq += 1
            sock.send(
                message(
                    NFQNL_MSG_VERDICT, queue, attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid)), seq
                )
            )


if __name__ == "__main__":
    sys.exit(main())
