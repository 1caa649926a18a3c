"""What the deployment tests share: the files under test and the panel queries."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest

from tests.support.server import REPO_ROOT

COMPOSE_FILES = [REPO_ROOT / "docker-compose.yml", REPO_ROOT / "docker-compose.gpu.yml"]
PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
DASHBOARD_DIR = REPO_ROOT / "deploy" / "grafana" / "dashboards"
INSTALL = "apt-get install -y --no-install-recommends prometheus docker-compose"
# How each Grafana variable is read when a query is evaluated outside Grafana: the
# multi-value variables stand for "All" (their all value is ".*"), the rate window for a
# few scrapes of the test's 1 s interval.
VARIABLES = {"$__rate_interval": "10s", "$model": ".*", "$instance": ".*"}


def tool(name: str) -> str:
    """The path of a Debian-packaged tool the test needs, or a loud skip saying how."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` is not installed: run `{INSTALL}` (the README's test command does)")
    return path


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def evaluable(self) -> str:
        expr = self.expr
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{self}: a variable the test does not know"
        return expr

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def panel_queries() -> list[PanelQuery]:
    """Every query of every panel (rows' nested panels too) of every committed dashboard."""
    queries = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        model = json.loads(path.read_text())
        panels = list(model["panels"])
        while panels:
            panel = panels.pop(0)
            panels.extend(panel.get("panels", []))
            for target in panel.get("targets", []):
                queries.append(
                    PanelQuery(path.stem, panel["title"], target["refId"], target["expr"])
                )
    return queries
