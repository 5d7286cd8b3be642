"""What gateway/auth/jwks.py takes from a key set and a Cache-Control header: hostile or odd documents leave the
last good set in place (JwksError), never an exception of another kind; only RS256 / ES256 / EdDSA keys."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from gateway.auth.jwks import MAX_KEYS, JwksError, max_age, parse_key_set

pytestmark = pytest.mark.unit

EC_JWK = ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1()).public_key(), as_dict=True)
RSA_JWK = RSAAlgorithm.to_jwk(rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key(), as_dict=True)


def _set(*keys: dict) -> bytes:
    return json.dumps({"keys": list(keys)}).encode()


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b'{"keys": 3}',
        b'{"keys": []}',
        b'{"keys": [1, "x"]}',
        _set({"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}),
        _set({**EC_JWK, "kid": "enc", "use": "enc"}),
        _set({**EC_JWK, "kid": 7}),
        _set({**EC_JWK, "kid": "lies", "alg": "RS256"}),
        _set({**RSA_JWK, "kid": "weak", "alg": "RS512"}),
        _set({"kty": "EC", "crv": "P-256", "x": "AA", "y": "AA", "kid": "broken"}),
        _set(*({**EC_JWK, "kid": f"k{i}"} for i in range(MAX_KEYS + 1))),
    ],
)
def test_a_set_without_a_usable_key_is_refused_whole(body):
    with pytest.raises(JwksError):
        parse_key_set(body)


def test_usable_keys_are_taken_by_kid_and_the_others_skipped():
    keys = parse_key_set(
        _set(
            {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"},
            {**EC_JWK, "kid": "e"},
            {**RSA_JWK, "kid": "r", "use": "sig"},
            {**EC_JWK, "kid": "lies", "alg": "RS256"},
        )
    )
    assert {kid: key.algorithm_name for kid, key in keys.items()} == {"e": "ES256", "r": "RS256"}


@pytest.mark.parametrize(
    "header, seconds",
    [
        (None, None),
        ("", None),
        ("no-store", None),
        ("max-age=60", 60.0),
        ("public, max-age=3600, must-revalidate", 3600.0),
        ('max-age="5"', 5.0),
        ("s-maxage=10", None),
        ("max-age=x", None),
    ],
)
def test_max_age(header, seconds):
    assert max_age(header) == seconds


@pytest.mark.parametrize(
    "header",
    [
        {"typ": "JWT"},
        {"alg": None},
        {"alg": ["ES256"]},
        {"alg": {"a": 1}},
        {"alg": "ES256"},
        {"alg": "ES256", "kid": "nope"},
        {"alg": "HS256"},
    ],
)
def test_odd_headers_are_bad_tokens_with_a_key_set_configured(header):
    import base64

    from gateway.auth.tokens import TokenVerifier
    from gateway.config import load_config
    from gateway.errors import BadToken, KeysRefreshing

    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    config = load_config(overrides={"auth": {"jwks_url": "https://sso.example.com/certs"}}, environ={})
    verifier = TokenVerifier(config.auth)  # not started: no set loaded, nothing fetched
    # a well-formed ES256 header waits for the set (not loaded: try again later); the others are bad tokens
    refused = KeysRefreshing if header.get("alg") == "ES256" else BadToken
    with pytest.raises(refused):
        verifier.verify(f"{part(header)}.{part({'sub': 'u', 'exp': 2**40})}.AAAA")
