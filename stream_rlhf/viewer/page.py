"""runs/<name>/view.html: one static page of a run's logged samples, with everything inlined.

    path = write_page(run_dir)    # `stream-rlhf view runs/<name>`

The page's markup, style and script are `page.html`, `page.css` and `page.js` beside this file;
the data (samples, skipped lines, image thumbnails and the run's plots as data URIs) goes in as
one JSON script element, so the page opens from disk, in any browser, without a network.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from PIL import Image

from stream_rlhf.telemetry.plots import PLOTS_DIR
from stream_rlhf.telemetry.sample_log import SAMPLES_FILE
from stream_rlhf.viewer.samples_file import read_samples

PAGE_FILE = "view.html"
ASSETS = Path(__file__).resolve().parent
THUMBNAIL_PX = 96
"""The longest side of an image thumbnail."""


def write_page(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / PAGE_FILE
    path.write_text(render_page(run_dir, page_data(run_dir)))
    return path


def page_data(run_dir: Path) -> dict[str, Any]:
    """What page.js reads: the run's name, its samples (with their line and thumbnails), the
    skipped lines and the plots."""
    good, skipped = read_samples(run_dir / SAMPLES_FILE)
    thumbnails: dict[str, str | None] = {}
    samples = []
    for logged in good:
        record = asdict(logged.record)
        record["line"] = logged.line
        record["thumbnails"] = [_cached(thumbnails, image) for image in logged.record.images]
        samples.append(record)
    plots = sorted((run_dir / PLOTS_DIR).glob("*.png"))
    return {
        "run": run_dir.name,
        "file": SAMPLES_FILE,
        "samples": samples,
        "skipped": [asdict(s) for s in skipped],
        "plots": [{"name": f"{PLOTS_DIR}/{p.name}", "src": _data_uri(p.read_bytes())} for p in plots],
    }


def render_page(run_dir: Path, data: dict[str, Any]) -> str:
    # `<`, `>` and `&` escaped: no string in the data can close the script element
    payload = json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    values = {"title": html.escape(f"samples of {run_dir.name}"), "style": (ASSETS / "page.css").read_text(),
              "data": payload, "script": (ASSETS / "page.js").read_text()}
    # one pass: a {{name}} inside an inserted value stays as it is
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], (ASSETS / "page.html").read_text())


def _cached(cache: dict[str, str | None], image: str) -> str | None:
    if image not in cache:
        cache[image] = _thumbnail(Path(image))
    return cache[image]


def _thumbnail(path: Path) -> str | None:
    """A small PNG of the image as a data URI; None when it cannot be read (the page shows its path)."""
    try:
        with Image.open(path) as image:
            image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
            out = io.BytesIO()
            image.convert("RGB").save(out, "PNG")
    except OSError:
        return None
    return _data_uri(out.getvalue())


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
