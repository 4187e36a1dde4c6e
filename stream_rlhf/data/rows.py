"""The rows of a prompt dataset, whatever holds them: a JSONL file, a Parquet file or a `datasets`
folder (what `Dataset.save_to_disk` writes, read with `datasets.load_from_disk`).

    rows = read_rows("data/train.parquet")   # [(source, record | DataError)], in file order
    source, record = rows[0]                 # "data/train.parquet:row 0", {"messages": [...], ...}

Each record is the row as plain Python values (Parquet and `datasets` columns as pyarrow gives
them: an image column is `{"bytes": b"...", "path": "x.png"}`, a missing struct field is None).
Sources name the row: "{file}:{line}" for JSONL (1-based lines, blank lines skipped), "{file}:row
{index}" for Parquet and `datasets` folders (0-based, as `dataset[index]` numbers them). A JSONL line
that is not a JSON object is a DataError (kind "json" or "schema") in place of its record; a file
that cannot be read at all raises a DataError of kind "file".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from stream_rlhf.data.errors import DataError

Row = tuple[str, "dict[str, Any] | DataError"]
PARQUET_SUFFIXES = (".parquet", ".pq")
BATCH_ROWS = 4096
"""Rows converted to Python at a time (bounds the Arrow copies held at once)."""


def read_rows(path: str | Path) -> list[Row]:
    """Every row of the dataset at `path`: a `datasets` folder, a Parquet file (`.parquet`, `.pq`)
    or JSONL (any other file)."""
    path = Path(path)
    if path.is_dir():
        rows = _dataset_folder_rows(path)
    elif path.suffix in PARQUET_SUFFIXES:
        rows = _parquet_rows(path)
    else:
        rows = _jsonl_rows(path)
    if not rows:
        raise DataError(str(path), "file", "no rows (the dataset is empty)")
    return rows


def dataset_sha256(path: str | Path) -> str:
    """The hex digest of a dataset's content: the file's bytes, or a folder's files (names and
    bytes, in name order), so a copied dataset keeps its digest."""
    path, digest = Path(path), hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path)).encode() if path.is_dir() else b"")
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _jsonl_rows(path: Path) -> list[Row]:
    try:
        raw_lines = path.read_bytes().split(b"\n")
    except OSError as error:
        raise DataError(str(path), "file", f"cannot be read ({error.strerror or error})") from None
    rows: list[Row] = []
    for number, raw in enumerate(raw_lines, start=1):
        if raw.strip():
            source = f"{path}:{number}"
            rows.append((source, _json_record(source, raw)))
    return rows


def _json_record(source: str, raw: bytes) -> dict[str, Any] | DataError:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return DataError(source, "json", f"not valid JSON ({error})")
    if not isinstance(record, dict):
        return DataError(source, "schema", f"expected a JSON object, got {type(record).__name__}")
    return record


def _parquet_rows(path: Path) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DataError(str(path), "file", f"cannot be read as Parquet ({error})") from None
    return _table_rows(str(path), table)


def _dataset_folder_rows(path: Path) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError(str(path), "file", "is a folder: reading a `datasets` folder needs the `datasets` package "
                        "(pip install 'stream-rlhf[datasets]')") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise DataError(str(path), "file", f"is not a folder written by datasets' save_to_disk ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(str(path), "file", f"holds the splits {sorted(loaded)}: name one split's folder "
                        f"(e.g. {path / next(iter(loaded))})")
    return _table_rows(str(path), loaded.with_format("arrow")[:])


def _table_rows(name: str, table: Any) -> list[Row]:
    """The rows of a pyarrow Table as Python dicts, sources "{name}:row {index}"."""
    rows: list[Row] = []
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        for record in batch.to_pylist():
            rows.append((f"{name}:row {len(rows)}", record))
    return rows
