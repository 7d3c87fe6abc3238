"""The exporter's page for a person, at ``/``: the run, its latest step, the headline signals' latest
values, the alerts firing in the process (a held alert says how many steps it holds before it clears),
links; it refreshes itself every :data:`REFRESH_SECONDS`.

Rendered from one :class:`~rlwatch.core.state.Snapshot` and the in-process evaluator's firing alerts; the
transport (:mod:`rlwatch.exporters.http`) only serves the bytes. Every value from the run is escaped.
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

from ..core.metrics import CATALOGUE

#: Seconds between the page's own reloads (an HTML meta refresh: no script).
REFRESH_SECONDS = 5

#: The headline signals: (gauge, label values, what a person reads, format).
HEADLINE: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("mismatch_kl_k3", (), "KL(mu‖pi_old), k3 (nats)", "{:.4g}"),
    ("mismatch_abs_log_ratio_p99", (), "|Δ log p| p99 (nats)", "{:.4g}"),
    ("is_ess_ratio", (), "importance-sampling ESS (fraction)", "{:.3f}"),
    ("is_tis_high_ratio", (), "tokens above the TIS cap", "{:.1%}"),
    ("version_lag_max", (), "max version lag (updates)", "{:.0f}"),
    ("version_lag_over_bound_ratio", (), "tokens over the staleness bound", "{:.1%}"),
    ("zero_variance_groups_ratio", ("all_pass",), "zero-variance groups, all pass", "{:.1%}"),
    ("zero_variance_groups_ratio", ("all_fail",), "zero-variance groups, all fail", "{:.1%}"),
    ("entropy_mean", (), "mean token entropy (nats)", "{:.4g}"),
    ("reward_mean", (), "reward mean", "{:.4g}"),
    ("truncated_ratio", (), "truncated episodes", "{:.1%}"),
)

#: Headline signals an alert reads pooled over a window of steps, with that alert: a row shows the
#: latest step's value, and next to an alert firing on it the alert's own window value (a step with no
#: truncated episode does not read "0.0%" alone beside an alert on the last steps' truncation).
WINDOWED_ALERTS: dict[str, str] = {
    "is_tis_high_ratio": "RLWatchISTruncationHigh",
    "version_lag_over_bound_ratio": "RLWatchStalenessBoundExceeded",
    "zero_variance_groups_ratio": "RLWatchZeroVarianceGroupsHigh",
    "truncated_ratio": "RLWatchTruncationRateHigh",
}

#: The label names of the per-alert families (alert_quiet_steps, alert_value), in their order.
_ALERT_LABELS = next(spec.labels for spec in CATALOGUE if spec.name == "alert_quiet_steps")


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _number(value: float | None, fmt: str = "{:.4g}") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return fmt.format(value)


def held_steps_left(snapshot: Any, event: Any) -> int | None:
    """For a firing alert whose hold condition no longer holds: the steps left before it clears
    (``clear_steps`` of the run's thresholds minus the quiet steps exported for it); None while its
    condition still holds, or when the snapshot has no window for it."""
    gauges = snapshot.gauges if snapshot is not None else {}
    key = _alert_key(event)
    quiet = (gauges.get("alert_quiet_steps") or {}).get(key)
    clear = (gauges.get("alert_threshold") or {}).get(("clear_steps",))
    if quiet is None or clear is None or quiet <= 0:
        return None
    return max(0, int(math.ceil(clear - quiet)))


def _alert_key(event: Any) -> tuple[str, ...]:
    return (event.name, *[str(event.labels.get(label, "")) for label in _ALERT_LABELS[1:]])


def _headline_value(snapshot: Any, firing: list | None, name: str, labels: tuple[str, ...], fmt: str) -> str:
    """The latest step's value; with an alert firing on the signal, also that alert's window value."""
    gauges = snapshot.gauges
    text = _number((gauges.get(name) or {}).get(labels), fmt)
    alert = WINDOWED_ALERTS.get(name)
    for event in firing or []:
        if event.name != alert or (labels and str(event.labels.get("kind", "")) != labels[0]):
            continue
        window = (gauges.get("alert_value") or {}).get(_alert_key(event), event.value)
        state = "holding until clear" if held_steps_left(snapshot, event) is not None else "firing"
        text += f" at the latest step; {_number(window, fmt)} over the window of {event.name} ({state})"
    return text


def _alert_item(snapshot: Any, event: Any) -> str:
    labels = ", ".join(f"{k}={v}" for k, v in sorted(event.labels.items()))
    left = held_steps_left(snapshot, event)
    head = (f'<a href="{_esc(event.runbook_url)}">{_esc(event.name)}</a> ({_esc(event.severity)})'
            f"{' ' + _esc(labels) if labels else ''}")
    now = f"{_esc(getattr(event, 'value_text', None) or 'value ' + _number(event.value))} at step {_esc(event.step)}"
    if left is None:
        state = f"firing, {now}"
    else:
        state = (f"its condition no longer holds ({now}): <strong>holding until clear, {left} "
                 f"step{'' if left == 1 else 's'} left</strong>")
    return f"<li>{head}: {state}. {_esc(event.summary)}</li>"


def index_html(snapshot: Any, firing: list | None, refresh_seconds: int = REFRESH_SECONDS) -> str:
    """The page at ``/`` for ``snapshot`` (None: nothing observed) and the firing alerts (None: alerts
    are not evaluated in this process)."""
    from ..runs.resources import html_page

    run = snapshot.run if snapshot is not None else None
    step = snapshot.step if snapshot is not None else None
    gauges = snapshot.gauges if snapshot is not None else {}
    updated = (gauges.get("last_step_timestamp_seconds") or {}).get(())
    when = ""
    if updated:
        when = (f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(updated))} "
                f"({time.time() - updated:.0f} s ago)")
    lines = ["<h1>rlwatch</h1>",
             f"<p>Run <strong>{_esc(run) if run is not None else '-'}</strong>: "
             + (f"step {_esc(step)}{_esc(when)}" if step is not None else "no step observed yet")
             + f". This page refreshes every {refresh_seconds} s.</p>"]
    rows = [(title, _headline_value(snapshot, firing, name, labels, fmt)) for name, labels, title, fmt in HEADLINE
            if (gauges.get(name) or {}).get(labels) is not None]
    lines.append("<h2>Headline signals</h2>")
    if rows:
        lines.append("<p>The latest step's values.</p>")
        lines.append('<table class="signals">' + "".join(f"<tr><th>{_esc(title)}</th><td>{_esc(value)}</td></tr>"
                                                         for title, value in rows) + "</table>")
    else:
        lines.append("<p>None yet.</p>")
    lines.append("<h2>Firing alerts</h2>")
    if firing is None:
        lines.append("<p>Not evaluated in this process (alerts off); Prometheus evaluates the shipped rules.</p>")
    elif not firing:
        lines.append("<p>None.</p>")
    else:
        ordered = sorted(firing, key=lambda e: (e.severity != "critical", e.name))
        lines.append("<ul>" + "".join(_alert_item(snapshot, event) for event in ordered) + "</ul>")
    lines.append('<p><a href="/metrics">/metrics</a> (Prometheus text or OpenMetrics) · '
                 '<a href="/runbook">/runbook</a> (what each alert means and what to do) · '
                 '<a href="/runbook.md">/runbook.md</a></p>')
    title = f"rlwatch: {run}" if run is not None else "rlwatch"
    return html_page(title, "\n".join(lines), head=f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">')
