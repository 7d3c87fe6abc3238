"""The catalogue's annotation templates, filled as Prometheus fills them.

One renderer for the in-process evaluator's events and for the expected annotations of the
generated promtool tests, so an event's text is the text Prometheus' own rule would carry. It
covers what the catalogue uses: ``{{ $labels.x }}``, ``{{ $value }}`` (Go's ``%v``), and
``{{ $value | humanizePercentage }}``, ``humanizeDuration``, ``humanize`` and ``printf "%.Ng"``
with the semantics of Prometheus' template functions (prometheus/template/template.go).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Mapping

_LABEL = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")
_VALUE = re.compile(r"\{\{\s*\$value([^}]*)\}\}")
_PRINTF = re.compile(r'printf\s+\\?"([^"\\]+)\\?"')
_SMALL_PREFIXES = ("m", "u", "n", "p", "f", "a", "z", "y")
_LARGE_PREFIXES = ("k", "M", "G", "T", "P", "E", "Z", "Y")


def _special(value: float) -> str | None:
    """Go's spelling of NaN and the infinities (Python writes nan and inf)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return None


def go_g(value: float, precision: int) -> str:
    """Go's ``%.<precision>g``."""
    return _special(value) or f"{value:.{precision}g}"


def go_float(value: float) -> str:
    """Go's ``%v`` of a float64 (shortest digits; exponent form from 1e+06 and below 1e-04)."""
    value = float(value)
    if (special := _special(value)) is not None:
        return special
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    nd = len(digits)
    exp = nd + exponent - 1
    if exp < -4 or exp >= 6:
        return format(value, f".{nd - 1}e")
    return format(value, f".{max(nd - 1 - exp, 0)}f")


def humanize(value: float) -> str:
    """Prometheus' ``humanize``: 4 significant digits with an SI prefix."""
    if value == 0 or _special(value):
        return go_g(value, 4)
    prefix = ""
    if abs(value) >= 1:
        for p in _LARGE_PREFIXES:
            if abs(value) < 1000:
                break
            prefix, value = p, value / 1000
    else:
        for p in _SMALL_PREFIXES:
            if abs(value) >= 1:
                break
            prefix, value = p, value * 1000
    return f"{go_g(value, 4)}{prefix}"


def humanize_duration(seconds: float) -> str:
    """Prometheus' ``humanizeDuration``: "16m 0s", "1h 0m 5s", "2d 3h 0m 0s", "42.5s", "250ms"."""
    if _special(seconds):
        return go_g(seconds, 4)
    if seconds == 0:
        return f"{go_g(seconds, 4)}s"
    if abs(seconds) >= 1:
        sign = "-" if seconds < 0 else ""
        whole = int(abs(seconds))
        days, rest = divmod(whole, 86400)
        hours, rest = divmod(rest, 3600)
        minutes, secs = divmod(rest, 60)
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {secs}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {secs}s"
        if minutes:
            return f"{sign}{minutes}m {secs}s"
        return f"{sign}{go_g(abs(seconds), 4)}s"
    prefix = ""
    for p in _SMALL_PREFIXES:
        if abs(seconds) >= 1:
            break
        prefix, seconds = p, seconds * 1000
    return f"{go_g(seconds, 4)}{prefix}s"


def _value_text(pipeline: str, value: float | None) -> str:
    if value is None:
        return "n/a"                     # no value (in-process only: Prometheus always has one)
    value = float(value)
    if "humanizePercentage" in pipeline:
        return f"{go_g(value * 100, 4)}%"
    if "humanizeDuration" in pipeline:
        return humanize_duration(value)
    if "humanize" in pipeline:
        return humanize(value)
    match = _PRINTF.search(pipeline)
    if match:
        fmt = match.group(1)
        g = re.fullmatch(r"%\.(\d+)g", fmt)
        return go_g(value, int(g.group(1))) if g else fmt % value
    return go_float(value)


def _query(family: str, signal: str = "mismatch_kl_k3") -> str:
    """A Go template that reads the run's ``rlwatch_<family>{signal="<signal>"}`` by a query."""
    return ('{{ with query (printf "max(rlwatch_' + family + '{run=\'%s\',signal=\'' + signal + '\'})" '
            '$labels.run) }}')


#: The k3 context of the mismatch alerts' descriptions: k3 over the run baseline and the steps left to
#: kl_k3_max at the current trend (each absent when rlwatch exports none). {kind: (template, text)}.
K3_FRAGMENTS: dict[str, tuple[str, str]] = {
    "baseline_ratio": (_query("window_baseline_ratio") + ', {{ . | first | value | printf "%.0f" }}x its baseline'
                       '{{ end }}', ", {:.0f}x its baseline"),
    "forecast_steps": (_query("window_forecast_steps") + '; at this rate kl_k3_max in ~{{ . | first | value | '
                       'printf "%.0f" }} steps{{ end }}', "; at this rate kl_k3_max in ~{:.0f} steps"),
}
K3_CONTEXT = "".join(template for template, _ in K3_FRAGMENTS.values())
#: Every context fragment of the descriptions: {name: (template, text, window family, signal)}, the
#: value read from ``rlwatch_window_<family>{signal}`` (the k3 ones above, and the policy KL's forecast).
CONTEXT_FRAGMENTS: dict[str, tuple[str, str, str, str]] = {
    **{kind: (template, text, kind, "mismatch_kl_k3") for kind, (template, text) in K3_FRAGMENTS.items()},
    "policy_kl_forecast_steps": (
        _query("window_forecast_steps", "policy_kl") + '; at this rate policy_kl_max in ~{{ . | first | value | '
        'printf "%.0f" }} steps{{ end }}', "; at this rate policy_kl_max in ~{:.0f} steps", "forecast_steps",
        "policy_kl"),
}
#: The steps left to policy_kl_max at the policy KL's trend (absent when rlwatch exports none).
POLICY_KL_FORECAST = CONTEXT_FRAGMENTS["policy_kl_forecast_steps"][0]
#: The baseline part only: for an alert that fires above kl_k3_max, where a forecast to it is moot.
K3_BASELINE = K3_FRAGMENTS["baseline_ratio"][0]


def render(template: str, labels: Mapping[str, str], value: float | None,
           context: Mapping[str, float | None] | None = None) -> str:
    """Fill an annotation template ({{ $labels.x }}, {{ $value | ... }}) as Prometheus does;
    ``context`` gives the values of :data:`CONTEXT_FRAGMENTS`' queries by name (a missing one renders
    nothing)."""
    for kind, (fragment, text, _, _) in CONTEXT_FRAGMENTS.items():
        found = (context or {}).get(kind)
        template = template.replace(fragment, "" if found is None else text.format(found))
    out = _LABEL.sub(lambda m: str(labels.get(m.group(1), "")), template)
    return _VALUE.sub(lambda m: _value_text(m.group(1), value), out)
