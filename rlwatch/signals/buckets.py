"""The fixed buckets and labels the signals split by: version-lag buckets, sampler-probability bins,
zero-variance kinds, episode-duration buckets and drop reasons, and how a bound becomes a label; the
exact lag range and the log-ratio clamp.
The catalogue (:mod:`rlwatch.core.metrics`) names its label values from here."""

from __future__ import annotations

from typing import Sequence


def bucket_labels(bounds: Sequence[float], style: str = "upper") -> tuple[str, ...]:
    """The label of each bucket that ``bounds`` delimit: the one place a bound becomes a label string.

    - ``"upper"``: each upper bound as written, then ``+Inf`` ("0", "1", ..., "+Inf"): the in-process
      histogram rows and the per-lag families' ``lag`` label.
    - ``"le"``: each upper bound as Prometheus writes a bucket's ``le`` (prometheus_client's
      ``floatToGoString``: "0.0", "1.0", ..., "1e+07"), then ``+Inf``: every exporter, so the same
      bucket is the same series in Prometheus and through OpenTelemetry.
    - ``"range"``: "low-high" of each bin from 0 through the bounds to 1, one decimal ("0.0-0.1", ...).
    """
    if style == "range":
        edges = (0.0, *bounds, 1.0)
        return tuple(f"{lo:.1f}-{hi:.1f}" for lo, hi in zip(edges, edges[1:]))
    if style == "upper":
        return tuple(str(b) for b in bounds) + ("+Inf",)
    labels = []
    for b in bounds:
        s = repr(float(b))
        dot = s.find(".")
        if b > 0 and dot > 6:           # Go writes an exponent from 1e+07 on (Python from 1e+16)
            s = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.") + f"e+{dot - 1:02d}"
        labels.append(s)
    return tuple(labels) + ("+Inf",)


#: Upper bounds (inclusive) of the version-lag histogram buckets, in policy updates; +Inf follows.
LAG_BUCKETS: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: The label of each lag bucket (the histogram's in-process rows and the per-lag families' ``lag``).
LAG_BUCKET_LABELS: tuple[str, ...] = bucket_labels(LAG_BUCKETS)
#: The exported ``le`` of each lag bucket (Prometheus and OpenTelemetry).
LAG_LE_LABELS: tuple[str, ...] = bucket_labels(LAG_BUCKETS, "le")

#: Sampler-probability bins for the per-bin mismatch: [0, 0.1), [0.1, 0.5), [0.5, 0.9), [0.9, 1].
PROB_BIN_EDGES: tuple[float, ...] = (0.1, 0.5, 0.9)
PROB_BIN_LABELS: tuple[str, ...] = bucket_labels(PROB_BIN_EDGES, "range")

ZERO_VARIANCE_KINDS: tuple[str, ...] = ("all_pass", "all_fail", "constant")

#: Upper bounds (inclusive) of the episode-duration histogram buckets, in seconds; +Inf follows.
DURATION_BUCKETS: tuple[int, ...] = (1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600, 1200, 1800, 3600)
DURATION_BUCKET_LABELS: tuple[str, ...] = bucket_labels(DURATION_BUCKETS)
DURATION_LE_LABELS: tuple[str, ...] = bucket_labels(DURATION_BUCKETS, "le")
#: Per-episode durations a step keeps in the run store (``episode_duration_sample_seconds``), per outcome.
DURATION_SAMPLE_MAX = 512
#: Why a launched episode was not trained (``episodes_dropped_total{reason}``); any other reason is ``other``.
DROP_REASONS: tuple[str, ...] = ("filtered", "timeout", "failure", "stale", "other")

# Lag percentiles and the lag mean are exact up to this many updates; larger lags count as this
# many (the maximum stays exact).
LAG_EXACT_MAX = 4095
LAG_BINS = LAG_EXACT_MAX + 1            # the lag histogram's bins: lags 0 .. LAG_EXACT_MAX

SAFETY_BOUND = 20.0  # |r| clamp before exp, as verl's rollout_corr_helper.SAFETY_BOUND
