"""The host side's command line: ``python3 install.pyz COMMAND ...`` (the commands are in the
package docstring); one JSON line on stdout when it is done, one error line on stderr when not."""

# ruff: noqa: UP031
from __future__ import annotations

import argparse
import base64
import json
import sys

from .errors import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, InstallError
from .files import inventory
from .install import Admission, install
from .pack import zipapp
from .receive import receive, widen_pipe
from .release import keep_serving, rollback, stage_installed, status, switch
from .root import DEFAULT_RESERVE


def _key_bytes(args: argparse.Namespace) -> bytes | None:
    if getattr(args, "trusted_key", None):
        try:
            with open(args.trusted_key, "rb") as f:
                return f.read(64 * 1024)
        except OSError as e:
            raise InstallError(
                "%s: cannot read trusted key: %s" % (args.trusted_key, e.strerror), EXIT_CONFIG
            ) from None
    if getattr(args, "trusted_key_base64", None):
        return args.trusted_key_base64.encode("ascii", "replace")
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="install.pyz", description="builder's offline bundle installer")
    sub = p.add_subparsers(dest="cmd")
    i = sub.add_parser("install", help="verify and install a bundle folder")
    i.add_argument("bundle")
    i.add_argument("--root", required=True)
    i.add_argument("--trusted-key", help="the fleet's minisign public key file (first install)")
    i.add_argument("--trusted-key-base64", help="the same key as its base64 line")
    i.add_argument("--insecure", action="store_true", help="skip the signature check (explicit only)")
    i.add_argument("--host", help="refuse a bundle made for another host")
    i.add_argument(
        "--remove-source", action="store_true", help="remove the bundle folder (under ROOT/incoming)"
    )
    i.add_argument(
        "--reserve", type=int, default=DEFAULT_RESERVE, help="bytes to keep free (default 256 MiB)"
    )
    i.add_argument("--lock-timeout", type=float, default=60.0)
    i.add_argument("--stage", action="store_true", help="stage only: point staged at it, do not switch")
    i.add_argument("--rehash", action="store_true", help="hash every placed file (trust no record): a repair")
    sg = sub.add_parser("stage", help="stage a release already under releases/")
    sg.add_argument("--root", required=True)
    sg.add_argument("--release", required=True)
    sg.add_argument("--lock-timeout", type=float, default=60.0)
    sw = sub.add_parser("switch", help="make a release under releases/ current")
    sw.add_argument("--root", required=True)
    sw.add_argument("--to", required=True)
    sw.add_argument("--rollback", action="store_true", help="record the switch as a rollback")
    sw.add_argument("--force", action="store_true", help="write the apply record again (a repair)")
    sw.add_argument("--lock-timeout", type=float, default=60.0)
    rb = sub.add_parser("rollback", help="switch current back to previous")
    rb.add_argument("--root", required=True)
    rb.add_argument("--lock-timeout", type=float, default=60.0)
    ks = sub.add_parser("keep-serving", help="keep what a release answered (its serving record) under state/")
    ks.add_argument("--root", required=True)
    ks.add_argument("--release", required=True)
    ks.add_argument("--record-base64", required=True, help="the record's JSON, base64")
    ks.add_argument("--lock-timeout", type=float, default=60.0)
    st = sub.add_parser("status", help="print the current state as JSON")
    st.add_argument("--root", required=True)
    rc = sub.add_parser("receive", help="receive a bundle streamed on stdin (builder ship) and install it")
    rc.add_argument("--root", required=True)
    rc.add_argument("--trusted-key", help="the fleet's minisign public key file (first install)")
    rc.add_argument("--trusted-key-base64", help="the same key as its base64 line")
    rc.add_argument("--insecure", action="store_true", help="skip the signature check (explicit only)")
    rc.add_argument("--host", help="refuse a bundle made for another host")
    rc.add_argument("--reserve", type=int, default=DEFAULT_RESERVE, help="bytes to keep free (default 256 MiB)")
    rc.add_argument("--lock-timeout", type=float, default=60.0)
    rc.add_argument("--stage", action="store_true", help="stage only: point staged at it, do not switch")
    rc.add_argument("--rehash", action="store_true", help="hash every placed file (trust no record): a repair")
    inv = sub.add_parser("inventory", help="print sizes and sha256 of the files under DIR as JSON")
    inv.add_argument("dir")
    sub.add_parser("assemble", help="print this installer as install.pyz (the zipapp hosts run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd in ("install", "receive"):  # (the two take the same checks and limits)
            admit = Admission(trusted_key=_key_bytes(args), insecure=args.insecure, host=args.host,
                              reserve=args.reserve, lock_timeout=args.lock_timeout, stage=args.stage,
                              rehash=args.rehash)
        if args.cmd == "install":
            res = install(args.bundle, args.root, admit, remove_source=args.remove_source)
        elif args.cmd == "stage":
            res = stage_installed(args.root, args.release, lock_timeout=args.lock_timeout)
        elif args.cmd == "switch":
            res = switch(
                args.root, args.to, rollback=args.rollback, force=args.force, lock_timeout=args.lock_timeout
            )
        elif args.cmd == "rollback":
            res = rollback(args.root, lock_timeout=args.lock_timeout)
        elif args.cmd == "keep-serving":
            try:
                record = base64.b64decode(args.record_base64, validate=True)
            except ValueError:
                raise InstallError("--record-base64: not base64", EXIT_CONFIG) from None
            res = keep_serving(args.root, args.release, record, lock_timeout=args.lock_timeout)
        elif args.cmd == "status":
            res = status(args.root)
        elif args.cmd == "receive":
            widen_pipe(0)
            res = receive(args.root, sys.stdin.buffer, sys.stdout.buffer, admit)
        elif args.cmd == "inventory":
            res = inventory(args.dir)
        elif args.cmd == "assemble":
            sys.stdout.buffer.write(zipapp())
            return EXIT_OK
        else:
            _parser().print_usage(sys.stderr)
            return EXIT_CONFIG
    except InstallError as e:
        sys.stderr.write("error: %s\n" % e)
        return e.code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except OSError as e:
        sys.stderr.write("error: %s: %s\n" % (getattr(e, "filename", None) or "I/O", e.strerror or e))
        return EXIT_FAILED
    sys.stdout.write(json.dumps(res, sort_keys=True) + "\n")
    sys.stdout.flush()
    return EXIT_OK
