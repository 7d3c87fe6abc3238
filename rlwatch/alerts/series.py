"""The alert windows a Watch exports, as the series Prometheus scrapes and as promtool input series.

Shared by the promtool tests ``python -m rlwatch.alerts.render`` generates and the acceptance run's
replay through promtool (``evaluation.acceptance.prometheus_agrees``)."""

from __future__ import annotations

from .catalogue import ALERT_LABELS

#: The window families each alert rule reads (see rlwatch.alerts.windows).
WINDOW_FAMILIES = ("alert_value", "alert_quiet_steps", "alert_incident")


def window_series(values: dict[str, dict[tuple, float]], run: str) -> dict[str, float]:
    """{series text: value} of the window families in ``values`` (one step's exported values, as
    ``AlertWindows.on_step`` returns them) for run ``run``; empty labels are left out, as the exporter
    leaves them out."""
    series = {}
    for family in WINDOW_FAMILIES:
        for labels, value in values[family].items():
            named = ",".join(f'{k}="{v}"' for k, v in zip(ALERT_LABELS + ("incident", "state"), labels) if v != "")
            series[f'rlwatch_{family}{{run="{run}",{named}}}'] = value
    return series


def step_series(steps: list[dict[str, float]], per_step: int) -> list[dict]:
    """promtool input series: each step's values repeated for the scrapes until the next step; a
    series the exporter stopped serving is marked stale, as a real scrape marks it."""
    names = list(dict.fromkeys(name for step in steps for name in step))
    series = []
    for name in names:
        values, seen = [], False
        for step in steps:
            if name in step:
                values += [f"{step[name]:.10g}"] * per_step
                seen = True
            elif seen and values and values[-1] != "stale":
                values += ["stale"] + ["_"] * (per_step - 1)
            else:
                values += ["_"] * per_step
        series.append({"series": name, "values": " ".join(values)})
    return series
