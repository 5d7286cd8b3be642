"""What `gateway token` and `gateway check-config` do for an operator: mint a development token with the
configured secret, and check a config the way `gateway serve` would, printing the values in force."""

from __future__ import annotations

import math
import secrets
import time
import tomllib
from typing import Any

import jwt

from core import TopicConfig

from ..auth.tokens import TokenVerifier
from ..config import DEFAULT_CONFIG, ConfigError, GatewayConfig
from ..edge.origin import parse_allowed_origins
from ..server import check_listener_tokens, resolve_admin_token, tls_files

#: Keys whose values are secrets: printed as "<set>" (or "" when empty), never as themselves.
SECRET_KEYS = {
    ("server", "admin_token"),
    ("auth", "jwt_secret"),
    ("auth", "jwt_previous_secret"),
    ("ingest", "token"),
    ("rawtcp", "token"),
}


def mint_token(config: GatewayConfig, sub: str, *, subscribe: list[str], publish: list[str], ttl: float) -> str:
    """An HS256 token for `sub` signed with `auth.jwt_secret`, with the configured audience and issuer.

    It carries what a revocation names (docs/integration.md, "Token revocation"): `iat`, so a token minted
    after "revoke the user" connects (one without `iat` counts as issued before any revocation), and a
    random `jti`, so this one token can be revoked alone."""
    if not config.auth.jwt_secret:
        raise ConfigError("auth.jwt_secret is empty: set it (or GATEWAY_AUTH_JWT_SECRET) to mint tokens")
    if not sub:
        raise ConfigError("--sub must name a user")
    if ttl <= 0:
        raise ConfigError("--ttl must be positive")
    now = time.time()
    # iat to the millisecond (a JWT NumericDate may be fractional): a token minted within the second after a
    # revocation is still issued after it
    claims: dict[str, Any] = {
        "sub": sub,
        "exp": math.ceil(now + ttl),
        "iat": math.floor(now * 1000) / 1000,
        "jti": secrets.token_urlsafe(16),
    }
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
        effective[section] = {
            key: ("<set>" if value else "") if (section, key) in SECRET_KEYS else value for key, value in values.items()
        }
    effective["topics"] = {"rules": rules_in_force(config)}
    return effective


# -- the topic rules in force ------------------------------------------------------------------------------

#: the settings a rule line shows always; the others only where they differ from the default
_ALWAYS_SHOWN = ("anonymous", "client_publish")
_DEFAULTS = TopicConfig().as_dict()


def rules_in_force(config: GatewayConfig) -> list[dict[str, Any]]:
    """Each rule with every setting in force, the defaults a rule leaves out included, in match order."""
    return [{"pattern": rule.pattern, **rule.config.as_dict()} for rule in config.topic_rules()]


def describe_rules(config: GatewayConfig) -> list[str]:
    """One line per rule, in match order: pattern, kind, who may subscribe and publish, other settings set."""
    lines = []
    for rule in rules_in_force(config):
        shown = [f"{key}={str(rule[key]).lower()}" for key in _ALWAYS_SHOWN]
        shown += [
            f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in rule.items()
            if key not in ("pattern", "kind", *_ALWAYS_SHOWN) and value != _DEFAULTS[key]
        ]
        lines.append(f"  {rule['pattern']:<16} {rule['kind']:<8} {' '.join(shown)}")
    return lines


def shipped_rules() -> list[dict[str, Any]]:
    """The rules of the embedded default config, as in its TOML."""
    with open(DEFAULT_CONFIG, "rb") as f:
        rules: list[dict[str, Any]] = tomllib.load(f)["topics"]["rules"]
    return rules


def rules_note(config: GatewayConfig) -> str | None:
    """One line when the config's rules are not the shipped ones (a config's `[[topics.rules]]` replaces the
    whole list, README "Configuration"), else None: `check-config` prints it, `serve` prints it at start."""
    shipped = shipped_rules()
    rules = config.topics["rules"]
    if rules == shipped:
        return None
    patterns = ", ".join(str(rule["pattern"]) for rule in rules) or "none"
    return (
        f"topics.rules: the config's {len(rules)} rule(s) replace the {len(shipped)} shipped rules (a config's"
        f" [[topics.rules]] replaces the whole list); a topic that matches none of them ({patterns}) is"
        " unknown_topic until created through the admin API"
    )
