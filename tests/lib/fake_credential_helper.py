#!/usr/bin/env python3
"""FAKE docker credential helper (builder tests): `docker-credential-NAME get` as the real helpers answer
it (the server on stdin; {"ServerURL", "Username", "Secret"} on stdout, or "credentials not found in
native keychain" and exit 1). It stands in for a keychain: its credentials are `book.json` beside it
(server -> [user, secret]), and each server it was asked for is appended to `asked` there.
Installed by tests.lib.registrylib.credential_helper. Standard library only."""

from __future__ import annotations

import json
import os
import sys


def main(args: list[str]) -> int:
    if args != ["get"]:
        return 1
    here = os.path.dirname(os.path.abspath(__file__))
    server = sys.stdin.read().strip()
    with open(os.path.join(here, "book.json")) as f:
        book = json.load(f)
    if server not in book:
        print("credentials not found in native keychain")
        return 1
    with open(os.path.join(here, "asked"), "a") as f:
        f.write(server + "\n")
    json.dump({"ServerURL": server, "Username": book[server][0], "Secret": book[server][1]}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
