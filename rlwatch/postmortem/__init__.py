"""``rlwatch postmortem``: when the run degraded, which signals moved first, the alert timeline,
the likely cause, the last healthy checkpoint; as a terminal report, markdown with plots, or JSON."""

from .analysis import Report, analyse
from .sources import RunData, load

__all__ = ["Report", "RunData", "analyse", "load", "run_postmortem"]


def run_postmortem(path: str | None = None, *, prometheus: str | None = None, run: str | None = None,
                   out_dir: str | None = None, as_json: bool = False, probe_file: str | None = None,
                   quiet: bool = False) -> dict:
    """Load, analyse and report; returns the JSON document (also what ``--json`` prints)."""
    import json
    from pathlib import Path

    from . import report as render

    data = load(path, prometheus=prometheus, run=run)
    result = analyse(data)
    if probe_file:
        from .probe import ROLLOUTS_FILE, probe

        if probe_file == "auto":              # `--probe` alone: the file the integration kept next to the run
            candidates = [Path(path) / ROLLOUTS_FILE] if path and Path(path).is_dir() else []
            candidates += [Path(path).parent / ROLLOUTS_FILE] if path and Path(path).is_file() else []
            found = [c for c in candidates if c.exists()]
            if not found:
                raise FileNotFoundError(f"--probe: no {ROLLOUTS_FILE} next to {path}; pass the rollouts file")
            probe_file = str(found[0])
        result.probe = [dict(r.__dict__) for r in probe(data.checkpoints, probe_file)]
    document = result.as_json()
    if out_dir:
        directory = Path(out_dir)
        images = render.plots(result, data, directory)
        md = render.markdown(result, images, directory)
        (directory / "postmortem.json").write_text(json.dumps(document, indent=2, default=str))
        document["report"] = {"markdown": str(md), "plots": [str(p) for p in images]}
    if as_json:
        print(json.dumps(document, indent=2, default=str))
    elif not quiet:
        render.terminal(result)
        if out_dir:
            print(f"report and plots: {document['report']['markdown']}")
    return document
