"""The Grafana dashboards Penstock ships, generated with ``grafana-foundation-sdk``.

``python -m deploy.dashboards`` writes ``deploy/grafana/dashboards/*.json``;
``python -m deploy.dashboards --check`` exits 1 when a committed file differs from what
this module generates. Edit this module, never the JSON.

Every query reads only families Penstock's ``/metrics`` exports (``docs/metrics.md``).
Template variables: ``$model`` (served model, multi-value with "All") on the overview
and engine views, ``$instance`` (scraped gateway) on the RL and media views; queries
match them with ``=~``. The fleet view (``--ray``) has none: its series are per replica.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT_DIR = Path(__file__).resolve().parent / "grafana" / "dashboards"
# The datasource provisioned by deploy/grafana/provisioning/datasources/prometheus.yml.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
RATE = "$__rate_interval"
MODEL = 'model=~"$model"'
INSTANCE = 'instance=~"$instance"'
TAGS = ["penstock"]

PanelBuilder = timeseries.Panel | statetimeline.Panel


def target(expr: str, legend: str, ref_id: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).range()


def with_targets(panel: PanelBuilder, queries: list[tuple[str, str]]) -> PanelBuilder:
    for position, (expr, legend) in enumerate(queries):
        panel = panel.with_target(target(expr, legend, chr(ord("A") + position)))
    return panel


def graph(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    width: int = 12,
    stacked: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .fill_opacity(10)
        .height(8)
        .span(width)
    )
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(StackingMode.NORMAL))
    return with_targets(panel, queries)


def timeline(
    title: str, description: str, expr: str, legend: str, active_text: str
) -> statetimeline.Panel:
    mapping = ValueMap(options={"1": ValueMappingResult(text=active_text, color="green")})
    panel = (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .mappings([mapping])
        .show_value("never")
        .height(6)
        .span(24)
    )
    return with_targets(panel, [(expr, legend)])


def quantiles(family: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    """p50, p90 and p99 of a histogram family, per ``by`` label when given."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({family}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def lifetime_mean(family: str, by: str) -> tuple[str, str]:
    """Mean of a histogram since the process started, per ``by``.

    For rare events (weight updates, media jobs): their labelled series appear with the
    first observation, which ``rate`` and ``increase`` never count, so a windowed mean of
    a single event would show nothing.
    """
    return (
        f"sum by ({by}) ({family}_sum{{{INSTANCE}}}) / "
        f"sum by ({by}) ({family}_count{{{INSTANCE}}})",
        f"{{{{{by}}}}}",
    )


def label_variable(name: str, label: str, query: str) -> dashboard.QueryVariable:
    every = VariableOption(selected=True, text="All", value="$__all")
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(every)
    )


def base(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .readonly()
    )


def overview() -> dashboard.Dashboard:
    frontend = "penstock_frontend"
    return (
        base(
            "penstock-overview",
            "Penstock overview",
            "Traffic, errors, latency and load of the OpenAI routes.",
        )
        .with_variable(
            label_variable("model", "Model", f"label_values({frontend}_requests_total, model)")
        )
        .with_row(dashboard.Row("Traffic"))
        .with_panel(
            graph(
                "Requests/s",
                "Finished engine requests per second, by endpoint and stream or unary.",
                "reqps",
                [
                    (
                        f"sum by (endpoint, request_type) "
                        f"(rate({frontend}_requests_total{{{MODEL}}}[{RATE}]))",
                        "{{endpoint}} {{request_type}}",
                    )
                ],
            )
        )
        .with_panel(
            graph(
                "Errors/s by type",
                "Engine requests that ended in an error, by error type; HTTP 4xx and 5xx "
                "answers by route.",
                "reqps",
                [
                    (
                        f"sum by (error_type) "
                        f'(rate({frontend}_requests_total{{{MODEL}, status="error"}}[{RATE}]))',
                        "{{error_type}}",
                    ),
                    (
                        f"sum by (handler, status) "
                        f'(rate(http_requests_total{{status=~"4xx|5xx"}}[{RATE}]))',
                        "HTTP {{status}} {{handler}}",
                    ),
                ],
            )
        )
        .with_panel(
            graph(
                "Time to first token",
                "Seconds from a request's arrival to its first token.",
                "s",
                quantiles(f"{frontend}_time_to_first_token_seconds", MODEL),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Inter-token latency",
                "Seconds between consecutive tokens of one choice.",
                "s",
                quantiles(f"{frontend}_inter_token_latency_seconds", MODEL),
                width=8,
            )
        )
        .with_panel(
            graph(
                "End-to-end latency",
                "Seconds from a request's arrival to its last token.",
                "s",
                quantiles(f"{frontend}_request_duration_seconds", MODEL),
                width=8,
            )
        )
        .with_row(dashboard.Row("Load"))
        .with_panel(
            graph(
                "Output tokens/s",
                "Completion tokens streamed per second, by model.",
                "short",
                [
                    (
                        f"sum by (model) (rate({frontend}_output_tokens_total{{{MODEL}}}[{RATE}]))",
                        "{{model}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "In flight and queued",
                "Requests being served, and those still waiting for their first token.",
                "short",
                [
                    (
                        f"sum by (model) ({frontend}_active_requests{{{MODEL}}})",
                        "in flight {{model}}",
                    ),
                    (f"sum by (model) ({frontend}_queued_requests{{{MODEL}}})", "queued {{model}}"),
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Admission sheds/s",
                "Requests refused because the concurrency cap and the queue were full "
                "(--max-concurrency, --max-queue).",
                "reqps",
                [
                    (
                        f"sum by (model) (rate({frontend}_requests_total"
                        f'{{{MODEL}, error_type="overload"}}[{RATE}]))',
                        "{{model}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Sequence lengths (mean)",
                "Mean prompt and completion tokens per request.",
                "short",
                [
                    (
                        f"sum(rate({frontend}_input_sequence_tokens_sum{{{MODEL}}}[{RATE}])) / "
                        f"sum(rate({frontend}_input_sequence_tokens_count{{{MODEL}}}[{RATE}]))",
                        "prompt",
                    ),
                    (
                        f"sum(rate({frontend}_output_sequence_tokens_sum{{{MODEL}}}[{RATE}])) / "
                        f"sum(rate({frontend}_output_sequence_tokens_count{{{MODEL}}}[{RATE}]))",
                        "completion",
                    ),
                ],
            )
        )
        .with_panel(
            graph(
                "Gateway memory",
                "Resident memory of each gateway process.",
                "bytes",
                [("process_resident_memory_bytes", "RSS {{instance}}")],
            )
        )
    )


def engine() -> dashboard.Dashboard:
    component = "penstock_component"
    selector = MODEL
    return (
        base(
            "penstock-engine",
            "Penstock engine",
            "Scheduler iterations of the engine: batch, KV cache, step time.",
        )
        .with_variable(
            label_variable(
                "model", "Model", f"label_values({component}_forward_passes_total, model)"
            )
        )
        .with_row(dashboard.Row("Batch"))
        .with_panel(
            graph(
                "Batch size per forward pass",
                "Requests scheduled in one forward pass (prefill and decode).",
                "short",
                quantiles(f"{component}_forward_pass_batch_size", selector),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Scheduled and queued requests",
                "Requests in the latest forward pass and those left waiting, by phase.",
                "short",
                [
                    (
                        f"sum by (phase) ({component}_scheduled_requests{{{selector}}})",
                        "scheduled {{phase}}",
                    ),
                    (
                        f"sum by (phase) ({component}_queued_requests{{{selector}}})",
                        "queued {{phase}}",
                    ),
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Tokens computed/s",
                "Prompt tokens prefilled and tokens decoded per second.",
                "short",
                [
                    (
                        f"sum by (phase) "
                        f"(rate({component}_scheduled_tokens_total{{{selector}}}[{RATE}]))",
                        "{{phase}}",
                    )
                ],
                width=8,
                stacked=True,
            )
        )
        .with_row(dashboard.Row("KV cache"))
        .with_panel(
            graph(
                "KV cache usage",
                "Fraction of the KV cache in use, per data-parallel rank.",
                "percentunit",
                [
                    (
                        f"max by (model, dp_rank) "
                        f"({component}_gpu_cache_usage_percent{{{selector}}})",
                        "{{model}} rank {{dp_rank}}",
                    )
                ],
            )
        )
        .with_panel(
            graph(
                "KV blocks",
                "KV cache blocks in use and in total.",
                "short",
                [
                    (f"sum({component}_kv_used_blocks{{{selector}}})", "used"),
                    (f"sum({component}_total_blocks{{{selector}}})", "total"),
                ],
            )
        )
        .with_row(dashboard.Row("Step time"))
        .with_panel(
            graph(
                "Forward pass duration",
                "Wall time of one scheduler iteration.",
                "s",
                quantiles(f"{component}_forward_pass_duration_seconds", selector),
            )
        )
        .with_panel(
            graph(
                "Forward passes/s",
                "Scheduler iterations per second (idle heartbeats not counted).",
                "short",
                [
                    (
                        f"sum by (model, dp_rank) "
                        f"(rate({component}_forward_passes_total{{{selector}}}[{RATE}]))",
                        "{{model}} rank {{dp_rank}}",
                    )
                ],
            )
        )
    )


def rl() -> dashboard.Dashboard:
    return (
        base(
            "penstock-rl",
            "Penstock RL",
            "The admin plane an RL trainer drives: state, weight versions, update and pause "
            "durations, aborted requests.",
        )
        .with_variable(
            label_variable("instance", "Gateway", "label_values(penstock_admin_state, instance)")
        )
        .with_row(dashboard.Row("State"))
        .with_panel(
            timeline(
                "Admin state",
                "The admin state of each gateway over time (serving, paused, sleeping, "
                "updating, draining).",
                f"max by (instance, state) (penstock_admin_state{{{INSTANCE}}}) == 1",
                "{{state}} {{instance}}",
                "active",
            )
        )
        .with_panel(
            timeline(
                "Weight version",
                "The weight version each gateway served over time.",
                f"max by (instance, weight_version) (penstock_weight_version_info{{{INSTANCE}}})",
                "{{weight_version}} {{instance}}",
                "served",
            )
        )
        .with_row(dashboard.Row("Durations"))
        .with_panel(
            graph(
                "Weight update duration",
                "Mean seconds per successful weight update since the gateway started, by "
                "method (a mean over time since start, so that a single update shows).",
                "s",
                [lifetime_mean("penstock_weight_update_duration_seconds", "method")],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Pause and resume duration",
                "Mean seconds per admin operation that changed the state (engine call included).",
                "s",
                [
                    (
                        f"sum by (operation) "
                        f"(increase(penstock_admin_operation_duration_seconds_sum{{{INSTANCE}}}"
                        f"[{RATE}])) / sum by (operation) "
                        f"(increase(penstock_admin_operation_duration_seconds_count{{{INSTANCE}}}"
                        f"[{RATE}]))",
                        "{{operation}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Weight version changes",
                "Times the served weight version changed.",
                "short",
                [
                    (
                        f"sum by (instance) (penstock_weight_version_changes_total{{{INSTANCE}}})",
                        "{{instance}}",
                    )
                ],
                width=8,
            )
        )
        .with_row(dashboard.Row("Requests"))
        .with_panel(
            graph(
                "Aborted requests",
                "Requests the engine ended because of an admin operation, in each interval.",
                "short",
                [
                    (
                        f"sum by (operation) "
                        f"(increase(penstock_admin_aborted_requests_total{{{INSTANCE}}}[{RATE}]))",
                        "{{operation}}",
                    )
                ],
            )
        )
        .with_panel(
            graph(
                "Output tokens/s per weight version",
                "Completion tokens generated by each weight version (the 8 most recent).",
                "short",
                [
                    (
                        f"sum by (weight_version) "
                        f"(rate(penstock_weight_version_output_tokens_total{{{INSTANCE}}}"
                        f"[{RATE}]))",
                        "{{weight_version}}",
                    )
                ],
                stacked=True,
            )
        )
    )


def media() -> dashboard.Dashboard:
    return (
        base(
            "penstock-media",
            "Penstock media",
            "Video jobs and image generations: jobs, queue, durations.",
        )
        .with_variable(
            label_variable("instance", "Gateway", "label_values(penstock_media_jobs, instance)")
        )
        .with_row(dashboard.Row("Jobs"))
        .with_panel(
            graph(
                "Video jobs by status",
                "Video jobs in the job store, by status.",
                "short",
                [
                    (
                        f"sum by (status) (penstock_media_jobs{{{INSTANCE}}})",
                        "{{status}}",
                    )
                ],
            )
        )
        .with_panel(
            graph(
                "Queue and workers",
                "Generations waiting for a media worker, and those running.",
                "short",
                [
                    (f"sum(penstock_media_queue_depth{{{INSTANCE}}})", "queued"),
                    (f"sum(penstock_media_running_generations{{{INSTANCE}}})", "running"),
                ],
            )
        )
        .with_row(dashboard.Row("Durations"))
        .with_panel(
            graph(
                "Generations finished",
                "Generations that ended since the gateway started, by kind and outcome.",
                "short",
                [
                    (
                        f"sum by (kind, status) "
                        f"(penstock_media_job_duration_seconds_count{{{INSTANCE}}})",
                        "{{kind}} {{status}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Generation duration",
                "Mean seconds from a worker starting a generation to its end, since the "
                "gateway started, by kind.",
                "s",
                [lifetime_mean("penstock_media_job_duration_seconds", "kind")],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Denoising step time",
                "Mean seconds per denoising step.",
                "s",
                [
                    (
                        f"sum by (model) "
                        f"(increase(penstock_media_denoising_step_seconds_sum{{{INSTANCE}}}"
                        f"[{RATE}])) / sum by (model) "
                        f"(increase(penstock_media_denoising_step_seconds_count{{{INSTANCE}}}"
                        f"[{RATE}]))",
                        "{{model}}",
                    )
                ],
                width=8,
            )
        )
    )


def fleet() -> dashboard.Dashboard:
    """``penstock serve --ray``: the ingress's view of each replica and each replica's
    engine families, all labelled ``replica``."""
    replica = "penstock_fleet_replica"
    component = "penstock_component"
    return (
        base(
            "penstock-fleet",
            "Penstock fleet",
            "Engine replicas behind one --ray gateway: load, tokens and steps per replica.",
        )
        .with_row(dashboard.Row("Load per replica"))
        .with_panel(
            graph(
                "Requests routed/s",
                "Requests the ingress sent to each replica.",
                "reqps",
                [(f"sum by (replica) (rate({replica}_requests_total[{RATE}]))", "{{replica}}")],
                width=8,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Running requests",
                "Requests running on each replica, as the ingress sees them.",
                "short",
                [(f"sum by (replica) ({replica}_running_requests)", "{{replica}}")],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Replicas up and requests lost",
                "Replicas answering the metrics scrape; requests failed by a replica's death.",
                "short",
                [
                    (f"sum({replica}_up)", "replicas up"),
                    (f"sum(increase({replica}_lost_requests_total[{RATE}]))", "lost"),
                ],
                width=8,
            )
        )
        .with_row(dashboard.Row("Tokens and steps per replica"))
        .with_panel(
            graph(
                "Output tokens/s",
                "Tokens each replica generated for the ingress.",
                "short",
                [
                    (
                        f"sum by (replica) (rate({replica}_output_tokens_total[{RATE}]))",
                        "{{replica}}",
                    )
                ],
                width=8,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Tokens computed/s",
                "Prompt tokens prefilled and tokens decoded per second, per replica.",
                "short",
                [
                    (
                        f"sum by (replica) (rate({component}_scheduled_tokens_total[{RATE}]))",
                        "{{replica}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Forward passes/s",
                "Scheduler iterations per second, per replica.",
                "short",
                [
                    (
                        f"sum by (replica) (rate({component}_forward_passes_total[{RATE}]))",
                        "{{replica}}",
                    )
                ],
                width=8,
            )
        )
    )


DASHBOARDS: dict[str, Callable[[], dashboard.Dashboard]] = {
    "overview.json": overview,
    "engine.json": engine,
    "rl.json": rl,
    "media.json": media,
    "fleet.json": fleet,
}


def _without_nulls(value: Any) -> Any:
    # The SDK writes unset options as null, which Grafana's own parser rejects.
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _numbered(model: dict[str, Any]) -> dict[str, Any]:
    # The SDK leaves every panel id at 0; Grafana needs them unique within a dashboard.
    for number, panel in enumerate(model["panels"], start=1):
        panel["id"] = number
    return model


def render() -> dict[str, str]:
    """File name to the JSON text the dashboards directory should hold."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    files = {}
    for name, build in DASHBOARDS.items():
        model = _numbered(_without_nulls(json.loads(encoder.encode(build().build()))))
        files[name] = json.dumps(model, indent=2, sort_keys=True) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.dashboards", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed JSON is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUTPUT_DIR / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run python -m deploy.dashboards",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
