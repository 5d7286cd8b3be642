"""Configuration: the embedded default TOML, a `--config` file over it, then GATEWAY_* environment variables.

The default file is the single source of defaults and of the set of keys: an override naming a key that the
default does not have is refused, and a value must have the default's type (an int is accepted for a float).
The merged result is then converted strictly into one frozen struct per section (`ServerConfig`, ...), which
declare the types only (no defaults): `config.server.port` is an `int`, and a test keeps the structs' fields
and the default file's keys the same, section by section.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from core import EngineConfig, TopicConfig, TopicRule

from .shipped_files import default_config_path, static_root

DEFAULT_CONFIG = default_config_path()
ENV_PREFIX = "GATEWAY_"

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    pass


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A config section: its fields are exactly the keys of the section in config/default.toml."""


class ServerConfig(_Section, frozen=True, forbid_unknown_fields=True):
    host: str
    port: int
    admin_token: str
    uvloop: bool
    log_level: str
    log_format: str
    static_dir: str
    allowed_origins: list[str]
    ssl_certfile: str
    ssl_keyfile: str
    max_connections: int
    max_connections_per_ip: int
    header_timeout_s: float
    max_header_bytes: int
    max_headers: int
    allowed_hosts: list[str]
    gc_full_interval_s: float
    workers: int
    drain_timeout_s: float
    drain_spread_s: float
    drain_delay_s: float


class SchedulerConfig(_Section, frozen=True, forbid_unknown_fields=True):
    cycle_budget_bytes: int
    direct_queue_max: int
    direct_queue_max_bytes: int
    direct_total_max_bytes: int
    max_message_bytes: int
    max_topics: int
    max_subscriptions: int
    hole_tick_ms: int
    write_coalesce_cycles: int
    write_coalesce_ms: float


class WebSocketConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    write_high_water: int
    socket_send_buffer: int
    notsent_lowat_bytes: int
    blocked_timeout_s: float
    max_frame_bytes: int
    max_fragments: int
    ping_interval_s: float
    ping_timeout_s: float
    compression: str
    compression_min_bytes: int


class LongPollConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    poll_timeout_s: float
    session_ttl_s: float
    max_sessions: int
    max_body_bytes: int
    max_sessions_per_ip: int


class SseConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    heartbeat_s: float
    max_sessions_per_ip: int
    max_body_bytes: int


class IngestConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    host: str
    port: int
    max_line_bytes: int
    max_buffer_bytes: int
    max_records_per_turn: int
    max_answer_bytes: int
    token: str


class RawTcpConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    host: str
    sender_port: int
    receiver_port: int
    max_receivers: int
    capacity_bytes: int
    soft_lag_bytes: int
    hard_lag_bytes: int
    kick_grace_ms: int
    pause_watermark_pct: int
    resume_watermark_pct: int
    recv_chunk_bytes: int
    token: str
    sender_idle_timeout_s: float


class AuthConfig(_Section, frozen=True, forbid_unknown_fields=True):
    jwt_secret: str
    jwt_previous_secret: str
    jwt_public_key_file: str
    jwt_previous_public_key_file: str
    jwks_url: str
    jwks_refresh_min_s: float
    jwks_cache_max_s: float
    jwt_audience: str
    jwt_issuer: str
    leeway_s: float
    expired_grace_s: float
    rate_per_connection: float
    burst_per_connection: int
    rate_per_ip: float
    burst_per_ip: int
    revocation_ttl_s: float
    max_revocations: int


class LimitsConfig(_Section, frozen=True, forbid_unknown_fields=True):
    publish_rate: float
    publish_burst: int
    subscribe_rate: float
    subscribe_burst: int
    max_created_topics: int
    topic_create_rate: float
    topic_create_burst: int
    max_client_topics: int
    topic_ttl_s: float
    topic_history_ttl_s: float
    idle_timeout_s: float
    bad_input_log_per_s: float
    presence_max_members: int
    max_connections_per_user: int


class AdminConfig(_Section, frozen=True, forbid_unknown_fields=True):
    publish_timeout_s: float
    max_body_bytes: int
    max_publish_messages: int
    stats_interval_s: float
    stats_max_viewers: int


class DeliveryLogConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    directory: str
    sample_rate: float
    rotate_s: float
    rotate_bytes: int
    max_files: int
    flush_interval_s: float
    max_queue: int
    max_publish_stamps: int


class BrokerConfig(_Section, frozen=True, forbid_unknown_fields=True):
    url: str
    sentinel_addresses: list[str]
    sentinel_master: str
    cluster_addresses: list[str]
    prefix: str
    history_ttl_s: float
    connect_timeout_s: float
    max_topics: int
    max_pending_bytes: int

    @property
    def configured(self) -> bool:
        """Whether topics live in Redis (one of `url`, `sentinel_addresses`, `cluster_addresses`), not in this
        process."""
        return bool(self.url or self.sentinel_addresses or self.cluster_addresses)


class ProxyConfig(_Section, frozen=True, forbid_unknown_fields=True):
    connect_url: str
    connect_always: bool
    forward_headers: list[str]
    subscribe_url: str
    publish_url: str
    rpc_url: str
    refresh_url: str
    refresh_before_s: float
    disconnect_url: str
    unsubscribe_url: str
    timeout_s: float
    max_concurrent: int
    max_calls_per_connection: int
    max_pending_connects_per_ip: int
    event_queue_max: int
    event_queue_per_client: int
    event_retries: int
    event_backoff_s: float
    retry_after_s: int
    max_answer_bytes: int


class TracingConfig(_Section, frozen=True, forbid_unknown_fields=True):
    otlp_endpoint: str
    service_name: str
    sample_rate: float


class CentrifugoConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    api_prefix: str
    path: str
    ping_interval_s: float
    pong_timeout_s: float
    connect_timeout_s: float


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[fairness.tenants]]` table."""

    name: str
    weight: float = 1.0
    #: the JWT `kid`s of the keys (in `auth.jwks_url`'s key set) that sign this tenant's tokens
    key_ids: list[str] = []


class FairnessConfig(_Section, frozen=True, forbid_unknown_fields=True):
    enabled: bool
    tenant_claim: str
    default_tenant: str
    frame_cost_bytes: int
    cycle_target_ms: float
    tenants: list[TenantConfig]

    def __post_init__(self) -> None:
        names: set[str] = set()
        kids: set[str] = set()
        for tenant in self.tenants:
            if not 0 < len(tenant.name) <= MAX_TENANT_NAME:
                raise ConfigError(f"fairness.tenants: a name is 1..{MAX_TENANT_NAME} characters, not {tenant.name!r}")
            if tenant.name in names:
                raise ConfigError(f"fairness.tenants: {tenant.name!r} is listed twice")
            if not tenant.weight > 0:
                raise ConfigError(f"fairness.tenants: {tenant.name!r} has weight {tenant.weight!r}: a weight is > 0")
            taken = kids.intersection(tenant.key_ids)
            if taken:
                raise ConfigError(f"fairness.tenants: key id {sorted(taken)[0]!r} is listed for two tenants")
            names.add(tenant.name)
            kids.update(tenant.key_ids)
        if not 0 < len(self.default_tenant) <= MAX_TENANT_NAME:
            raise ConfigError(f"fairness.default_tenant is 1..{MAX_TENANT_NAME} characters")
        if self.frame_cost_bytes < 0 or not self.cycle_target_ms > 0:
            raise ConfigError("fairness.frame_cost_bytes must be >= 0 and fairness.cycle_target_ms > 0")


#: longest tenant name (a tenant claim's value too)
MAX_TENANT_NAME = 64

#: The typed sections, by name. `topics` is not among them: it stays the rules structure ({"rules": [...]}),
#: whose tables are checked by `topic_config`.
SECTIONS: dict[str, type[_Section]] = {
    "server": ServerConfig,
    "scheduler": SchedulerConfig,
    "websocket": WebSocketConfig,
    "longpoll": LongPollConfig,
    "sse": SseConfig,
    "ingest": IngestConfig,
    "rawtcp": RawTcpConfig,
    "auth": AuthConfig,
    "limits": LimitsConfig,
    "admin": AdminConfig,
    "deliverylog": DeliveryLogConfig,
    "broker": BrokerConfig,
    "proxy": ProxyConfig,
    "tracing": TracingConfig,
    "centrifugo": CentrifugoConfig,
    "fairness": FairnessConfig,
}
TOPICS = "topics"


def _section(raw: Mapping[str, Any], name: str, cls: type[_Section]) -> Any:
    try:
        return msgspec.convert(raw[name], cls, strict=True)
    except KeyError:
        raise ConfigError(f"config section [{name}] is missing") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"[{name}]: {str(exc).replace('`$', f'`{name}')}") from None


@dataclass(frozen=True)
class GatewayConfig:
    """The merged configuration: `raw` (the merged TOML as dicts) and one typed attribute per section."""

    raw: dict[str, Any]
    server: ServerConfig = field(init=False, repr=False)
    scheduler: SchedulerConfig = field(init=False, repr=False)
    websocket: WebSocketConfig = field(init=False, repr=False)
    longpoll: LongPollConfig = field(init=False, repr=False)
    sse: SseConfig = field(init=False, repr=False)
    ingest: IngestConfig = field(init=False, repr=False)
    rawtcp: RawTcpConfig = field(init=False, repr=False)
    auth: AuthConfig = field(init=False, repr=False)
    limits: LimitsConfig = field(init=False, repr=False)
    admin: AdminConfig = field(init=False, repr=False)
    deliverylog: DeliveryLogConfig = field(init=False, repr=False)
    broker: BrokerConfig = field(init=False, repr=False)
    proxy: ProxyConfig = field(init=False, repr=False)
    tracing: TracingConfig = field(init=False, repr=False)
    centrifugo: CentrifugoConfig = field(init=False, repr=False)
    fairness: FairnessConfig = field(init=False, repr=False)
    #: the topic rules as in the TOML: {"rules": [{"pattern": ..., ...}, ...]}
    topics: dict[str, list[dict[str, Any]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.raw) - set(SECTIONS) - {TOPICS}
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(sorted(unknown))}")
        for name, cls in SECTIONS.items():
            object.__setattr__(self, name, _section(self.raw, name, cls))
        object.__setattr__(self, TOPICS, self.raw.get(TOPICS, {"rules": []}))

    def engine_config(self) -> EngineConfig:
        s = self.scheduler
        return EngineConfig(
            cycle_budget_bytes=s.cycle_budget_bytes,
            direct_queue_max=s.direct_queue_max,
            direct_queue_max_bytes=s.direct_queue_max_bytes,
            direct_total_max_bytes=s.direct_total_max_bytes,
            max_message_bytes=s.max_message_bytes,
            max_topics=s.max_topics,
            max_subscriptions=s.max_subscriptions,
            rules=tuple(self.topic_rules()),
        )

    def topic_rules(self) -> list[TopicRule]:
        rules = []
        for i, r in enumerate(self.topics["rules"]):
            try:
                rules.append(TopicRule(r["pattern"], topic_config(r)))
            except ConfigError as exc:  # say which rule: a config has several
                raise ConfigError(f"topics.rules[{i}] (pattern {r['pattern']!r}): {exc}") from None
        return rules

    def static_path(self) -> Path:
        """`server.static_dir` when set (relative to the working directory), else the shipped pages."""
        return Path(self.server.static_dir) if self.server.static_dir else static_root()


_TOPIC_KEYS = {f for f in TopicConfig.__dataclass_fields__}


def topic_config(values: Mapping[str, Any]) -> TopicConfig:
    unknown = set(values) - _TOPIC_KEYS - {"pattern"}
    if unknown:
        raise ConfigError(f"unknown topic setting(s): {', '.join(sorted(unknown))}")
    try:
        return TopicConfig(**{k: v for k, v in values.items() if k != "pattern"})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad topic setting: {exc}") from None


def _merge(base: dict[str, Any], override: Mapping[str, Any], where: str) -> None:
    for key, value in override.items():
        path = f"{where}.{key}" if where else key
        if key not in base:
            raise ConfigError(f"unknown config key {path!r}")
        if path == "topics.rules":
            if not isinstance(value, list) or not all(isinstance(r, dict) and "pattern" in r for r in value):
                raise ConfigError("topics.rules must be a list of tables with a pattern")
            base[key] = value
        elif isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path!r} must be a table")
            _merge(base[key], value, path)
        else:
            base[key] = _value(path, base[key], value)


def _value(path: str, default: Any, value: Any) -> Any:
    """`value` for a key whose default is `default`: the same type (an int is accepted for a float)."""
    if isinstance(default, bool) != isinstance(value, bool) or not (
        isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))
    ):
        raise ConfigError(f"{path!r} must be {type(default).__name__}, got {value!r}")
    return float(value) if isinstance(default, float) else value


def _check_field(section: str, key: str, value: Any) -> None:
    cls = SECTIONS.get(section)
    types = {f.name: f.type for f in msgspec.structs.fields(cls)} if cls is not None else {}
    if key in types:
        try:
            msgspec.convert(value, types[key], strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{section}.{key}: {str(exc).replace('`$', f'`{section}.{key}')}") from None


def _env_section(rest: str, sections: Mapping[str, Any]) -> str | None:
    """The section a variable name (without GATEWAY_, lower case) is in: the longest `<section>_` prefix."""
    for section in sorted(sections, key=len, reverse=True):
        if rest.startswith(section + "_"):
            return section
    return None


def _env_overrides(environ: Mapping[str, str], sections: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The overrides of GATEWAY_<SECTION>_<KEY> variables.

    A variable in a known section must name one of its keys (else ConfigError); other GATEWAY_* variables
    (GATEWAY_INTERFACE of CGI, tools' own) are not the gateway's: they are ignored, with one warning.
    A string key takes the variable's text as is; any other key's text is parsed as a TOML value
    (9000, 2.5, true, ["https://a.example"]).
    """
    out: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section = _env_section(rest, sections)
        if section is None:
            ignored.append(name)
            continue
        key = rest[len(section) + 1 :]
        if section == TOPICS:
            raise ConfigError(
                f"environment variable {name}: topics.rules is a list of tables and cannot be set from the"
                " environment; put the rules in a --config file"
            )
        keys = sections[section]
        if key not in keys:
            raise ConfigError(
                f"environment variable {name} names no key of [{section}]; its keys are: {', '.join(keys)}"
                f" (GATEWAY_{section.upper()}_<KEY>)"
            )
        if isinstance(keys[key], str):
            value: Any = text
        else:
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                value = text  # not a TOML value: refused below with the expected type
        try:
            out.setdefault(section, {})[key] = _value(f"{section}.{key}", keys[key], value)
            _check_field(section, key, value)  # the items of a list too
        except ConfigError as exc:
            raise ConfigError(f"environment variable {name}={text!r}: {exc}") from None
    if ignored:
        log.warning(
            "ignoring environment variable(s) %s: not GATEWAY_<SECTION>_<KEY> of a config section (%s)",
            ", ".join(sorted(ignored)),
            ", ".join(sections),
        )
    return out


def _check_jwks(auth: AuthConfig) -> None:
    """auth.jwks_url: https (plain http only to this host: keys over a network must not be swappable) and
    its refresh bounds; auth.jwt_previous_*: only beside the current key."""
    if auth.jwt_previous_secret and not auth.jwt_secret:
        raise ConfigError("auth.jwt_previous_secret is accepted beside auth.jwt_secret: set that too")
    if auth.jwt_previous_public_key_file and not auth.jwt_public_key_file:
        raise ConfigError("auth.jwt_previous_public_key_file is accepted beside auth.jwt_public_key_file: set that too")
    if auth.jwks_refresh_min_s < 1:
        raise ConfigError(f"auth.jwks_refresh_min_s must be >= 1, not {auth.jwks_refresh_min_s}")
    if auth.jwks_cache_max_s < auth.jwks_refresh_min_s:
        raise ConfigError(
            f"auth.jwks_cache_max_s ({auth.jwks_cache_max_s}) must be >= auth.jwks_refresh_min_s ({auth.jwks_refresh_min_s})"
        )
    url = auth.jwks_url
    if not url:
        return
    parts = urlsplit(url)
    loopback = parts.hostname in ("localhost", "127.0.0.1", "::1")
    if parts.scheme not in ("https", "http") or not parts.hostname or (parts.scheme == "http" and not loopback):
        raise ConfigError(f"auth.jwks_url must be an https:// URL (http:// only to localhost), not {url!r}")


def _check_broker(broker: BrokerConfig) -> None:
    """Exactly one place for Redis: `url`, `sentinel_addresses` (with `sentinel_master`) or `cluster_addresses`,
    or none."""
    given = [key for key in ("url", "sentinel_addresses", "cluster_addresses") if getattr(broker, key)]
    if len(given) > 1:
        raise ConfigError(f"broker.{given[0]} and broker.{given[1]} are both set: set one of them (docs/cluster.md)")
    if broker.sentinel_addresses and not broker.sentinel_master:
        raise ConfigError("broker.sentinel_addresses needs broker.sentinel_master: the name the sentinels monitor")
    for key in ("sentinel_addresses", "cluster_addresses"):
        for text in getattr(broker, key):
            host, _, port = text.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f'broker.{key}: {text!r} is not "host:port"')


#: what tracing on imports (gateway/ops/tracing.py): the packages of the `tracing` extra (pyproject.toml)
TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def _tracing_installed() -> bool:
    """Whether TRACING_MODULES can be imported (found, not imported: only their parent packages are)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in TRACING_MODULES)
    except (ImportError, ValueError):  # a parent package missing (or unimportable)
        return False


def _check_tracing(tracing: TracingConfig) -> None:
    """[tracing]: an http(s) collector URL (empty: tracing off), a service name, a rate in [0, 1]; on, the
    `tracing` extra installed (checked before the start, so a gateway without it refuses in one line)."""
    url = tracing.otlp_endpoint
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"tracing.otlp_endpoint must be an http:// or https:// URL (or empty: off), not {url!r}")
        if not _tracing_installed():
            raise ConfigError(
                "tracing.otlp_endpoint is set, but OpenTelemetry (the tracing extra) is not installed: "
                "pip install 'fanout-gateway[tracing]' (in a checkout, `make setup` installs every extra)"
            )
    if not tracing.service_name.strip():
        raise ConfigError("tracing.service_name must not be empty")
    if not 0 <= tracing.sample_rate <= 1:
        raise ConfigError(f"tracing.sample_rate must be in [0, 1], not {tracing.sample_rate}")


def _check_centrifugo(centrifugo: CentrifugoConfig) -> None:
    """The Centrifugo server API's prefix: a path of its own, its methods appended as `PREFIX/publish`."""
    prefix = centrifugo.api_prefix
    if not prefix.startswith("/") or prefix.endswith("/") or any(c.isspace() or c in "?#{}" for c in prefix):
        raise ConfigError(
            f'centrifugo.api_prefix must be a path such as "/api", starting with "/" and not ending'
            f" with one, without whitespace, ?, # or braces; not {prefix!r}"
        )
    path = centrifugo.path
    if not path.startswith("/") or path == "/ws" or any(c.isspace() or c in "?#" for c in path):
        raise ConfigError(
            f'centrifugo.path must be a path such as "/connection/websocket", other than "/ws" and'
            f" without whitespace, ? or #; not {path!r}"
        )
    for key in ("ping_interval_s", "pong_timeout_s", "connect_timeout_s"):
        if getattr(centrifugo, key) <= 0:
            raise ConfigError(f"centrifugo.{key} must be > 0")


def load_config(
    path: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    with open(DEFAULT_CONFIG, "rb") as f:
        raw = tomllib.load(f)
    if path is not None:
        with open(path, "rb") as f:
            try:
                _merge(raw, tomllib.load(f), "")
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: {exc}") from None
    _merge(raw, _env_overrides(os.environ if environ is None else environ, raw), "")
    if overrides:
        _merge(raw, copy.deepcopy(dict(overrides)), "")
    config = GatewayConfig(raw)
    config.engine_config()  # validates the topic rules
    if config.server.workers < 1:
        raise ConfigError(f"server.workers must be >= 1, not {config.server.workers}")
    if config.server.log_format not in ("text", "json"):
        raise ConfigError(f'server.log_format must be "text" or "json", not {config.server.log_format!r}')
    for key in ("drain_timeout_s", "drain_spread_s", "drain_delay_s"):
        if getattr(config.server, key) < 0:
            raise ConfigError(f"server.{key} must be >= 0, not {getattr(config.server, key)}")
    if config.server.max_header_bytes < 1024 or config.server.max_headers < 1:
        raise ConfigError("server.max_header_bytes must be >= 1024 and server.max_headers >= 1")
    if config.scheduler.write_coalesce_cycles < 1:
        raise ConfigError(f"scheduler.write_coalesce_cycles must be >= 1, not {config.scheduler.write_coalesce_cycles}")
    if config.scheduler.write_coalesce_ms < 0:
        raise ConfigError(f"scheduler.write_coalesce_ms must be >= 0, not {config.scheduler.write_coalesce_ms}")
    for key, value in (
        ("limits.topic_create_rate", config.limits.topic_create_rate),
        ("limits.topic_create_burst", config.limits.topic_create_burst),
        ("limits.max_client_topics", config.limits.max_client_topics),
        ("limits.topic_history_ttl_s", config.limits.topic_history_ttl_s),
        ("limits.max_connections_per_user", config.limits.max_connections_per_user),
        ("auth.revocation_ttl_s", config.auth.revocation_ttl_s),
        ("broker.max_topics", config.broker.max_topics),
        ("broker.max_pending_bytes", config.broker.max_pending_bytes),
        ("proxy.max_pending_connects_per_ip", config.proxy.max_pending_connects_per_ip),
    ):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, not {value}")
    if config.limits.subscribe_rate <= 0 or config.limits.subscribe_burst < 1:
        raise ConfigError("limits: subscribe_rate must be > 0 and subscribe_burst >= 1")
    if config.proxy.max_calls_per_connection < 1:
        raise ConfigError(f"proxy.max_calls_per_connection must be >= 1, not {config.proxy.max_calls_per_connection}")
    if config.limits.presence_max_members < 0:
        raise ConfigError(f"limits.presence_max_members must be >= 0, not {config.limits.presence_max_members}")
    proxy = config.proxy
    if proxy.timeout_s <= 0 or proxy.max_concurrent < 1 or proxy.event_queue_max < 1 or proxy.event_retries < 0:
        raise ConfigError("proxy: timeout_s must be > 0, max_concurrent and event_queue_max >= 1, event_retries >= 0")
    if proxy.event_queue_per_client < 1 or proxy.max_answer_bytes < 1:
        raise ConfigError("proxy: event_queue_per_client and max_answer_bytes must be >= 1")
    for name in ("connect_url", "subscribe_url", "publish_url", "rpc_url", "refresh_url", "disconnect_url", "unsubscribe_url"):
        url = getattr(proxy, name)
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"proxy.{name} must be an http:// or https:// URL (or empty: hook off), not {url!r}")
    if proxy.refresh_before_s < 0 or proxy.event_backoff_s < 0 or proxy.retry_after_s < 0:
        raise ConfigError("proxy: refresh_before_s, event_backoff_s and retry_after_s must be >= 0")
    _check_jwks(config.auth)
    _check_tracing(config.tracing)
    _check_broker(config.broker)
    _check_centrifugo(config.centrifugo)
    if config.websocket.compression not in ("deflate", "off"):
        raise ConfigError(f'websocket.compression must be "deflate" or "off", not {config.websocket.compression!r}')
    if config.websocket.compression_min_bytes < 0:
        raise ConfigError("websocket.compression_min_bytes must be >= 0")
    if config.admin.max_publish_messages < 1:
        raise ConfigError(f"admin.max_publish_messages must be >= 1, not {config.admin.max_publish_messages}")
    if config.server.workers > 1 and not config.broker.configured:
        raise ConfigError(
            f"server.workers = {config.server.workers} needs a broker: each worker would be a topic space of its"
            " own; set broker.url, broker.sentinel_addresses or broker.cluster_addresses (docs/cluster.md) or keep"
            " workers = 1"
        )
    return config
