"""``rlwatch postmortem``: when the run degraded, which signals changed first, the alert timeline,
the likely cause, where to resume, what the run could not measure, and (``--baseline``) where it
diverged from a good run; as a terminal report, markdown with plots, or JSON."""

from .analysis import Report, analyse
from .compare import Comparison, compare
from typing import Any

from .sources import PostmortemInputError, RunData, load_path

__all__ = ["Comparison", "PostmortemInputError", "Report", "RunData", "analyse", "compare", "load",
           "load_source", "run_postmortem"]


def read_signals() -> tuple[str, ...]:
    """The signals the post-mortem reads from a step: the scanned signals, the coverage families, the
    plotted ones and the diagnosis' inputs (a long run keeps only these: :mod:`.downsample`)."""
    from ..analyses.diagnosis import INPUTS
    from .analysis import COVERAGE_FAMILIES
    from .changes import LEADING_SIGNALS
    from .plots import PLOTTED

    names = [*LEADING_SIGNALS, *(n for _, family, _ in COVERAGE_FAMILIES for n in family),
             *(key for key, _ in PLOTTED if key != "quality"), *INPUTS]
    return tuple(dict.fromkeys(names))


def load(path: str | None = None, prometheus: str | None = None, run: str | None = None,
         lookback_seconds: float | None = None, run_instance: str | None = None, deadline: Any = None) -> RunData:
    """Load ``path`` (:func:`~rlwatch.postmortem.sources.load_path`), or read ``run`` from ``prometheus``
    (a URL: the last ``lookback_seconds``, the process ``run_instance`` names), within ``deadline`` (a
    :class:`~rlwatch.postmortem.prometheus.Deadline`); a run longer than
    :data:`~rlwatch.postmortem.downsample.MAX_POINTS` steps comes downsampled."""
    from .downsample import downsample_run

    if prometheus:
        from .prometheus import from_prometheus

        if not run:
            raise PostmortemInputError("--prometheus needs --run")
        data = from_prometheus(prometheus, run, run_instance=run_instance, deadline=deadline,
                               **({"lookback_seconds": lookback_seconds} if lookback_seconds else {}))
    elif run_instance is not None:
        raise PostmortemInputError("--run-instance picks a process in Prometheus; a store names its run with --run")
    else:
        data = load_path(path, run, read_signals(), deadline)
    downsample_run(data, read_signals())
    return data


def load_source(source: str | None, run: str | None = None, prometheus: str | None = None,
                **prometheus_options: object) -> RunData:
    """A run from a store / TRL / verl directory path, or from Prometheus: ``prometheus`` (a URL) with
    ``run``, or ``source`` itself an ``http(s)://`` URL of a Prometheus (then ``run`` is required)."""
    if source is not None and source.startswith(("http://", "https://")) and prometheus is None:
        prometheus, source = source, None
    return load(source, prometheus=prometheus, run=run, **prometheus_options)


def run_postmortem(path: str | None = None, *, prometheus: str | None = None, run: str | None = None,
                   out_dir: str | None = None, as_json: bool = False, probe_file: str | None = None,
                   quiet: bool = False, baseline: str | None = None, baseline_run: str | None = None,
                   since: float | None = None, run_instance: str | None = None,
                   baseline_run_instance: str | None = None, deadline: float | None = None,
                   probe_loader: str | None = None) -> dict:
    """Load, analyse and report; returns the JSON document (also what ``--json`` prints).

    ``baseline``: a good run to compare with (a store, a TRL/verl directory, or a Prometheus URL
    with ``baseline_run``). For ``prometheus`` and a Prometheus baseline: ``since``, the seconds
    searched back for the run; ``run_instance`` / ``baseline_run_instance``, which process of a run
    name that several exported. ``deadline``: seconds for reading the runs (every Prometheus request,
    the parsing of its answers, a store's rows) and the analysis (default
    :data:`~rlwatch.postmortem.prometheus.DEFAULT_DEADLINE_S`); past it, one line. ``probe_loader``:
    ``module:function`` loading checkpoints of a kind rlwatch has no loader for
    (:func:`~rlwatch.postmortem.probe.user_loader`)."""
    import json
    from pathlib import Path

    from . import report as render
    from .plots import plots
    from .prometheus import DEFAULT_DEADLINE_S, Deadline

    limit = Deadline(DEFAULT_DEADLINE_S if deadline is None else deadline)
    where = f"Prometheus at {prometheus}" if prometheus else str(path)
    data = load(path, prometheus=prometheus, run=run, lookback_seconds=since, run_instance=run_instance,
                deadline=limit)
    limit.check(where)
    good = load_source(baseline, run=baseline_run, lookback_seconds=since, run_instance=baseline_run_instance,
                       deadline=limit) if baseline else None
    limit.check(f"{where} and the baseline {baseline}" if baseline else where)
    result = analyse(data)
    if good is not None:
        result.comparison = compare(data, good)
    if probe_file:
        result.probe = _probe_rows(data, path, probe_file, probe_loader)
    limit.check(where)
    document = result.as_json()
    if out_dir:
        directory = Path(out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        images = plots(result, data, directory, baseline=good)
        md = render.markdown(result, images, directory)
        (directory / "postmortem.json").write_text(json.dumps(document, indent=2, default=str))
        document["report"] = {"markdown": str(md), "plots": [str(p) for p in images]}
    if as_json:
        print(json.dumps(document, indent=2, default=str))
    elif not quiet:
        render.terminal(result)
        if out_dir:
            print(f"report and plots: {render.safe(document['report']['markdown'])}")
    return document


def _probe_rows(data: RunData, path: str | None, probe_file: str, probe_loader: str | None) -> list[dict]:
    """``--probe``: every checkpoint scored on the rollouts file (``"auto"``: the one kept next to the run)."""
    from pathlib import Path

    from .probe import ROLLOUTS_FILE, probe, user_loader

    loaders = (user_loader(probe_loader),) if probe_loader else ()
    if probe_file == "auto":              # `--probe` alone: the file the integration kept next to the run
        candidates = [Path(path) / ROLLOUTS_FILE] if path and Path(path).is_dir() else []
        candidates += [Path(path).parent / ROLLOUTS_FILE] if path and Path(path).is_file() else []
        found = [c for c in candidates if c.exists()]
        if not found:
            raise FileNotFoundError(f"--probe: no {ROLLOUTS_FILE} next to {path}; pass the rollouts file")
        probe_file = str(found[0])
    elif not Path(probe_file).exists():
        raise FileNotFoundError(f"--probe: not found: {probe_file}")
    return [dict(r.__dict__) for r in probe(data.checkpoints, probe_file, loaders=loaders)]
