"""The Helm chart of deploy/helm/fanout-gateway (issue 51), rendered without a cluster and checked.

Rendered by Helm itself: helm-python-sdk binds Helm's Go SDK (`helm template`'s engine, sprig included), so
what is checked is what `helm install` would apply. Each manifest is validated against the Kubernetes JSON
schemas of a pinned version (kubernetes-validate, strict: an unknown field fails), and the values that
docs/operations.md recommends are checked where they land: the probes, the drain and the grace period that
covers it (gateway/config.py's keys, set through GATEWAY_* variables), the Secret, the broker settings."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML, kubernetes-validate's own (no type stubs installed)
helm = pytest.importorskip("helm_python", reason="helm-python-sdk (pyproject.toml `dev`) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "fanout-gateway"
#: the Kubernetes release the manifests are validated against (the chart's kubeVersion is >= 1.30)
KUBERNETES = "1.33.0"
DEFAULTS = tomllib.loads((ROOT / "config" / "default.toml").read_text())

pytestmark = pytest.mark.unit


def render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The release's manifests by kind, each validated."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="gw", namespace="live")
    manifests: dict[str, dict[str, Any]] = {}
    for text in rendered.values():
        for manifest in yaml.safe_load_all(text):
            if manifest:
                kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
                assert manifest["kind"] not in manifests
                manifests[manifest["kind"]] = manifest
    return manifests


def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (gateway,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return gateway


def env(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container(manifests)["env"]}


def test_the_chart_is_lint_clean() -> None:
    report = helm.lint(CHART, {"secrets": {"adminToken": "t"}}, strict=True, kube_version="v" + KUBERNETES)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report


def test_the_defaults_render_the_probes_and_drain_of_docs_operations() -> None:
    manifests = render({"secrets": {"adminToken": "admin-secret"}})
    assert sorted(manifests) == ["Deployment", "PodDisruptionBudget", "Secret", "Service"]
    gateway = container(manifests)
    assert gateway["readinessProbe"] == {
        "httpGet": {"path": "/readyz", "port": "http"},
        "periodSeconds": 2,
        "failureThreshold": 1,
    }
    assert gateway["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "http"},
        "periodSeconds": 10,
        "failureThreshold": 3,
    }
    variables = env(manifests)
    delay, timeout = float(variables["GATEWAY_SERVER_DRAIN_DELAY_S"]), float(variables["GATEWAY_SERVER_DRAIN_TIMEOUT_S"])
    assert delay == 5 and timeout == DEFAULTS["server"]["drain_timeout_s"]  # docs/operations.md: 5 s for 2 s x 1
    grace = manifests["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > delay + timeout, grace
    assert "lifecycle" not in gateway  # the gateway's own delay, readiness 503 in it, instead of a preStop sleep
    assert variables["GATEWAY_SERVER_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "gw-fanout-gateway", "key": "admin-token"}}
    assert manifests["Secret"]["data"] == {"admin-token": "YWRtaW4tc2VjcmV0"}
    assert variables["GATEWAY_SERVER_HOST"] == "0.0.0.0" and variables["GATEWAY_SERVER_PORT"] == "8080"
    assert variables["GATEWAY_RAWTCP_ENABLED"] == "false" and variables["GATEWAY_INGEST_ENABLED"] == "false"
    assert not any(name.startswith("GATEWAY_BROKER_") and name != "GATEWAY_BROKER_PREFIX" for name in variables)
    assert manifests["Service"]["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    selector = manifests["Deployment"]["spec"]["selector"]["matchLabels"]
    assert manifests["Service"]["spec"]["selector"] == selector
    assert manifests["PodDisruptionBudget"]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in gateway["volumeMounts"]
    assert gateway["resources"]["requests"] == {"cpu": "500m", "memory": "256Mi"}


def test_every_env_variable_the_chart_sets_is_a_key_of_the_gateway() -> None:
    """A GATEWAY_* variable naming no key makes the gateway refuse to start: each one the chart can set is one."""
    manifests = render(
        {
            "secrets": {"existingSecret": "gw-keys"},
            "auth": {"jwksUrl": "https://idp.example/jwks", "publicKeySecret": {"name": "gw-key"}},
            "ingest": {"enabled": True},
            "broker": {"clusterAddresses": ["redis-0:6379"]},
            "server": {"allowedHosts": ["gw.example"]},
        }
    )
    for name in env(manifests):
        section, _, key = name.removeprefix("GATEWAY_").lower().partition("_")
        while section not in DEFAULTS and "_" in key:  # a section whose name holds an underscore
            head, _, key = key.partition("_")
            section = f"{section}_{head}"
        assert key in DEFAULTS.get(section, {}), name


@pytest.mark.parametrize(
    ("drain", "grace"),
    [({"delaySeconds": 2.5, "timeoutSeconds": 30}, 38), ({"preStopSleepSeconds": 3, "delaySeconds": 0, "marginSeconds": 1}, 14)],
)
def test_the_grace_period_covers_the_pre_stop_sleep_and_the_whole_drain(drain: dict[str, float], grace: int) -> None:
    manifests = render({"secrets": {"adminToken": "t"}, "drain": drain})
    spec = manifests["Deployment"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == grace
    values = yaml.safe_load((CHART / "values.yaml").read_text())["drain"] | drain
    assert grace == math.ceil(
        values["preStopSleepSeconds"] + values["delaySeconds"] + values["timeoutSeconds"] + values["marginSeconds"]
    )
    lifecycle = container(manifests).get("lifecycle")
    assert lifecycle == ({"preStop": {"sleep": {"seconds": 3}}} if drain.get("preStopSleepSeconds") else None)
    assert env(manifests)["GATEWAY_SERVER_DRAIN_DELAY_S"] == str(drain["delaySeconds"])


def test_redis_sentinel_and_the_tokens_come_from_an_existing_secret() -> None:
    manifests = render(
        {
            "secrets": {"existingSecret": "gw-keys"},
            "server": {"workers": 2},
            "broker": {"sentinelAddresses": ["sentinel-0:26379", "sentinel-1:26379"], "sentinelMaster": "mymaster"},
            "config": '[[topics.rules]]\npattern = "chat.*"\nclient_publish = true\n',
        }
    )
    assert "Secret" not in manifests  # the user's
    variables = env(manifests)
    assert variables["GATEWAY_SERVER_WORKERS"] == "2"
    assert variables["GATEWAY_BROKER_SENTINEL_ADDRESSES"] == '["sentinel-0:26379","sentinel-1:26379"]'
    assert tomllib.loads(f"v = {variables['GATEWAY_BROKER_SENTINEL_ADDRESSES']}")["v"] == ["sentinel-0:26379", "sentinel-1:26379"]
    assert variables["GATEWAY_BROKER_SENTINEL_MASTER"] == "mymaster"
    for name, key in (("GATEWAY_AUTH_JWT_SECRET", "jwt-secret"), ("GATEWAY_BROKER_URL", "broker-url")):
        assert variables[name] == {"secretKeyRef": {"name": "gw-keys", "key": key, "optional": True}}
    assert variables["GATEWAY_SERVER_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "gw-keys", "key": "admin-token"}}
    assert container(manifests)["args"] == ["--config", "/etc/fanout-gateway/gateway.toml"]
    rules = tomllib.loads(manifests["ConfigMap"]["data"]["gateway.toml"])["topics"]["rules"]
    assert rules == [{"pattern": "chat.*", "client_publish": True}]


def test_a_jwt_secret_and_a_redis_url_given_as_values_go_into_the_chart_s_secret() -> None:
    manifests = render({"secrets": {"adminToken": "a", "jwtSecret": "j", "brokerUrl": "redis://:pw@redis:6379/0"}})
    assert sorted(manifests["Secret"]["data"]) == ["admin-token", "broker-url", "jwt-secret"]
    assert env(manifests)["GATEWAY_BROKER_URL"]["secretKeyRef"]["key"] == "broker-url"


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({}, "secrets.adminToken"),
        ({"secrets": {"adminToken": "t"}, "server": {"workers": 3}}, "needs a broker"),
        ({"secrets": {"adminToken": "t"}, "broker": {"sentinelAddresses": ["s:26379"]}}, "broker.sentinelMaster"),
    ],
)
def test_a_release_the_gateway_would_refuse_is_refused_at_render(values: dict[str, Any], says: str) -> None:
    with pytest.raises(helm.HelmError, match=says):
        render(values)


def test_the_pod_spec_of_docs_operations_is_the_chart_s_output() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n### Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    documented = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])["spec"]
    rendered = render(
        {"secrets": {"adminToken": "t"}, "image": {"repository": "registry.example.com/fanout-gateway", "tag": "1.0"}}
    )["Deployment"]["spec"]["template"]["spec"]
    assert documented["terminationGracePeriodSeconds"] == rendered["terminationGracePeriodSeconds"]
    (shown,) = documented["containers"]
    assert shown == {key: container({"Deployment": {"spec": {"template": {"spec": rendered}}}})[key] for key in shown}
