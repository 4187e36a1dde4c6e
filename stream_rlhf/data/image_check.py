"""Every distinct image file of a dataset decoded once when the dataset is built, so that a bad
image (a PNG signature over a garbage body, a truncated file, an unsupported size) is found before
the run, not only if and when its line is sampled.

    bad = bad_images(paths, spec, cache_dir=Path("runs/.cache"))   # {path: ImageError}

A decode's outcome (the image's size, or why it does not decode) depends only on the file's
bytes, so it is kept in `cache_dir/image_check.json` by the SHA-256 of the content: a large
dataset is decoded once, and later builds (the warm start, the evaluation, the prompt source, the
next run) only hash the files. The size is then checked against the vision tower's `spec`, which
is not part of the key. Lost updates between processes that write the cache at once only cost a
second decode; an unreadable cache file is started afresh, and one that cannot be written is
warned about (the check itself still holds).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from stream_rlhf.atomic_file import write_text_atomically
from stream_rlhf.data.images import ImageError, ImageSpec, check_size, decode_image

log = logging.getLogger("stream_rlhf")
CACHE_FILE = "image_check.json"
"""In the cache folder: content SHA-256 -> {"size": [width, height]} or {"kind": ..., "reason": ...}."""


def bad_images(paths: Iterable[Path], spec: ImageSpec, cache_dir: Path | None) -> dict[Path, ImageError]:
    """The files among `paths` that `load_image(path, spec)` would refuse, with the ImageError it
    would raise (missing files are the dataset's own cheap check, before this). `cache_dir` None:
    no cache, every distinct file is decoded."""
    cache_file = None if cache_dir is None else Path(cache_dir) / CACHE_FILE
    known = _read_cache(cache_file)
    found: dict[str, dict] = {}
    bad = {}
    for path in dict.fromkeys(paths):
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as error:
            bad[path] = ImageError(path, "missing image", f"cannot be read ({error.strerror or error})")
            continue
        outcome = known.get(digest) or found.get(digest)
        if outcome is None:
            outcome = found[digest] = _decode(path)
        try:
            if "size" not in outcome:
                raise ImageError(path, outcome["kind"], outcome["reason"])
            check_size(path, *outcome["size"], spec)
        except ImageError as error:
            bad[path] = error
    if found and cache_file is not None:
        try:
            write_text_atomically(cache_file, json.dumps({**_read_cache(cache_file), **found}))
        except OSError as error:  # a cache: the next build decodes again
            log.warning("image check: cannot write its cache %s (%s)", cache_file, error.strerror or error)
    return bad


def _decode(path: Path) -> dict:
    try:
        return {"size": list(decode_image(path).size)}
    except ImageError as error:
        return {"kind": error.kind, "reason": error.reason}


def _read_cache(cache_file: Path | None) -> dict[str, dict]:
    if cache_file is None:
        return {}
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}
