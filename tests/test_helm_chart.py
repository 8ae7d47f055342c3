"""The Helm chart checked with real helm (lint, template) and the Kubernetes schemas.

Rendered with the default values and with a GPU + external-services values file, every
manifest is validated by kubernetes-validate --strict; every `.Values` path a template
reads must exist in values.yaml; the PrometheusRule passes promtool and the dashboards
ConfigMap carries the committed dashboards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveloop.config import load_settings
from tests.dashboards import dashboard_files
from tests.ops_tools import REPO_ROOT, ok, run, tool
from tests.test_deploy_files import assert_loads_as_settings

CHART = REPO_ROOT / "helm" / "liveloop"
GPU_VALUES = CHART / "ci" / "gpu-values.yaml"
KUBERNETES_VERSION = "1.30.0"
VALUES_PATH = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The helm binary and an environment that keeps its caches in a temp dir."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}
    yield tool("helm"), env


def render(helm: tuple[str, dict[str, str]], *values: Path) -> list[dict[str, Any]]:
    """`helm template` of the chart: the manifests, parsed."""
    binary, env = helm
    args = [a for v in values for a in ("-f", str(v))]
    out = ok(run(binary, "template", "lt", CHART, "--namespace", "ml", *args, env=env))
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("values", [[], [GPU_VALUES]], ids=["default", "gpu-external"])
def test_chart_lints_strictly(helm: tuple[str, dict[str, str]], values: list[Path]) -> None:
    binary, env = helm
    args = [a for v in values for a in ("-f", str(v))]
    out = ok(run(binary, "lint", "--strict", CHART, *args, env=env))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", [[], [GPU_VALUES]], ids=["default", "gpu-external"])
def test_rendered_manifests_pass_kubernetes_validate(
    helm: tuple[str, dict[str, str]], values: list[Path], tmp_path: Path
) -> None:
    docs = render(helm, *values)
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    validator = tool("kubernetes-validate")
    result = run(validator, "--strict", "-k", KUBERNETES_VERSION, "--quiet", path)
    assert result.returncode == 0, result.stdout + result.stderr
    # Only the operator CRDs (checked below and by promtool) lack a bundled schema.
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", result.stdout + result.stderr))
    assert unknown <= {"ServiceMonitor", "PrometheusRule", "ScaledObject"}


def test_default_values_deploy_every_part(helm: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    docs = render(helm)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name, kind in [
        ("lt-liveloop-serve", "Deployment"), ("lt-liveloop-judge", "Deployment"),
        ("lt-liveloop-collect", "Deployment"), ("lt-liveloop-train", "StatefulSet"),
        ("lt-liveloop-valkey", "StatefulSet"), ("lt-liveloop-postgresql", "StatefulSet"),
        ("lt-liveloop-checkpoints", "PersistentVolumeClaim"), ("lt-liveloop-keys", "Secret"),
        ("lt-liveloop-judge", "HorizontalPodAutoscaler"), ("lt-liveloop", "ServiceMonitor"),
        ("lt-liveloop", "PrometheusRule"), ("lt-liveloop-config", "ConfigMap"),
        ("lt-liveloop-dashboards", "ConfigMap"), ("lt-liveloop-serve", "Service"),
    ]:  # fmt: skip
        assert (kind, name) in kinds, (kind, name)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for doc in workloads:
        container = doc["spec"]["template"]["spec"]["containers"][0]
        if doc["metadata"]["name"].endswith(("valkey", "postgresql")):
            continue
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", doc["metadata"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", doc["metadata"]
    config = next(d for d in docs if d["metadata"]["name"] == "lt-liveloop-config")
    assert "[collector]" in config["data"]["liveloop.toml"]
    rendered = tmp_path / "liveloop.toml"  # what every loop reads: it must load
    rendered.write_text(config["data"]["liveloop.toml"])
    assert load_settings(rendered).max_staleness == 4
    dashboards = next(d for d in docs if d["metadata"]["name"] == "lt-liveloop-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for path in dashboard_files():
        assert json.loads(dashboards["data"][path.name]) == json.loads(path.read_text())


def test_gpu_values_run_sglang_replicas_and_a_gpu_trainer(helm: tuple[str, dict[str, str]]) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(helm, GPU_VALUES)}
    sglang = docs[("StatefulSet", "lt-liveloop-sglang")]
    assert sglang["spec"]["replicas"] == 3
    limits = sglang["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    train = docs[("StatefulSet", "lt-liveloop-train")]["spec"]["template"]["spec"]
    assert train["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert train["containers"][0]["command"][:2] == ["accelerate", "launch"]
    serve = docs[("Deployment", "lt-liveloop-serve")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in serve["containers"][0]["env"]}
    assert env["LIVELOOP_SERVER__ENGINE"] == "sglang"
    assert_loads_as_settings(env)
    assert json.loads(env["LIVELOOP_SERVER__SGLANG__URLS"]) == [
        f"http://lt-liveloop-sglang-{i}.lt-liveloop-sglang:30000" for i in range(3)
    ]
    assert env["LIVELOOP_REDIS_URL"] == "redis://redis.example.internal:6379/0"
    assert env["LIVELOOP_DB_URL"].endswith("@db.example.internal:5432/liveloop")
    assert ("StatefulSet", "lt-liveloop-valkey") not in docs
    assert ("StatefulSet", "lt-liveloop-postgresql") not in docs
    assert ("ScaledObject", "lt-liveloop-judge") in docs
    assert ("HorizontalPodAutoscaler", "lt-liveloop-judge") not in docs
    judge = docs[("Deployment", "lt-liveloop-judge")]
    assert "replicas" not in judge["spec"]  # the autoscaler owns it


def test_sglang_servers_take_the_lora_flags_when_adapters_are_served(
    helm: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    lora = tmp_path / "lora.yaml"
    lora.write_text(
        "sglang:\n  lora:\n    enabled: true\n    maxRank: 16\n    targetModules: [q_proj, v_proj]\n"
    )
    plain = {(d["kind"], d["metadata"]["name"]): d for d in render(helm, GPU_VALUES)}
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(helm, GPU_VALUES, lora)}

    def args(rendered: dict[tuple[str, str], Any]) -> list[str]:
        spec = rendered[("StatefulSet", "lt-liveloop-sglang")]["spec"]["template"]["spec"]
        return list(spec["containers"][0]["args"])

    assert "--enable-lora" not in args(plain)
    got = args(docs)
    assert "--enable-lora" in got and "--max-lora-rank=16" in got
    assert "--max-loras-per-batch=8" in got
    assert got[got.index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]


def test_prometheus_rule_is_the_rule_file_and_passes_promtool(
    helm: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    rule = next(d for d in render(helm) if d["kind"] == "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert "SUCCESS: 9 rules found" in ok(run(tool("promtool"), "check", "rules", path))
    source = yaml.safe_load((REPO_ROOT / "deploy/prometheus/rules/liveloop-alerts.yml").read_text())
    assert rule["spec"] == source


def _has_path(values: dict[str, Any], dotted: str) -> bool:
    node: Any = values
    for key in dotted.strip(".").split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_every_values_path_a_template_reads_exists_in_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    used: dict[str, set[str]] = {}
    for template in sorted((CHART / "templates").iterdir()):
        for match in VALUES_PATH.finditer(template.read_text()):
            used.setdefault(match.group(1), set()).add(template.name)
    assert len(used) > 60
    missing = {path: sorted(files) for path, files in used.items() if not _has_path(values, path)}
    assert missing == {}, f"read by templates, missing from values.yaml: {missing}"
    assert _has_path(values, "serve.port") and not _has_path(values, "serve.nope")


def test_values_schema_accepts_both_values_files_and_rejects_a_typo(
    helm: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    binary, env = helm
    bad = tmp_path / "bad.yaml"
    bad.write_text("serve:\n  replicaz: 3\n")
    result = run(binary, "template", "lt", CHART, "-f", bad, env=env)
    assert result.returncode != 0 and "replicaz" in result.stderr
    bad.write_text("serve:\n  engine: vllm\n")
    result = run(binary, "template", "lt", CHART, "-f", bad, env=env)
    assert result.returncode != 0 and "engine" in result.stderr
