"""The `Host` allow-list of the HTTP port (`server.allowed_hosts`): DNS rebinding.

A page on attacker.example can make its own name resolve to the gateway's address (127.0.0.1, a private
address) once the browser has loaded it; the page's scripts then reach the gateway as *same-origin* requests,
with `Host: attacker.example`, past the Origin checks (gateway/edge/origin.py). The gateway therefore serves only
the names it is known by: a request whose `Host` names another host is answered `421 Misdirected Request`
(`bad_host`) and its connection closed, on every path (pages, `/api`, `/ws`, `/sse`, `POST /sse/SID`, `/lp`),
before the application sees it (gateway/edge/netguard.py checks it when the headers are complete).

Allowed: a `Host` that is an IP address literal (a rebinding attack needs a name of the attacker's), a name
listed in `server.allowed_hosts` (`*.example.com`: any name below example.com; `*`: every name), and when
the list is empty the bind address and `localhost`. No `Host` (HTTP/1.0, services) is not a browser and
passes, as a request without `Origin` does. The port is not compared: the listening socket decides it.
"""

from __future__ import annotations

import ipaddress

from ..config import ConfigError

#: names every default list holds (the bind address is added to them)
DEFAULT_NAMES = ("localhost",)


def _host_name(value: str) -> str:
    """The host of a `Host` value (no port, no IPv6 brackets, no trailing dot), lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value[:-1] if value.endswith(".") else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which `Host` values the HTTP port serves (module docstring)."""

    def __init__(self, allowed_hosts: object, bind_host: str) -> None:
        if not isinstance(allowed_hosts, list) or not all(isinstance(h, str) and h.strip() for h in allowed_hosts):
            raise ConfigError("server.allowed_hosts must be a list of host names (non-empty strings)")
        self.any = "*" in allowed_hosts
        entries = [_host_name(h) for h in allowed_hosts if h != "*"]
        if not allowed_hosts:
            entries = [*DEFAULT_NAMES, _host_name(bind_host)]
        #: "*.example.com" entries as ".example.com"
        self.suffixes = tuple(e[1:] for e in entries if e.startswith("*."))
        self.names = frozenset(e for e in entries if not e.startswith("*."))
        for entry in self.suffixes:
            if "*" in entry or entry == ".":
                raise ConfigError(f"server.allowed_hosts: {entry!r}: a wildcard is `*` or `*.domain` only")
        for entry in self.names:
            if "*" in entry or "/" in entry:
                raise ConfigError(f"server.allowed_hosts: {entry!r} is not a host name")

    def allows(self, value: bytes) -> bool:
        """Whether a request with this `Host` header value is served."""
        if self.any:
            return True
        name = _host_name(value.decode("latin-1"))
        if not name or name in self.names or _is_ip(name):
            return True
        return any(name.endswith(suffix) for suffix in self.suffixes)
