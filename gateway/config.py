"""Configuration: the embedded default TOML, a `--config` file over it, then GATEWAY_* environment variables.

The default file is the single source of defaults and of the set of keys: an override naming a key that the
default does not have is refused, and a value must have the default's type (an int is accepted for a float).
"""

from __future__ import annotations

import copy
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from core import EngineConfig, TopicConfig, TopicRule

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "default.toml"
ENV_PREFIX = "GATEWAY_"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class GatewayConfig:
    raw: dict[str, Any]

    def __getattr__(self, section: str) -> SimpleNamespace:
        try:
            return SimpleNamespace(**self.raw[section]) if section != "topics" else self.raw[section]
        except KeyError:
            raise AttributeError(section) from None

    def engine_config(self) -> EngineConfig:
        s = self.raw["scheduler"]
        return EngineConfig(
            cycle_budget_bytes=s["cycle_budget_bytes"],
            direct_queue_max=s["direct_queue_max"],
            max_message_bytes=s["max_message_bytes"],
            max_topics=s["max_topics"],
            max_subscriptions=s["max_subscriptions"],
            rules=tuple(self.topic_rules()),
        )

    def topic_rules(self) -> list[TopicRule]:
        return [TopicRule(r["pattern"], topic_config(r)) for r in self.raw["topics"]["rules"]]

    def static_path(self) -> Path:
        path = Path(self.raw["server"]["static_dir"])
        return path if path.is_absolute() else ROOT / path


_TOPIC_KEYS = {f for f in TopicConfig.__dataclass_fields__}


def topic_config(values: Mapping[str, Any]) -> TopicConfig:
    unknown = set(values) - _TOPIC_KEYS - {"pattern"}
    if unknown:
        raise ConfigError(f"unknown topic setting(s): {', '.join(sorted(unknown))}")
    try:
        return TopicConfig(**{k: v for k, v in values.items() if k != "pattern"})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad topic setting: {exc}") from None


def _merge(base: dict, override: Mapping, where: str) -> None:
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
            default = base[key]
            if isinstance(default, bool) != isinstance(value, bool) or not (
                isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))
            ):
                raise ConfigError(f"{path!r} must be {type(default).__name__}, got {value!r}")
            base[key] = float(value) if isinstance(default, float) else value


def _env_overrides(environ: Mapping[str, str], sections: dict) -> dict:
    out: dict[str, dict] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("_")
        if section not in sections or not key or section == "topics":
            raise ConfigError(f"environment variable {name} names no config key")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare string
        out.setdefault(section, {})[key] = value
    return out


def load_config(
    path: str | Path | None = None, *, overrides: Mapping | None = None, environ: Mapping[str, str] | None = None
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
    return config
