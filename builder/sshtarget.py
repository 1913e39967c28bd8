"""SSH targets (the inventory's ``Host.ssh``) and the fleet's ``ssh_config``: one parser and one rule,
used by the inventory's validation, the audit and ship alike. Standard library only (the audit imports
this before pydantic).

A target is ``[user@]host[:port]``, ``[user@][v6addr]:port`` (or ``[v6addr]``, or a bare IPv6 address
without a port), or an ssh_config alias. The characters are kept narrow on purpose: the target goes into
ssh's argv, into testinfra's ``ssh://`` host URL (where ``? # / % ,`` and a ``:`` in the user would
change its meaning: query options, a second host, a password for sshpass) and into the Ansible
inventory; a leading ``-`` would be read by ssh as an option wherever a tool puts the host after its
own options without ``--``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import NamedTuple

from builder.errors import ConfigError

#: a user, a host name or an ssh_config alias: letters, digits, '.', '_' and '-', not '-' or '.' first
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")
_BRACKETED = re.compile(r"\[([^\[\]]*)\](?::(.*))?")


class SshTarget(NamedTuple):
    user: str | None
    #: a host name, an ssh_config alias, or an IP address (IPv6 without its brackets)
    host: str
    port: int | None

    def url_host(self) -> str:
        """The host as it goes into a URL (testinfra's ``ssh://``): IPv6 in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host


def _port(target: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{target!r}: bad port {text!r} (a number 1-65535)")
    return int(text)


def _ipv6(target: str, text: str) -> str:
    if "%" in text:
        raise ValueError(f"{target!r}: an IPv6 zone (%...) is not supported; name the host in ssh_config")
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(f"{target!r}: not an IPv6 address: {text!r}") from None
    return text


def parse_target(target: str) -> SshTarget:
    """'[user@]host[:port]', '[user@][v6]:port', a bare IPv6 address or an alias -> (user, host, port).
    ValueError (one line) for anything else: a leading '-', whitespace, control characters, an empty
    user or host, a bad port, characters outside [A-Za-z0-9._-] in a user or host name."""
    if not target:
        raise ValueError("empty ssh target")
    if target.startswith("-"):
        raise ValueError(f"{target!r}: must not start with '-' (ssh would take it for an option)")
    for c in target:
        if c.isspace():
            raise ValueError(f"{target!r}: whitespace in an ssh target")
        if not c.isprintable():
            raise ValueError(f"{target!r}: control character {c!r} in an ssh target")
    user: str | None
    user, at, rest = target.rpartition("@")
    if not at:
        user = None
    elif not user:
        raise ValueError(f"{target!r}: empty user before '@'")
    elif not _NAME.fullmatch(user):
        raise ValueError(f"{target!r}: user {user!r}: only letters, digits, '.', '_' and '-' (not first)")
    if not rest:
        raise ValueError(f"{target!r}: empty host")
    port: int | None = None
    if rest.startswith("["):
        m = _BRACKETED.fullmatch(rest)
        if m is None:
            raise ValueError(f"{target!r}: an IPv6 address is written [ADDRESS] or [ADDRESS]:PORT")
        host = _ipv6(target, m.group(1))
        if m.group(2) is not None:
            port = _port(target, m.group(2))
        return SshTarget(user, host, port)
    if rest.count(":") > 1:  # a bare IPv6 address (no port: that needs the brackets)
        try:
            return SshTarget(user, _ipv6(target, rest), None)
        except ValueError:
            raise ValueError(f"{target!r}: not an IPv6 address; with a port write [ADDRESS]:PORT") from None
    host, colon, port_text = rest.partition(":")
    if colon:
        port = _port(target, port_text)
    if not host:
        raise ValueError(f"{target!r}: empty host")
    if not _NAME.fullmatch(host):
        raise ValueError(
            f"{target!r}: host {host!r}: a host name, IP address or ssh_config alias of letters, digits, "
            "'.', '_' and '-' (not first)"
        )
    return SshTarget(user, host, port)


def ssh_argv_tail(t: SshTarget) -> list[str]:
    """What goes after ssh's other options: user and port as options, then ``--`` and the host, so
    nothing after the options is ever read as one."""
    out: list[str] = []
    if t.user:
        out += ["-l", t.user]
    if t.port is not None:
        out += ["-p", str(t.port)]
    return [*out, "--", t.host]


def ssh_config_file(fleet_file: Path, value: str | None) -> Path | None:
    """The fleet's ``ssh_config`` (``fleet.ssh_config`` of ``fleet_file``): ``~`` expanded, a relative
    path taken from the fleet file's folder (the same for audit and ship, wherever they are run from).
    ConfigError naming the file and key when it is not a file."""
    if value is None:
        return None
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = (fleet_file.parent / p).resolve()
    if not p.is_file():
        raise ConfigError(f"{fleet_file}: fleet.ssh_config: no such file: {p}")
    return p
