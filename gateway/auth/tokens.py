"""Subscriber identity: connection tokens are JWTs (PyJWT), verified against the `[auth]` config.

A token names a user (`sub`), when it expires (`exp`) and which topics the user may reach beyond the ones
open to anonymous clients: `subscribe` and `publish` are lists of topic patterns (fnmatch, as the topic
rules). HS256 tokens are checked with `auth.jwt_secret`, RS256 / ES256 / EdDSA tokens with the PEM public
key in `auth.jwt_public_key_file` or a key of the JWKS set at `auth.jwks_url` (gateway/auth/jwks.py: fetched in the
background, never while a token is checked); each key only ever checks its own algorithms, so a public key
can never be used as an HMAC secret (the classic algorithm-confusion attack).

Rotation: `auth.jwt_previous_secret` and `auth.jwt_previous_public_key_file` are accepted beside the current
ones (a token is tried with the current key, then the previous one) until removed from the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from ..config import MAX_TENANT_NAME, AuthConfig, ConfigError
from ..edge.ratelog import AddressRates
from ..errors import BadToken, TokenExpired, TokenRevoked, TooManyTokenChecks
from ..ops.tracing import NO_TRACING, Tracing
from .jwks import JWKS_ALGORITHMS, JwksKeys
from .owners import check_user_id
from .revocations import RevocationTable

if TYPE_CHECKING:
    from ..edge.addrcount import SharedRate

HMAC_ALGORITHMS = ("HS256",)
PUBLIC_KEY_ALGORITHMS = ("RS256", "ES256", "EdDSA")
#: the one algorithm each kind of public key checks: a token of another one is refused as any bad token
#: (PyJWT would raise InvalidKeyError, which is not an InvalidTokenError)
_KEY_ALGORITHMS: tuple[tuple[type, str], ...] = (
    (RSAPublicKey, "RS256"),
    (EllipticCurvePublicKey, "ES256"),
    (Ed25519PublicKey, "EdDSA"),
)
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
    #: granted by the backend's connect hook (gateway/hooks/backend.py), not by a token: its expiry is extended by
    #: the refresh hook when one is configured
    proxied: bool = False
    #: the token's `jti` and `iat` (Unix seconds), when it has them: what a revocation names (revocations.py)
    jti: str | None = None
    issued_at: float | None = None
    #: the token's tenant claim (`fairness.tenant_claim`), and the `kid` of the key set's key that verified
    #: it (a JWKS key, chosen by that kid): where its connection's tenant comes from (gateway/tenancy.py)
    tenant: str | None = None
    key_id: str | None = None


class CheckLimiter:
    """Token checks (signature verifications) per peer address: a token bucket per address (`AddressRates`,
    or with `server.workers` > 1 the workers' shared `SharedRate`). A 4096-bit RS256 check costs ~0.1 ms:
    unbounded, one client sending bad tokens took most of a core."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.rates: AddressRates | SharedRate = AddressRates(rate, burst, MAX_TRACKED_ADDRESSES)
        #: checks refused, for /metrics (`fanout_auth_rate_limited_total`)
        self.refused = 0

    def take(self, address: str) -> bool:
        return self.rate <= 0 or self.rates.take(address)


def _public_key(setting: str, file: str) -> tuple[Any, str]:
    """The PEM public key in `file` (parsed once, not per check) and the one algorithm it checks."""
    path = Path(file)
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"auth.{setting}: cannot read {path}: {exc.strerror}") from None
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"auth.{setting}: {path} is not a PEM public key: {exc}") from None
    for kind, algorithm in _KEY_ALGORITHMS:
        if isinstance(key, kind):
            return key, algorithm
    raise ConfigError(f"auth.{setting}: {path} is neither an RSA, an EC nor an Ed25519 public key")


class TokenVerifier:
    def __init__(self, auth: AuthConfig, tracing: Tracing = NO_TRACING, *, tenant_claim: str = "tenant") -> None:
        #: the HMAC secrets, current first: a token is tried with each in turn (rotation)
        self.secrets = [s for s in (auth.jwt_secret, auth.jwt_previous_secret) if s]
        #: the PEM public keys, current first, each with the one algorithm it checks
        self.public_keys = [
            _public_key(setting, file)
            for setting, file in (
                ("jwt_public_key_file", auth.jwt_public_key_file),
                ("jwt_previous_public_key_file", auth.jwt_previous_public_key_file),
            )
            if file
        ]
        #: the key set at `auth.jwks_url`, refreshed in the background (`start`); None when not configured
        self.jwks = JwksKeys(auth.jwks_url, auth.jwks_refresh_min_s, auth.jwks_cache_max_s) if auth.jwks_url else None
        #: token checks per address (`auth.rate_per_ip`, `burst_per_ip`); per connection, the `auth` commands
        #: are limited in gateway/commands.py (`auth.rate_per_connection`, `burst_per_connection`)
        self.per_address = CheckLimiter(auth.rate_per_ip, auth.burst_per_ip)
        self.audience = auth.jwt_audience or None
        self.issuer = auth.jwt_issuer or None
        self.leeway = auth.leeway_s
        #: revoked tokens (`POST /api/revocations`): refused by `verify`, wherever the token comes from
        self.revocations = RevocationTable(auth.max_revocations)
        #: a check against the JWKS key set is an `auth.verify` span (with [tracing] on)
        self.tracing = tracing
        self.tenant_claim = tenant_claim

    @property
    def enabled(self) -> bool:
        return bool(self.secrets or self.public_keys or self.jwks)

    async def start(self) -> None:
        """Load the JWKS key set, when there is one (up to gateway/auth/jwks.py FETCH_TIMEOUT_S)."""
        if self.jwks is not None:
            await self.jwks.start()

    async def stop(self) -> None:
        if self.jwks is not None:
            await self.jwks.stop()

    def admit(self, address: str | None) -> None:
        """Count one token check from `address`; TooManyTokenChecks past `auth.rate_per_ip`."""
        if address is not None and not self.per_address.take(address):
            self.per_address.refused += 1
            raise TooManyTokenChecks(
                f"too many token checks from this address (auth.rate_per_ip = {self.per_address.rate:g}/s); retry later"
            )

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
            header = jwt.get_unverified_header(token)
            if self.jwks is not None and header.get("alg") in JWKS_ALGORITHMS:
                with self.tracing.span(
                    "auth.verify", {"fanout.auth.alg": str(header.get("alg")), "fanout.auth.kid": str(header.get("kid"))[:128]}
                ):
                    claims = self._claims(token, header["alg"], self._keys_for(header))
            else:
                keys = self._keys_for(header)  # raises unless `alg` is one a key checks
                claims = self._claims(token, header["alg"], keys)
        except jwt.ExpiredSignatureError:
            raise TokenExpired("the token has expired") from None
        except jwt.PyJWTError as exc:  # InvalidTokenError, and InvalidKeyError of a key the token cannot use
            raise BadToken(f"invalid token: {exc}") from None
        except (ValueError, TypeError) as exc:  # anything else a malformed token makes a library raise
            raise BadToken(f"invalid token: {type(exc).__name__}") from None
        principal = _principal(claims, self.tenant_claim, self._verifying_kid(header))
        if self.revocations.revoked(principal) is not None:
            self.revocations.refused += 1
            raise TokenRevoked("the token was revoked")
        return principal

    def _verifying_kid(self, header: dict[str, Any]) -> str | None:
        """The `kid` of the key that checked a token with this header, when the key set chose the key by it
        (`_keys_for`); None otherwise: a secret's or a key file's token may name any kid."""
        kid = header.get("kid")
        if self.jwks is None or header.get("alg") not in JWKS_ALGORITHMS or not isinstance(kid, str):
            return None
        return kid if kid in self.jwks.keys else None

    def _keys_for(self, header: dict[str, Any]) -> list[Any]:
        """The keys that may check a token with this header, current first; each checks only the token's
        algorithm. Only `alg` and `kid` are read: `jku`, `x5u`, `x5c` (keys or URLs a token names) never."""
        algorithm = header.get("alg")
        if algorithm in HMAC_ALGORITHMS and self.secrets:
            return list(self.secrets)
        files = [key for key, checks in self.public_keys if checks == algorithm]
        if self.jwks is not None and algorithm in JWKS_ALGORITHMS:
            kid = header.get("kid")
            if not files or (isinstance(kid, str) and kid in self.jwks.keys):
                return [self.jwks.find(kid, algorithm).key]
        if files:
            return files
        raise BadToken(f"token algorithm {algorithm!r} is not accepted here")

    def _claims(self, token: str, algorithm: str, keys: list[Any]) -> dict[str, Any]:
        """The claims of a token checked by the first of `keys` whose signature matches; a key's mismatch
        moves on to the next (rotation), any other refusal (expired, audience) is final."""
        for key in keys[:-1]:
            try:
                return self._decode(token, key, algorithm)
            except jwt.InvalidSignatureError:
                continue
        return self._decode(token, keys[-1], algorithm)

    def _decode(self, token: str, key: Any, algorithm: str) -> dict[str, Any]:
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[algorithm],
            audience=self.audience,
            issuer=self.issuer,
            leeway=self.leeway,
            options={"require": ["sub", "exp"]},
        )
        return claims


def _patterns(claims: dict[str, Any], name: str) -> tuple[str, ...]:
    value = claims.get(name, [])
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value) or len(value) > MAX_PATTERNS:
        raise BadToken(f"claim {name!r} must be a list of at most {MAX_PATTERNS} topic patterns (strings)")
    return tuple(value)


def _principal(claims: dict[str, Any], tenant_claim: str = "tenant", key_id: str | None = None) -> Principal:
    user = claims["sub"]
    if not isinstance(user, str) or not 0 < len(user) <= MAX_USER_CHARS:
        raise BadToken(f"claim 'sub' must be a string of 1..{MAX_USER_CHARS} characters")
    reserved = check_user_id(user)  # anonymous client ids own queues too (gateway/auth/owners.py)
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
    tenant = claims.get(tenant_claim)
    if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_NAME):
        raise BadToken(f"claim {tenant_claim!r} must be a string of 1..{MAX_TENANT_NAME} characters")
    return Principal(
        user,
        float(exp),
        _patterns(claims, "subscribe"),
        _patterns(claims, "publish"),
        info=info,
        jti=jti,
        issued_at=float(iat) if iat is not None else None,
        tenant=tenant,
        key_id=key_id,
    )
