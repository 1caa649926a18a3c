"""The deployment files are valid for the tools that read them, checked offline.

``docker-compose config`` (Debian's docker-compose 1.29) and the compose-spec JSON schema
read the compose files; ``promtool`` reads the Prometheus configuration and rules and
runs the alert tests; the dashboards are what the generator makes and parse as Grafana
dashboards, and every panel query is valid PromQL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import yaml
from grafana_foundation_sdk.models.dashboard import Dashboard
from sqlalchemy.engine import make_url

from deploy import dashboards
from tests.deploy.support import (
    COMPOSE_FILES,
    DASHBOARD_DIR,
    PROMETHEUS_DIR,
    panel_queries,
    tool,
)
from tests.support.server import REPO_ROOT

# The compose-spec project's JSON schema (Apache-2.0), kept here so the check runs offline.
COMPOSE_SCHEMA = Path(__file__).with_name("compose-spec.schema.json")
ENV_EXAMPLE = REPO_ROOT / ".env.example"


def compose_config(*files: Path, env_file: Path = ENV_EXAMPLE) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` reading ``env_file`` instead of a developer's own ``.env``."""
    command = [tool("docker-compose"), "--project-directory", str(REPO_ROOT)]
    command += ["--env-file", str(env_file)]
    for path in files:
        command += ["-f", str(path)]
    # Only PATH and HOME from the caller: no stray GRAFANA_* or PENSTOCK_* variables.
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [*command, "config"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=clean
    )


RAY_PROFILE = {"postgres", "ray-head", "ray-worker", "gateway-ray"}


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def test_compose_validates_with_the_env_example_and_the_gpu_override() -> None:
    result = compose_config(*COMPOSE_FILES)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {"gateway", "gateway-media", "prometheus", "grafana", *RAY_PROFILE}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert "/health" in " ".join(services["gateway"]["healthcheck"]["test"])
    devices = services["gateway"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == env_example()["GRAFANA_ADMIN_PASSWORD"]
    assert services["gateway"]["environment"]["PENSTOCK_API_KEYS"]


def test_state_lives_on_named_volumes() -> None:
    result = compose_config(COMPOSE_FILES[0])
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    mounts = {
        volume.split(":")[1]: volume.split(":")[0]
        for volume in config["services"]["gateway"]["volumes"]
    }
    for folder in ("models", "media", "jobs"):
        assert mounts[f"/var/lib/penstock/{folder}"] in config["volumes"]
    assert "devices" not in json.dumps(config["services"]["gateway"])


def test_the_ray_profile_runs_a_gateway_on_a_ray_cluster_with_jobs_in_postgresql() -> None:
    result = compose_config(COMPOSE_FILES[0])
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    for name in RAY_PROFILE:
        assert services[name]["profiles"] == ["ray"], f"{name} would start without the profile"
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    nodes = [services[name] for name in ("ray-head", "ray-worker", "gateway-ray")]
    assert len({node["image"] for node in nodes}) == 1
    for node in nodes:
        extras = set(node["build"]["args"]["PENSTOCK_EXTRAS"].split(","))
        assert extras == {"video", "postgres", "ray"}
    assert "--head" in services["ray-head"]["entrypoint"]
    assert "--address=ray-head:6379" in services["ray-worker"]["entrypoint"]
    gateway = services["gateway-ray"]
    command = " ".join(gateway["entrypoint"])
    assert "ray start --address=ray-head:6379 --num-cpus=0" in command
    assert "penstock serve" in command and "--ray --ray-address auto" in command
    db = make_url(gateway["environment"]["PENSTOCK_MEDIA_DB"])
    postgres = services["postgres"]["environment"]
    assert (db.get_backend_name(), db.host, db.username, db.database) == (
        "postgresql",
        "postgres",
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_DB"],
    )
    assert db.password == postgres["POSTGRES_PASSWORD"]
    assert "ports" not in services["postgres"]
    assert gateway["depends_on"]["postgres"] == {"condition": "service_healthy"}
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in gateway["volumes"]}
    assert mounts["/var/lib/penstock/media"] == "media"
    assert gateway["environment"]["PENSTOCK_MEDIA_STORE"].startswith("/var/lib/penstock/media/")
    assert "postgres-data" in config["volumes"]
    assert 'pip install ".[${PENSTOCK_EXTRAS}]"' in (REPO_ROOT / "Dockerfile").read_text()


def test_compose_refuses_to_start_grafana_without_an_admin_password(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text(
        "".join(f"{k}={v}\n" for k, v in env_example().items() if k != "GRAFANA_ADMIN_PASSWORD")
    )
    result = compose_config(COMPOSE_FILES[0], env_file=env_file)
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_compose_files_match_the_compose_spec_schema() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    for path in COMPOSE_FILES:
        jsonschema.Draft7Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_prometheus_config_and_rules_pass_promtool() -> None:
    promtool = tool("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "rules.yml"],
        ["test", "rules", "rules_test.yml"],
    ):
        result = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR
        )
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_committed_dashboards_are_what_the_generator_makes() -> None:
    generated = dashboards.render()
    committed = {path.name: path.read_text() for path in DASHBOARD_DIR.glob("*.json")}
    assert set(committed) == set(generated)
    for name, text in generated.items():
        assert committed[name] == text, f"{name} is stale: run python -m deploy.dashboards"


def test_dashboards_parse_as_grafana_dashboards_with_unique_panel_ids() -> None:
    uids = set()
    for path in DASHBOARD_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        model = Dashboard.from_json(raw)
        assert model.title and model.uid == raw["uid"]
        uids.add(model.uid)
        ids = [panel["id"] for panel in raw["panels"]]
        assert len(ids) == len(set(ids)), path.name
    assert len(uids) == len(dashboards.DASHBOARDS)


def test_every_panel_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule; a typo fails here with its panel."""
    queries = panel_queries()
    rules = {
        "groups": [
            {
                "name": "panels",
                "rules": [
                    {"record": f"panel:query:{n}", "expr": query.evaluable()}
                    for n, query in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_panel_reads_families_that_docs_metrics_lists() -> None:
    documented = set(re.findall(r"`([a-z_]+)`", (REPO_ROOT / "docs" / "metrics.md").read_text()))
    for query in panel_queries():
        for name in re.findall(r"\b((?:penstock|http|process)_[a-z_]+)\b", query.expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert family in documented, f"{query}: {name} is not in docs/metrics.md"
