"""What the Grafana dashboard's queries select: the metric names in its PromQL, per panel."""

from __future__ import annotations

import re
from typing import Any

# Words in PromQL that look like metric names but are not: binary operators, modifiers
# and literals (function and aggregation names are told apart by the "(" after them).
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*(?![\w:])")


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (names may contain ':')."""
    names = {m.group(1)[1:-1] for m in _NAME_MATCHER.finditer(expr)}  # {__name__="..."}
    s = _STRING.sub('""', expr)  # label values, $variables in them
    s = _MATCHERS.sub(" ", s)  # {label="..."}
    s = _RANGES.sub(" ", s)  # [5m], [$__rate_interval], subqueries [1h:5m]
    s = _LABEL_LISTS.sub(" ", s)  # by (engine, le), on (...), group_left (...)
    for m in _IDENT.finditer(s):
        word = m.group()
        if s[m.end():].lstrip().startswith("("):  # rate(, sum(, histogram_quantile(
            continue
        if word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, with those inside collapsed rows."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queried_metrics(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Panel title -> the metric names its queries select (panels without queries left out)."""
    out: dict[str, set[str]] = {}
    for panel in all_panels(dashboard):
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        if exprs:
            out.setdefault(panel["title"], set()).update(*(promql_metrics(e) for e in exprs))
    return out
