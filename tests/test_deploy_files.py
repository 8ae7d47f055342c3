"""The deployment files checked with the real tools: Grafana's schema, promtool, Compose.

No daemon and no server: the dashboards against a JSON Schema generated from Grafana's
published schema package, every panel query and alert rule through promtool (plus the
rules' unit tests), the Prometheus configuration, and docker-compose.yml with the real
Compose binary. tests/test_dashboards_live.py runs the queries against real data.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from liveloop.config import load_settings
from tests.dashboards import RULES, dashboard_files, load, panel_queries, panels
from tests.ops_tools import REPO_ROOT, ok, run, tool

DEPLOY = REPO_ROOT / "deploy"
SCHEMA = DEPLOY / "grafana" / "schema" / "dashboard.schema.json"
UIDS = {"liveloop-serving", "liveloop-pipeline", "liveloop-learning", "liveloop-weights"}


def test_dashboards_are_what_the_generator_writes() -> None:
    result = run(sys.executable, DEPLOY / "grafana" / "generate.py", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_validate_against_grafanas_schema(tmp_path: Path) -> None:
    checker = tool("check-jsonschema")
    ok(run(checker, "--schemafile", SCHEMA, *dashboard_files()))
    # The schema is strict: an unknown panel key and a wrong type are both rejected.
    bad = load(dashboard_files()[0])
    panels(bad)[0]["colour"] = "red"
    bad["refresh"] = 30
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    rejected = run(checker, "--schemafile", SCHEMA, tmp_path / "bad.json")
    assert rejected.returncode == 1
    assert "colour" in rejected.stdout and "refresh" in rejected.stdout


def test_dashboards_have_fixed_uids_and_use_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "liveloop.yml").read_text()
    )
    datasource_uid = provisioned["datasources"][0]["uid"]
    dashboards = [load(path) for path in dashboard_files()]
    assert {d["uid"] for d in dashboards} == UIDS
    for dashboard in dashboards:
        variable = dashboard["templating"]["list"][0]
        assert variable["type"] == "datasource" and variable["query"] == "prometheus"
        assert variable["current"]["value"] == datasource_uid
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), dashboard["uid"]
        for panel in panels(dashboard):
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["description"], panel["title"]
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "liveloop.yml").read_text()
    )
    compose = (REPO_ROOT / "docker-compose.yml").read_text()
    mount = f"./deploy/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro"
    assert mount in compose


def test_every_panel_query_passes_promtool(tmp_path: Path) -> None:
    queries = panel_queries()
    assert len(queries) > 60
    rules = {
        "groups": [
            {
                "name": "panels",
                "rules": [
                    {"record": f"liveloop_panel:{i}", "expr": q.promql}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    out = ok(run(tool("promtool"), "check", "rules", path))
    assert f"SUCCESS: {len(queries)} rules found" in out
    # promtool rejects what Grafana would fail on too.
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum(rate(liveloop_requests_total[5m])"}]}]}))  # fmt: skip
    assert run(tool("promtool"), "check", "rules", path).returncode == 1


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = tool("promtool")
    out = ok(run(promtool, "check", "rules", RULES))
    assert "SUCCESS: 9 rules found" in out
    tests = DEPLOY / "prometheus" / "tests" / "liveloop-alerts.test.yml"
    out = ok(run(promtool, "test", "rules", tests))
    assert "SUCCESS" in out
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for c in yaml.safe_load(tests.read_text())["tests"]
              for t in c["alert_rule_test"]}  # fmt: skip
    assert alerts == tested


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"liveloop-serve", "liveloop-judge", "liveloop-collect", "liveloop-train"} <= jobs
    shutil.copytree(DEPLOY / "prometheus" / "rules", tmp_path / "rules")
    config["rule_files"] = [str(tmp_path / "rules" / "*.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = ok(run(tool("promtool"), "check", "config", tmp_path / "prometheus.yml"))
    assert "SUCCESS: 9 rules found" in out


def _compose(*args: str | Path) -> str:
    env = {"LIVELOOP_SECRETS_DIR": "/nonexistent-secrets-dir"}
    return ok(run(tool("docker-compose"), *args, env=env))


@pytest.mark.parametrize("env_file", [None, "deploy/gpu.env"])
def test_compose_file_is_valid(env_file: str | None) -> None:
    extra = ["--env-file", env_file] if env_file else []
    _compose("-f", "docker-compose.yml", *extra, "config", "-q")
    config = json.loads(_compose("-f", "docker-compose.yml", *extra, "config", "--format", "json"))
    services = config["services"]
    loops = {"serve", "judge", "collect", "train"}
    expected = loops | {"valkey", "postgres", "prometheus", "grafana"}
    if env_file:
        expected |= {"sglang", "train-gpu"}
        assert services["serve"]["environment"]["LIVELOOP_SERVER__ENGINE"] == "sglang"
        assert services["train"]["deploy"]["replicas"] == 0
        gpu = services["train-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["capabilities"] == ["gpu"]
    assert set(services) == expected
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert service.get("init") is True, name
        for dependency in service.get("depends_on", {}).values():
            assert dependency["condition"] == "service_healthy", name
    for name in loops:
        assert set(services[name]["depends_on"]) == {"valkey", "postgres"}
    command = services["valkey"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert {s["source"] for s in services["serve"]["secrets"]} >= {"api_keys", "admin_key"}
    volumes = {v["source"] for s in ("train", "serve") for v in services[s]["volumes"]}
    assert "checkpoints" in volumes
    for name in loops | ({"train-gpu"} if env_file else set()):
        assert_loads_as_settings(services[name]["environment"])


def assert_loads_as_settings(environment: dict[str, str | None]) -> None:
    """A loop's LIVELOOP_* variables must be settings the loop accepts (the entrypoint turns
    each LIVELOOP_X_FILE into LIVELOOP_X first: a placeholder stands in for the file, and
    for a value a Secret supplies)."""
    env = {
        name.removesuffix("_FILE"): value if value and not name.endswith("_FILE") else name
        for name, value in environment.items()
        if name.startswith("LIVELOOP_") and name != "LIVELOOP_CONFIG_FILE"
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        load_settings()
