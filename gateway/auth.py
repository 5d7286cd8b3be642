"""Subscriber identity: connection tokens are JWTs (PyJWT), verified against the `[auth]` config.

A token names a user (`sub`), when it expires (`exp`) and which topics the user may reach beyond the ones
open to anonymous clients: `subscribe` and `publish` are lists of topic patterns (fnmatch, as the topic
rules). HS256 tokens are checked with `auth.jwt_secret`, RS256 / ES256 tokens with the PEM public key in
`auth.jwt_public_key_file`; each key only ever checks its own algorithms, so a public key can never be
used as an HMAC secret (the classic algorithm-confusion attack).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from .config import AuthConfig, ConfigError
from .errors import BadToken, TokenExpired, TokenRevoked, TooManyTokenChecks
from .owners import check_user_id
from .ratelog import AddressRates
from .revocations import RevocationTable

if TYPE_CHECKING:
    from .addrcount import SharedRate

HMAC_ALGORITHMS = ("HS256",)
PUBLIC_KEY_ALGORITHMS = ("RS256", "ES256")
#: the one algorithm each kind of public key checks: a token of the other one is refused as any bad token
#: (PyJWT would raise InvalidKeyError, which is not an InvalidTokenError)
_KEY_ALGORITHMS: tuple[tuple[type, str], ...] = ((RSAPublicKey, "RS256"), (EllipticCurvePublicKey, "ES256"))
#: addresses whose token checks are counted (`CheckLimiter`); past it the least recently seen are forgotten
MAX_TRACKED_ADDRESSES = 65536
#: A token is a few hundred bytes; 8 KiB leaves room for long pattern lists and bounds the work per check.
MAX_TOKEN_BYTES = 8192
#: Longest user id (`sub`): it names private queues and appears in logs and the admin API.
MAX_USER_CHARS = 128
#: Longest token id (`jti`): a revocation names it.
MAX_JTI_CHARS = 256
#: Patterns per claim: each command checks them in turn.
MAX_PATTERNS = 256


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a verified token says the client is, and what it grants."""

    user: str
    #: Unix time (seconds) at which the token expires
    expires_at: float
    subscribe: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    #: the token's `info` claim (a JSON object) or the connect hook's `info`: the connection's presence `info`;
    #: None when absent
    info: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    #: granted by the backend's connect hook (gateway/proxy.py), not by a token: its expiry is extended by
    #: the refresh hook when one is configured
    proxied: bool = False
    #: the token's `jti` and `iat` (Unix seconds), when it has them: what a revocation names (revocations.py)
    jti: str | None = None
    issued_at: float | None = None


class CheckLimiter:
    """Token checks (signature verifications) per peer address: a token bucket per address (`AddressRates`,
    or with `server.workers` > 1 the workers' shared `SharedRate`). A 4096-bit RS256 check costs ~0.1 ms:
    unbounded, one client sending bad tokens took most of a core (issue 24)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.rates: AddressRates | SharedRate = AddressRates(rate, burst, MAX_TRACKED_ADDRESSES)
        #: checks refused, for /metrics (`fanout_auth_rate_limited_total`)
        self.refused = 0

    def take(self, address: str) -> bool:
        return self.rate <= 0 or self.rates.take(address)


class TokenVerifier:
    def __init__(self, auth: AuthConfig) -> None:
        self.secret = auth.jwt_secret
        self.public_key: Any = None
        self.public_algorithms: list[str] = []
        if auth.jwt_public_key_file:
            path = Path(auth.jwt_public_key_file)
            try:
                pem = path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"auth.jwt_public_key_file: cannot read {path}: {exc.strerror}") from None
            try:
                self.public_key = load_pem_public_key(pem)  # parsed once, not per check
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"auth.jwt_public_key_file: {path} is not a PEM public key: {exc}") from None
            self.public_algorithms = [alg for kind, alg in _KEY_ALGORITHMS if isinstance(self.public_key, kind)]
            if not self.public_algorithms:
                raise ConfigError(f"auth.jwt_public_key_file: {path} is neither an RSA nor an EC public key")
        #: token checks per address (`auth.rate_per_ip`, `burst_per_ip`); per connection, the `auth` commands
        #: are limited in gateway/commands.py (`auth.rate_per_connection`, `burst_per_connection`)
        self.per_address = CheckLimiter(auth.rate_per_ip, auth.burst_per_ip)
        self.audience = auth.jwt_audience or None
        self.issuer = auth.jwt_issuer or None
        self.leeway = auth.leeway_s
        #: revoked tokens (`POST /api/revocations`): refused by `verify`, wherever the token comes from
        self.revocations = RevocationTable(auth.max_revocations)

    @property
    def enabled(self) -> bool:
        return bool(self.secret or self.public_key)

    def admit(self, address: str | None) -> None:
        """Count one token check from `address`; TooManyTokenChecks past `auth.rate_per_ip`."""
        if address is not None and not self.per_address.take(address):
            self.per_address.refused += 1
            raise TooManyTokenChecks(f"too many token checks from this address (auth.rate_per_ip ="
                              f" {self.per_address.rate:g}/s); retry later")

    def verify(self, token: object, address: str | None = None) -> Principal:
        """The token's principal; BadToken or TokenExpired saying why it is refused, TooManyTokenChecks
        when `address` made too many checks (`admit`)."""
        self.admit(address)
        if not self.enabled:
            raise BadToken("authentication is not configured on this gateway (auth.jwt_secret)")
        if not isinstance(token, str) or not token:
            raise BadToken("the token must be a non-empty string")
        if len(token) > MAX_TOKEN_BYTES:
            raise BadToken(f"the token is longer than {MAX_TOKEN_BYTES} bytes")
        try:
            algorithm = jwt.get_unverified_header(token).get("alg")
            key: str | bytes
            if algorithm in HMAC_ALGORITHMS and self.secret:
                key, algorithms = self.secret, list(HMAC_ALGORITHMS)
            elif algorithm in self.public_algorithms:
                key, algorithms = self.public_key, self.public_algorithms
            else:
                raise BadToken(f"token algorithm {algorithm!r} is not accepted here")
            claims = jwt.decode(
                token, key, algorithms=algorithms, audience=self.audience, issuer=self.issuer,
                leeway=self.leeway, options={"require": ["sub", "exp"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenExpired("the token has expired") from None
        except jwt.PyJWTError as exc:  # InvalidTokenError, and InvalidKeyError of a key the token cannot use
            raise BadToken(f"invalid token: {exc}") from None
        except (ValueError, TypeError) as exc:  # anything else a malformed token makes a library raise
            raise BadToken(f"invalid token: {type(exc).__name__}") from None
        principal = _principal(claims)
        if self.revocations.revoked(principal) is not None:
            self.revocations.refused += 1
            raise TokenRevoked("the token was revoked")
        return principal


def _patterns(claims: dict[str, Any], name: str) -> tuple[str, ...]:
    value = claims.get(name, [])
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value) or len(value) > MAX_PATTERNS:
        raise BadToken(f"claim {name!r} must be a list of at most {MAX_PATTERNS} topic patterns (strings)")
    return tuple(value)


def _principal(claims: dict[str, Any]) -> Principal:
    user = claims["sub"]
    if not isinstance(user, str) or not 0 < len(user) <= MAX_USER_CHARS:
        raise BadToken(f"claim 'sub' must be a string of 1..{MAX_USER_CHARS} characters")
    reserved = check_user_id(user)  # anonymous client ids own queues too (gateway/owners.py)
    if reserved is not None:
        raise BadToken(reserved)
    exp = claims["exp"]
    info = claims.get("info")
    if info is not None and not isinstance(info, dict):
        raise BadToken("claim 'info' must be a JSON object")
    jti = claims.get("jti")
    if jti is not None and (not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI_CHARS):
        raise BadToken(f"claim 'jti' must be a string of 1..{MAX_JTI_CHARS} characters")
    iat = claims.get("iat")  # PyJWT checked it is a number when present
    return Principal(user, float(exp), _patterns(claims, "subscribe"), _patterns(claims, "publish"), info=info,
                     jti=jti, issued_at=float(iat) if iat is not None else None)
