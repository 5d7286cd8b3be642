"""What `gateway token` and `gateway check-config` do for an operator: mint a development token with the
configured secret, and check a config the way `gateway serve` would, printing the values in force."""

from __future__ import annotations

import math
import time
from typing import Any

import jwt

from .auth import TokenVerifier
from .config import ConfigError, GatewayConfig
from .origin import parse_allowed_origins
from .server import check_listener_tokens, resolve_admin_token, tls_files

#: Keys whose values are secrets: printed as "<set>" (or "" when empty), never as themselves.
SECRET_KEYS = {("server", "admin_token"), ("auth", "jwt_secret"), ("ingest", "token"), ("rawtcp", "token")}


def mint_token(config: GatewayConfig, sub: str, *, subscribe: list[str], publish: list[str], ttl: float) -> str:
    """An HS256 token for `sub` signed with `auth.jwt_secret`, with the configured audience and issuer."""
    if not config.auth.jwt_secret:
        raise ConfigError("auth.jwt_secret is empty: set it (or GATEWAY_AUTH_JWT_SECRET) to mint tokens")
    if not sub:
        raise ConfigError("--sub must name a user")
    if ttl <= 0:
        raise ConfigError("--ttl must be positive")
    claims: dict[str, Any] = {"sub": sub, "exp": math.ceil(time.time() + ttl)}
    if subscribe:
        claims["subscribe"] = subscribe
    if publish:
        claims["publish"] = publish
    if config.auth.jwt_audience:
        claims["aud"] = config.auth.jwt_audience
    if config.auth.jwt_issuer:
        claims["iss"] = config.auth.jwt_issuer
    return jwt.encode(claims, config.auth.jwt_secret, algorithm="HS256")


def check(config: GatewayConfig) -> dict[str, Any]:
    """Run the checks `gateway serve` runs before it binds anything (ConfigError when one fails); return the
    effective values, secrets masked."""
    resolve_admin_token(config)
    tls_files(config)
    check_listener_tokens(config)
    parse_allowed_origins(config.server.allowed_origins)
    TokenVerifier(config.auth)  # reads and parses the public key file
    effective: dict[str, Any] = {}
    for section, values in config.raw.items():
        if not isinstance(values, dict):
            effective[section] = values
            continue
        effective[section] = {key: ("<set>" if value else "") if (section, key) in SECRET_KEYS else value
                              for key, value in values.items()}
    return effective
