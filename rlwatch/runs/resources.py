"""The files rlwatch ships beside its code: alert rules, runbook, dashboards, example configs.

In an installed wheel they lie under ``rlwatch/_data/`` (copied there from the repository's
``alerts/``, ``dashboards/`` and ``examples/`` when the wheel is built, see ``setup.py``), in the
repository's layout; in a source checkout (an editable install) they are read from the repository.
``rlwatch files`` prints where they are and copies them out.
"""

from __future__ import annotations

import html
import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

PACKAGED = Path(__file__).resolve().parents[1] / "_data"
SOURCE = Path(__file__).resolve().parents[2]
#: what ``copy_to`` copies, relative to :func:`root`
SHIPPED = ("alerts", "dashboards", "examples")


def _complete(base: Path) -> bool:
    return (base / "alerts" / "runbook.md").is_file() and any((base / "dashboards").glob("*.json"))


def root() -> Path:
    """The directory holding ``alerts/``, ``dashboards/`` and ``examples/``."""
    for base in (PACKAGED, SOURCE):
        if _complete(base):
            return base
    raise FileNotFoundError(f"rlwatch's data files are missing (looked in {PACKAGED} and {SOURCE}): "
                            f"reinstall rlwatch-llm (pip install -e . in a clone, or its wheel)")


def path(*parts: str) -> Path:
    """A shipped file, e.g. ``path("alerts", "runbook.md")``."""
    return root().joinpath(*parts)


def dashboards() -> list[Path]:
    """The Grafana dashboards (JSON)."""
    return sorted((root() / "dashboards").glob("*.json"))


def runbook_markdown() -> str:
    """The runbook shipped with the package (``alerts/runbook.md``); generated from the alert
    catalogue when the file is missing (the two are identical: ``make check``)."""
    try:
        return path("alerts", "runbook.md").read_text(encoding="utf-8")
    except FileNotFoundError:
        from ..alerts import render

        return render.runbook_md()


_NOT_COPIED = ("__pycache__", "*.pyc", "generate.py")


class WouldOverwrite(FileExistsError):
    """``copy_to`` found a file that differs from the shipped one (a user's edit) where it would copy."""


def copy_to(directory: str | Path, force: bool = False) -> list[Path]:
    """Copy alerts/, dashboards/ and examples/ into ``directory`` (same layout, so the relative
    paths of the compose example keep working); returns the top-level directories written. Unless
    ``force``, raises :class:`WouldOverwrite` before copying anything when a file there differs."""
    base, out = root(), Path(directory)
    names = [name for name in SHIPPED if (base / name).is_dir()]
    if not force:
        edited = [out / rel for name in names for rel in _files(base, name)
                  if (out / rel).exists() and (not (out / rel).is_file()
                                               or (out / rel).read_bytes() != (base / rel).read_bytes())]
        if edited:
            more = f" (and {len(edited) - 1} more)" if len(edited) > 1 else ""
            raise WouldOverwrite(f"{edited[0]}{more} differs from the shipped copy: not overwritten; "
                                 f"pass --force to replace it")
    for name in names:
        shutil.copytree(base / name, out / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    return [out / name for name in names]


def _files(base: Path, name: str) -> list[Path]:
    """The files ``copy_to`` copies from ``base/name``, relative to ``base``."""
    files = [p.relative_to(base) for p in sorted((base / name).rglob("*")) if p.is_file()]
    return [rel for rel in files if not any(fnmatch(part, pattern) for part in rel.parts for pattern in _NOT_COPIED)]


# --- the runbook as a web page (served by the exporter at /runbook) ----------------------------------

def _inline(text: str) -> str:
    """Escape, then `code`, **bold** and [text](#anchor) links."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"\[([^\]]+)\]\((#[\w-]+)\)", r'<a href="\2">\1</a>', out)


def markdown_to_html(markdown: str, title: str = "rlwatch runbook") -> str:
    """A small converter for the runbook's markdown (headings, paragraphs, lists, tables, fenced
    code). Each ``## Name`` heading gets ``id="name"`` in lower case, the anchor of the alerts'
    ``runbook_url``."""
    body: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!--") or not line.strip():
            i += 1
        elif line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body.append("<pre><code>" + html.escape("\n".join(lines[i + 1:j]), quote=False) + "</code></pre>")
            i = j + 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            text = line[level:].strip()
            anchor = re.sub(r"[^a-z0-9_-]", "", text.lower().replace(" ", "-"))
            body.append(f'<h{level} id="{anchor}">{_inline(text)}</h{level}>')
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(set(c) <= set("-: ") for c in cells):
                    rows.append(cells)
                i += 1
            head, *rest = rows or [[]]
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rest)
                        + "</table>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                text = lines[i][2:]
                i += 1
                while i < len(lines) and lines[i].startswith("  ") and lines[i].strip():   # the item goes on
                    text += " " + lines[i].strip()
                    i += 1
                items.append(f"<li>{_inline(text)}</li>")
            body.append("<ul>" + "".join(items) + "</ul>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "- ", "```")):
                para.append(lines[i])
                i += 1
            body.append(f"<p>{_inline(' '.join(para))}</p>")
    return html_page(title, "\n".join(body))


def html_page(title: str, body: str, head: str = "") -> str:
    """A whole HTML page around ``body`` (already HTML), in the style of the runbook; ``head`` (HTML) goes
    into its head."""
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em;line-height:1.4}"
             "pre{background:#f4f4f4;padding:.6em;overflow-x:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"{head}<style>{style}</style></head><body>\n" + body + "\n</body></html>\n")


def runbook_html() -> str:
    return markdown_to_html(runbook_markdown())
