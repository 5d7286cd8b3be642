"""Revoked tokens (`POST /api/revocations`, docs/protocol.md): a bounded table that every token check reads
(gateway/auth/tokens.py `TokenVerifier.verify`: the one handshake and the `auth` command alike).

Two kinds of entry, each expiring with the tokens it names:

* by `jti`: that one token; kept until its `exp` (given by the operator as `expires_at`), else for
  `auth.revocation_ttl_s`, plus `auth.leeway_s` (a token is accepted until `exp + leeway`).
* by `user` and `issued_before` T: every token of the user whose `iat` is before T (a token without `iat`
  counts as issued before any T: it cannot show otherwise); kept until T + `auth.revocation_ttl_s` +
  leeway, when every token issued before T has expired if tokens live at most `auth.revocation_ttl_s`.

A later entry for the same user replaces the earlier one when its `issued_before` is later (it names a
superset). At most `auth.max_revocations` live entries: past them a revocation is refused
(`too_many_revocations`, 507) rather than one forgotten early. Cost: a check is two dict lookups; expired
entries are dropped when met, and all at once when the table is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BadRequest, TooManyRevocations


class Principal(Protocol):
    """What a revocation reads of a verified token (gateway/auth/tokens.py's Principal, which imports this)."""

    @property
    def user(self) -> str: ...

    @property
    def jti(self) -> str | None: ...

    @property
    def issued_at(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Revocation:
    """One entry: `jti`, or `user` with `issued_before`; `expires_at` (Unix seconds) is when it is dropped."""

    expires_at: float
    jti: str | None = None
    user: str | None = None
    issued_before: float | None = None

    @property
    def key(self) -> str:
        return f"jti:{self.jti}" if self.jti is not None else f"user:{self.user}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"expires_at": self.expires_at}
        if self.jti is not None:
            out["jti"] = self.jti
        else:
            out["user"], out["issued_before"] = self.user, self.issued_before
        return out

    @classmethod
    def from_dict(cls, value: Any) -> Revocation:
        """An entry as `as_dict` wrote it (a control message, the Redis hash). Raises BadRequest."""
        try:
            expires_at = float(value["expires_at"])
            if "jti" in value:
                return cls(expires_at, jti=str(value["jti"]))
            return cls(expires_at, user=str(value["user"]), issued_before=float(value["issued_before"]))
        except (KeyError, TypeError, ValueError):
            raise BadRequest("not a revocation entry") from None

    def names(self, principal: Principal) -> bool:
        """Whether this entry revokes `principal`'s token."""
        if self.jti is not None:
            return principal.jti == self.jti
        if principal.user != self.user:
            return False
        assert self.issued_before is not None
        return principal.issued_at is None or principal.issued_at < self.issued_before


class RevocationTable:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._by_jti: dict[str, Revocation] = {}
        self._by_user: dict[str, Revocation] = {}
        #: tokens refused as revoked (/metrics would show it; the admin stats do)
        self.refused = 0

    def __len__(self) -> int:
        return len(self._by_jti) + len(self._by_user)

    def add(self, entry: Revocation, now: float | None = None) -> Revocation:
        """Add (or widen) an entry; returns the one now in force. TooManyRevocations when full of live ones."""
        now = time.time() if now is None else now
        table = self._by_jti if entry.jti is not None else self._by_user
        name = entry.jti if entry.jti is not None else entry.user
        assert name is not None
        old = table.get(name)
        if old is not None and old.expires_at > now:
            if (
                entry.jti is None
                and old.issued_before is not None
                and entry.issued_before is not None
                and old.issued_before >= entry.issued_before
            ):
                return old  # the entry in force already names every token this one does
            if entry.jti is not None and old.expires_at >= entry.expires_at:
                return old
        elif len(self) >= self.max_entries:
            self.purge(now)
            if len(self) >= self.max_entries:
                raise TooManyRevocations(
                    f"the revocation table holds its maximum of {self.max_entries} live entries (auth.max_revocations)"
                )
        table[name] = entry
        return entry

    def revoked(self, principal: Principal, now: float | None = None) -> Revocation | None:
        """The live entry that revokes `principal`'s token, if any."""
        now = time.time() if now is None else now
        for table, name in ((self._by_jti, principal.jti), (self._by_user, principal.user)):
            if name is None:
                continue
            entry = table.get(name)
            if entry is None:
                continue
            if entry.expires_at <= now:
                del table[name]
            elif entry.names(principal):
                return entry
        return None

    def purge(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for table in (self._by_jti, self._by_user):
            for name in [n for n, e in table.items() if e.expires_at <= now]:
                del table[name]

    def entries(self) -> list[Revocation]:
        return [*self._by_jti.values(), *self._by_user.values()]
