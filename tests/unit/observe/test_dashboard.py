"""The Grafana dashboard (dashboards/pipeline.json) imports as it is, and queries only
metrics a run exports: the `pipeline_*` names from the real collector in
`pipeline.observe.metrics`, the `vllm:*` names as the installed vLLM registers them.

`queried_metrics` (tests/helpers/dashboard.py) is shared: the integration test uses it
to check, against a real Prometheus scraping a real run, that every name has series."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tests.helpers import REPO
from tests.helpers.dashboard import all_panels, promql_metrics, queried_metrics

DASHBOARD = REPO / "dashboards" / "pipeline.json"
DS = "${DS_PROMETHEUS}"









def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load()


# --- what vLLM registers, and what a run exports ------------------------------------------


def vllm_registered() -> dict[str, str]:
    """vLLM's metric names -> type (histogram, counter, gauge), from its stat logger's source,
    read without importing vLLM (seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = (Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics" / "loggers.py").read_text()
    found = {name: kind for kind, name in
             re.findall(r'self\._(histogram|counter|gauge)_cls\(\s*name="(vllm:[^"]+)"', source)}
    assert len(found) > 10, "vLLM's stat logger has changed shape: read the names another way"
    return found


_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def vllm_base(name: str, registered: dict[str, str]) -> tuple[str, str] | None:
    """(vLLM's name, its type) for a sample name, where the suffix fits the type."""
    for base, kind in registered.items():
        for suffix in _SUFFIXES[kind]:
            if name == base + suffix:
                return base, kind
    return None


def fake_vllm_families(names: set[str], registered: dict[str, str]) -> list[dict[str, Any]]:
    """One engine's vLLM metrics as `vllm_families()` reads them from its registry: the
    ones the dashboard queries, made with prometheus-client as vLLM makes them (labels
    model_name and engine, which the driver replaces with ours)."""
    from prometheus_client import CollectorRegistry, Counter as PCounter, Gauge, Histogram

    from pipeline.generation.vllm import vllm_families

    registry = CollectorRegistry()
    kinds = {"histogram": Histogram, "counter": PCounter, "gauge": Gauge}
    for base, kind in sorted({b for n in names if (b := vllm_base(n, registered))}):
        metric = kinds[kind](base, "fake", labelnames=["model_name", "engine"], registry=registry)
        child = metric.labels(model_name="m", engine="0")
        if kind == "histogram":
            child.observe(0.25)
        elif kind == "counter":
            child.inc(2)
        else:
            child.set(0.5)
    return vllm_families(registry)


class _Totals:
    oom_retries = 1

    def busy_fraction(self) -> float:
        return 0.75


class _Feeder:
    totals = _Totals()

    def open_calls(self) -> list[tuple[str, int, int]]:
        return [("short", 12, 64), ("long", 3, 8)]


class _Policy:
    def backoffs(self, bucket: str) -> list[dict[str, Any]]:
        return [{"reason": "oom"}] if bucket == "long" else []


def exported(vllm: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Sample name -> label names, as a run in full swing and just succeeded exposes them,
    through the real collector over a real engine snapshot."""
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.observe.metrics import EngineMeter, MeterSources, RunLabels, RunMetrics

    metrics = RunMetrics(RunLabels("nightly", "run-1", "s3://bucket/out", "Qwen/Qwen2.5-0.5B-Instruct"))
    from types import SimpleNamespace

    gauges = SimpleNamespace(kv_gauges=lambda: (0.6, 0), metric_families=lambda: vllm)
    meter = EngineMeter("a1b2c3d4", "a1b2c3d4e5", "node-1", lambda incarnation, snap: None,
                        MeterSources(_Feeder(), _Policy(), gauges))
    meter.count(["ok", "ok", "failed"], ["short", "long", None], prompt_tokens=300, output_tokens=900)
    s = metrics.state
    s.rows_in, s.resumed_rows = 100, 10
    s.rows, s.prompt_tokens, s.output_tokens = Counter(meter.rows), 300, 900
    s.tokens_per_s, s.eta_s = 450.0, 12.0
    s.engines = [meter.snapshot()]
    s.restarts = Counter({"a1b2c3d4": 1})
    s.ended_at = s.last_success = s.started_at + 60
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


@pytest.fixture(scope="module")
def exposition(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    names = set().union(*queried_metrics(dashboard).values())
    registered = vllm_registered()
    return exported(fake_vllm_families({n for n in names if n.startswith("vllm:")}, registered))


# --- the file -------------------------------------------------------------------------------


def test_every_panel_has_an_id_and_a_place_of_its_own(dashboard):
    """Grafana keys panels by id and lays them out by gridPos: two with one id, or on the
    same cell, lose one of them on import."""
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels if p["type"] != "row" and not p.get("collapsed")]
    assert len(cells) == len(set(cells))


def test_importable_as_it_is(dashboard):
    assert dashboard["uid"] == "llm-corpus-pipeline"
    assert dashboard["title"] == "LLM corpus pipeline"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["id"] is None
    (ds,) = dashboard["__inputs"]
    assert (ds["name"], ds["type"], ds["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    types = {p["type"] for p in all_panels(dashboard)} - {"row"}
    assert types <= {"timeseries", "stat", "gauge", "bargauge"}
    assert {("panel", t) for t in types} <= required


def test_panels_use_the_input_datasource(dashboard):
    for panel in all_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": DS}, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": DS}, panel["title"]
            assert target["expr"].strip(), panel["title"]
        if panel["type"] != "row":
            assert panel.get("targets"), panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    for var in dashboard["templating"]["list"]:
        assert var["datasource"] == {"type": "prometheus", "uid": DS}, var["name"]


def test_titles_and_ids_unique(dashboard):
    panels = all_panels(dashboard)
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), [t for t, n in Counter(titles).items() if n > 1]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_grid_positions_fit_and_do_not_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard):
        g = panel["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), panel["title"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


# --- the queries ------------------------------------------------------------------------------


@pytest.mark.parametrize("expr, names", [
    ('sum by (engine, le) (rate(vllm:time_to_first_token_seconds_bucket{engine=~"$engine"}[$__rate_interval]))',
     {"vllm:time_to_first_token_seconds_bucket"}),
    ("histogram_quantile(0.99, sum(rate(a_bucket[5m])) by (le))", {"a_bucket"}),
    ("max(a) + sum(b_total) / on (job) group_left (model) c_info", {"a", "b_total", "c_info"}),
    ("(max(x) or vector(time())) - min(y offset 1h) * 1e3", {"x", "y"}),
    ('a > bool 0 and b unless c{d="or sum(e)"}', {"a", "b", "c"}),
    ("rate(m[1h:5m]) / {__name__=\"n\", job=\"j\"}", {"m", "n"}),
    ("increase(backoffs_total{reason=~\"oom|stall\"}[$__range])", {"backoffs_total"}),
])
def test_promql_metrics(expr, names):
    assert promql_metrics(expr) == names


def test_every_panel_queries_a_metric(dashboard):
    found = queried_metrics(dashboard)
    for panel in all_panels(dashboard):
        if panel["type"] != "row":
            assert found.get(panel["title"]), panel["title"]


def test_pipeline_metrics_are_exported(dashboard, exposition):
    for title, names in queried_metrics(dashboard).items():
        for name in names:
            assert name.startswith(("pipeline_", "vllm:")), f"{title}: {name} is neither ours nor vLLM's"
            assert name in exposition, f"{title}: {name} is not exported (have {sorted(exposition)})"


def test_vllm_metrics_are_registered_by_vllm(dashboard):
    registered = vllm_registered()
    for title, names in queried_metrics(dashboard).items():
        for name in sorted(n for n in names if n.startswith("vllm:")):
            assert vllm_base(name, registered), f"{title}: vLLM registers no {name} (of {sorted(registered)})"


def test_labels_grouped_and_shown_exist(dashboard, exposition):
    """`by (...)` and `{{label}}` in a legend name labels the queried metrics have (or `le`)."""
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            have = set().union(*(exposition.get(n, set()) for n in promql_metrics(target["expr"])))
            grouped = {lab.strip() for m in re.finditer(r"\bby\s*\(([^()]*)\)", target["expr"])
                       for lab in m.group(1).split(",") if lab.strip()}
            assert grouped <= have | {"le"}, f"{panel['title']}: {grouped - have} not on {sorted(have)}"
            shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert shown <= have, f"{panel['title']}: legend {shown - have} not on {sorted(have)}"


def test_per_engine_queries_filter_on_engine_and_node(dashboard):
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            per_engine = re.findall(r"((?:pipeline_engine_|vllm:)[\w:]*)(\{[^{}]*\})?", expr)
            for name, matchers in per_engine:
                assert 'engine=~"$engine"' in matchers and 'node=~"$node"' in matchers, \
                    f"{panel['title']}: {name} without the $engine/$node filters"


def test_template_variables(dashboard, exposition):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"engine", "node"} <= set(variables)
    for name in ("engine", "node"):
        var = variables[name]
        assert var["type"] == "query" and var["includeAll"] and var["multi"] and var["allValue"] == ".*"
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert var["definition"] == query
        m = re.fullmatch(r"label_values\(([\w:]+)(\{[^{}]*\})?,\s*(\w+)\)", query)
        assert m and m.group(3) == name, query
        assert name in exposition.get(m.group(1), set()), f"{m.group(1)} has no label {name}"


# --- the panels the issue asks for --------------------------------------------------------------


def _panels_with(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], str, set[str]]]:
    out = []
    for panel in all_panels(dashboard):
        exprs = [t["expr"] for t in panel.get("targets", [])]
        out.append((panel, "\n".join(exprs), set().union(*(promql_metrics(e) for e in exprs))))
    return out


def _right_axis(panel: dict[str, Any]) -> bool:
    return any(p.get("id") == "custom.axisPlacement" and p.get("value") == "right"
               for o in panel["fieldConfig"].get("overrides", []) for p in o["properties"])


TOPICS = {
    "progress: rows done against input rows": lambda p, e, n: {"pipeline_rows_done_total", "pipeline_input_rows"} <= n,
    "rows remaining": lambda p, e, n: "pipeline_rows_remaining" in n,
    "ETA stat": lambda p, e, n: p["type"] == "stat" and "pipeline_eta_seconds" in n,
    "output tokens/s": lambda p, e, n: p["type"] == "timeseries" and "pipeline_output_tokens_per_second" in n,
    "budget per bucket and engine against KV-cache usage on a second axis":
        lambda p, e, n: {"pipeline_engine_budget_rows", "pipeline_engine_kv_cache_usage_ratio"} <= n
        and re.search(r"by \((?=[^)]*engine)(?=[^)]*bucket)[^)]*\) \(pipeline_engine_budget_rows", e) is not None
        and _right_axis(p),
    "back-offs by reason and engine":
        lambda p, e, n: re.search(r"by \((?=[^)]*engine)(?=[^)]*reason)[^)]*\) \((rate|increase)\("
                                  r"pipeline_engine_backoffs_total", e) is not None,
    "busy fraction per engine": lambda p, e, n: "pipeline_engine_busy_ratio" in n and "engine" in e,
    "TTFT P50 and P99 by engine":
        lambda p, e, n: "vllm:time_to_first_token_seconds_bucket" in n
        and {"0.5", "0.99"} <= set(re.findall(r"histogram_quantile\(([\d.]+)", e)) and "by (engine, le)" in e,
    "end-to-end latency P50 and P99 by engine":
        lambda p, e, n: "vllm:e2e_request_latency_seconds_bucket" in n
        and {"0.5", "0.99"} <= set(re.findall(r"histogram_quantile\(([\d.]+)", e)) and "by (engine, le)" in e,
    "engine restarts": lambda p, e, n: "pipeline_engine_restarts_total" in n,
    "run info": lambda p, e, n: "pipeline_run_info" in n,
    "last success": lambda p, e, n: "pipeline_last_success_timestamp_seconds" in n,
}


@pytest.mark.parametrize("topic", list(TOPICS))
def test_required_panel(dashboard, topic):
    assert any(TOPICS[topic](p, e, n) for p, e, n in _panels_with(dashboard)), topic


def test_run_info_and_last_success_in_a_row(dashboard):
    panels = dashboard["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    for start, end in zip(rows, [*rows[1:], len(panels)]):
        inside = set().union(*(promql_metrics(t["expr"]) for p in panels[start + 1:end] for t in p.get("targets", [])))
        if {"pipeline_run_info", "pipeline_last_success_timestamp_seconds"} <= inside:
            return
    pytest.fail("no row holds both the run info and the last success")
