"""Subscriber identity: connection tokens are JWTs (PyJWT), verified against the `[auth]` config.

A token names a user (`sub`), when it expires (`exp`) and which topics the user may reach beyond the ones
open to anonymous clients: `subscribe` and `publish` are lists of topic patterns (fnmatch, as the topic
rules). HS256 tokens are checked with `auth.jwt_secret`, RS256 / ES256 tokens with the PEM public key in
`auth.jwt_public_key_file`; each key only ever checks its own algorithms, so a public key can never be
used as an HMAC secret (the classic algorithm-confusion attack).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jwt

from .config import AuthConfig, ConfigError
from .errors import BadToken, TokenExpired
from .owners import check_user_id

HMAC_ALGORITHMS = ("HS256",)
PUBLIC_KEY_ALGORITHMS = ("RS256", "ES256")
#: A token is a few hundred bytes; 8 KiB leaves room for long pattern lists and bounds the work per check.
MAX_TOKEN_BYTES = 8192
#: Longest user id (`sub`): it names private queues and appears in logs and the admin API.
MAX_USER_CHARS = 128
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


class TokenVerifier:
    def __init__(self, auth: AuthConfig) -> None:
        self.secret = auth.jwt_secret
        self.public_key = None
        if auth.jwt_public_key_file:
            path = Path(auth.jwt_public_key_file)
            try:
                self.public_key = path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"auth.jwt_public_key_file: cannot read {path}: {exc.strerror}") from None
        self.audience = auth.jwt_audience or None
        self.issuer = auth.jwt_issuer or None
        self.leeway = auth.leeway_s

    @property
    def enabled(self) -> bool:
        return bool(self.secret or self.public_key)

    def verify(self, token: object) -> Principal:
        """The token's principal; BadToken or TokenExpired saying why it is refused."""
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
            elif algorithm in PUBLIC_KEY_ALGORITHMS and self.public_key:
                key, algorithms = self.public_key, list(PUBLIC_KEY_ALGORITHMS)
            else:
                raise BadToken(f"token algorithm {algorithm!r} is not accepted here")
            claims = jwt.decode(
                token, key, algorithms=algorithms, audience=self.audience, issuer=self.issuer,
                leeway=self.leeway, options={"require": ["sub", "exp"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenExpired("the token has expired") from None
        except jwt.InvalidTokenError as exc:
            raise BadToken(f"invalid token: {exc}") from None
        return _principal(claims)


def _patterns(claims: dict, name: str) -> tuple[str, ...]:
    value = claims.get(name, [])
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value) or len(value) > MAX_PATTERNS:
        raise BadToken(f"claim {name!r} must be a list of at most {MAX_PATTERNS} topic patterns (strings)")
    return tuple(value)


def _principal(claims: dict) -> Principal:
    user = claims["sub"]
    if not isinstance(user, str) or not 0 < len(user) <= MAX_USER_CHARS:
        raise BadToken(f"claim 'sub' must be a string of 1..{MAX_USER_CHARS} characters")
    reserved = check_user_id(user)  # anonymous client ids own queues too (gateway/owners.py)
    if reserved is not None:
        raise BadToken(reserved)
    exp = claims["exp"]
    return Principal(user, float(exp), _patterns(claims, "subscribe"), _patterns(claims, "publish"))
