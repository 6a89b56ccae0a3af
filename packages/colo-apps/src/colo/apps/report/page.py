"""The report's HTML page: one self-contained file, the PNG inlined (base64) and a table of each run's last values."""

from __future__ import annotations

import base64
import html

from .figure import PANELS, panel_key
from .runs import RunMetrics


def _format(name: str, value: float | None) -> str:
    """A table cell: memory in MiB, the learning rate in scientific notation, others to 4 significant digits."""
    if value is None:
        return "-"
    if name == "memory":
        return f"{value / 2**20:.1f} MiB"
    if name == "lr":
        return f"{value:.2e}"
    return f"{value:.4g}"


def write_page(path: str, *, png: str, runs: dict[str, RunMetrics], panels: dict, title: str) -> None:
    """Write the HTML page ``path``: ``title``, a table (run, config name, directory, last step, each drawn panel's
    last value) and the PNG ``png`` embedded as a data URI, so the page is one file to copy or attach."""
    with open(png, "rb") as file:
        image = base64.b64encode(file.read()).decode("ascii")
    shown = [p for p in PANELS if p.name in panels]
    header = ["run", "config", "directory", "last step", *(p.title for p in shown)]
    rows = []
    for label, run in runs.items():
        last_step = max(steps[-1] for steps, _ in run.series.values())
        cells = [label, run.config_name or "-", run.run_dir, str(last_step)]
        for panel in shown:
            key = panel_key(panel, run)
            cells.append(_format(panel.name, run.last.get(key) if key else None))
        rows.append(cells)
    notes = [
        f"{label}: {run.skipped_lines} line(s) of metrics.jsonl were not JSON records with a step and were skipped"
        for label, run in runs.items()
        if run.skipped_lines
    ]
    table = "\n".join(
        ["<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
        + ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in rows]
    )
    document = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
img {{ max-width: 100%; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<table>
{table}
</table>
{"".join(f"<p>{html.escape(note)}</p>" for note in notes)}
<img src="data:image/png;base64,{image}" alt="{html.escape(title)}">
</body>
</html>
"""
    with open(path, "w", encoding="utf-8") as file:
        file.write(document)
