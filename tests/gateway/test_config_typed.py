"""Typed config sections: the structs' fields are the default file's keys, values are strictly typed, and
GATEWAY_* environment variables outside the config's sections are ignored with a warning."""

import dataclasses
import logging
import tomllib

import msgspec
import pytest

from gateway.config import (
    DEFAULT_CONFIG,
    SECTIONS,
    TOPICS,
    ConfigError,
    GatewayConfig,
    LongPollConfig,
    ServerConfig,
    TenantConfig,
    load_config,
)

pytestmark = pytest.mark.unit


def _default() -> dict:
    with open(DEFAULT_CONFIG, "rb") as f:
        return tomllib.load(f)


def test_the_section_structs_have_exactly_the_keys_of_the_default_file():
    default = _default()
    assert set(default) == set(SECTIONS) | {TOPICS}
    for name, cls in SECTIONS.items():
        assert set(cls.__struct_fields__) == set(default[name]), name
    typed = {f.name for f in dataclasses.fields(GatewayConfig) if not f.init}
    assert typed == set(SECTIONS) | {TOPICS}


#: keys whose value is a list of tables ([[section.key]]), with their type
LISTS_OF_TABLES = {("fairness", "tenants"): list[TenantConfig]}


def test_the_section_structs_declare_the_type_of_each_default_value():
    default = _default()
    for name, cls in SECTIONS.items():
        for f in msgspec.structs.fields(cls):
            value = default[name][f.name]
            assert f.default is msgspec.NODEFAULT, f"{name}.{f.name}: the defaults live in the TOML only"
            expected = list[str] if isinstance(value, list) else type(value)
            if (name, f.name) in LISTS_OF_TABLES:  # an empty list of tables by default
                expected = LISTS_OF_TABLES[name, f.name]
            assert f.type == expected, f"{name}.{f.name}: {f.type} for a default of {value!r}"


def test_attributes_are_typed_and_frozen():
    config = load_config(environ={})
    assert isinstance(config.server, ServerConfig) and isinstance(config.longpoll, LongPollConfig)
    assert type(config.server.port) is int and type(config.server.uvloop) is bool
    assert type(config.limits.publish_rate) is float and config.server.allowed_origins == []
    assert config.topics is config.raw["topics"] and config.topics["rules"][0]["pattern"] == "private.*"
    assert config.raw["server"]["port"] == config.server.port
    with pytest.raises(AttributeError):
        config.server.port = 1
    with pytest.raises(AttributeError):
        config.nosuch  # noqa: B018


def test_environment_values_are_converted_strictly():
    config = load_config(
        environ={
            "GATEWAY_LONGPOLL_POLL_TIMEOUT_S": "5",
            "GATEWAY_SERVER_MAX_CONNECTIONS_PER_IP": "3",  # keys with underscores
            "GATEWAY_SERVER_ADMIN_TOKEN": "12345",  # a string key takes the text as is
            "GATEWAY_INGEST_TOKEN": "true",
            "GATEWAY_SERVER_ALLOWED_ORIGINS": '["https://app.example.com"]',
            "GATEWAY_RAWTCP_ENABLED": "false",
        }
    )
    assert config.longpoll.poll_timeout_s == 5.0 and type(config.longpoll.poll_timeout_s) is float
    assert config.server.max_connections_per_ip == 3
    assert config.server.admin_token == "12345" and config.ingest.token == "true"
    assert config.server.allowed_origins == ["https://app.example.com"]
    assert config.rawtcp.enabled is False


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"GATEWAY_SERVER_PORT": "true"}, "'server.port' must be int, got True"),
        ({"GATEWAY_SERVER_PORT": "9000.0"}, "'server.port' must be int, got 9000.0"),
        ({"GATEWAY_RAWTCP_ENABLED": "1"}, "'rawtcp.enabled' must be bool, got 1"),
        ({"GATEWAY_LIMITS_PUBLISH_RATE": "fast"}, "'limits.publish_rate' must be float, got 'fast'"),
        ({"GATEWAY_SERVER_ALLOWED_ORIGINS": "https://a.example"}, "'server.allowed_origins' must be list"),
        ({"GATEWAY_SERVER_ALLOWED_ORIGINS": "[1]"}, "at `server.allowed_origins[0]`"),
        ({"GATEWAY_SERVER_PROT": "1"}, "GATEWAY_SERVER_PROT names no key of [server]; its keys are: host, port,"),
        ({"GATEWAY_LONGPOLL_": "1"}, "GATEWAY_LONGPOLL_ names no key of [longpoll]"),
        ({"GATEWAY_TOPICS_RULES": "[]"}, "GATEWAY_TOPICS_RULES: topics.rules is a list of tables"),
    ],
)
def test_bad_environment_values_are_refused_naming_the_variable(environ, message):
    with pytest.raises(ConfigError) as info:
        load_config(environ=environ)
    assert message in str(info.value)
    assert next(iter(environ)) in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[server]\nport = true\n", "'server.port' must be int, got True"),
        ("[server]\nallowed_origins = ['https://a.example', 2]\n", "at `server.allowed_origins[1]`"),
        ("[admin]\npublish_timeout_s = false\n", "'admin.publish_timeout_s' must be float"),
        ("[scheduler]\nwrite_coalesce_cycles = 0\n", "scheduler.write_coalesce_cycles must be >= 1, not 0"),
        ("[scheduler]\nwrite_coalesce_ms = -1.0\n", "scheduler.write_coalesce_ms must be >= 0, not -1.0"),
    ],
)
def test_bad_file_values_are_refused(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert message in str(info.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw: raw["server"].update(port=True), "Expected `int`, got `bool` - at `server.port`"),
        (lambda raw: raw["limits"].update(extra=1), "[limits]: Object contains unknown field `extra`"),
        (lambda raw: raw["auth"].pop("leeway_s"), "[auth]: Object missing required field `leeway_s`"),
        (lambda raw: raw.update(nosuch={}), "unknown config section(s): nosuch"),
        (lambda raw: raw.pop("admin"), "config section [admin] is missing"),
    ],
)
def test_the_structs_check_a_raw_config_built_without_load_config(change, message):
    raw = _default()
    change(raw)
    with pytest.raises(ConfigError) as info:
        GatewayConfig(raw)
    assert message in str(info.value)


def test_other_gateway_variables_are_ignored_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="gateway.config")
    config = load_config(
        environ={"GATEWAY_INTERFACE": "CGI/1.1", "GATEWAY_CMD": "x", "GATEWAY_SERVER_PORT": "9005", "PATH": "/bin"}
    )
    assert config.server.port == 9005
    records = [r for r in caplog.records if r.name == "gateway.config"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "GATEWAY_CMD, GATEWAY_INTERFACE" in records[0].getMessage()


def test_no_warning_when_every_gateway_variable_is_a_config_key(caplog):
    caplog.set_level(logging.WARNING, logger="gateway.config")
    load_config(environ={"GATEWAY_SERVER_PORT": "9005", "GATEWAY_AUTH_LEEWAY_S": "1"})
    assert not [r for r in caplog.records if r.name == "gateway.config"]
