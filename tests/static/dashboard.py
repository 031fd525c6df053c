"""The Grafana dashboard in deploy/grafana and the metric names its PromQL queries use.

Shared by tests/static/test_deploy.py (no server) and tests/integration/test_dashboard.py (a real
tritonserver). The PromQL reader is small but strict: an identifier followed by ``(`` must be a known
PromQL function or aggregation, so a misspelt function fails instead of being taken for a metric.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "fireredtts3-triton.json"

AGGREGATIONS = frozenset({
    "avg", "bottomk", "count", "count_values", "group", "limit_ratio", "limitk", "max", "min", "quantile", "stddev",
    "stdvar", "sum", "topk"
})  # fmt: skip
FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time", "ceil",
    "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "double_exponential_smoothing", "exp", "floor",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "info", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year"
})  # fmt: skip
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)"
# Grafana's own variables; anything else written $name must be defined in the dashboard's templating.
GRAFANA_VARIABLES = frozenset({"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"})

_STRING = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'|`[^`]*`")
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_IDENT = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")
_MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*("(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\')\s*')


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included; rows themselves are not panels with queries."""
    out = []
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable (label_values(...) unwrapped)."""
    out = [(f"panel {p.get('title')!r} target {t.get('refId')}", t.get("expr", "")) for p in panels(dash)
           for t in p.get("targets", [])]  # fmt: skip
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q or ""
        m = re.fullmatch(r"\s*label_values\(\s*(.*?)\s*,\s*(\w+)\s*\)\s*", q)
        if m:
            q = m.group(1)
        elif re.fullmatch(r"\s*(label_names|metrics)\(.*\)\s*", q):
            continue
        else:
            m = re.fullmatch(r"\s*query_result\((.*)\)\s*", q)
            q = m.group(1) if m else q
        out.append((f"variable {var.get('name')!r}", q))
    return out


def variables(expr: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(expr)}


def _strip(expr: str) -> str:
    """The expression without strings, label matchers, ranges/offsets in brackets and Grafana variables."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    return _VARIABLE.sub(" 1 ", s)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects. Raises ValueError on an unknown function and on
    selectors this reader does not handle (``{__name__=...}``)."""
    if "__name__" in expr:
        raise ValueError(f"__name__ selectors are not supported: {expr}")
    s = re.sub(GROUPING, " ", _strip(expr))
    names = set()
    for m in _IDENT.finditer(s):
        name, call = m.group(1), m.group(2)
        if call:
            if name not in FUNCTIONS | AGGREGATIONS:
                raise ValueError(f"unknown PromQL function {name!r} in {expr}")
        elif name not in KEYWORDS:
            names.add(name)
    return names


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric, [(label, op, value)]) for every ``metric{matchers}`` in the expression; values unquoted,
    matchers whose value is a Grafana variable keep the variable text."""
    s = _STRING.sub(lambda m: m.group(0).replace("{", "\0").replace("}", "\1"), expr)
    out = []
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}", s):
        body = m.group(2).replace("\0", "{").replace("\1", "}")
        matchers, pos = [], 0
        for part in re.finditer(_MATCHER.pattern + r"(?:,|$)", body):
            if part.start() != pos:
                raise ValueError(f"cannot read label matchers {{{body}}} in {expr}")
            matchers.append((part.group(1), part.group(2), part.group(3)[1:-1]))
            pos = part.end()
        if body[pos:].strip():
            raise ValueError(f"cannot read label matchers {{{body}}} in {expr}")
        out.append((m.group(1), matchers))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by/without/on/ignoring/group_left/group_right clauses."""
    return {label.strip() for g in re.findall(GROUPING, _strip(expr)) for label in g.split(",") if label.strip()}
