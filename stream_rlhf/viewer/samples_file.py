"""Reading runs/<name>/samples.jsonl for the viewer: every good line as a `SampleRecord`, and
every bad one counted with its line number and why (the page shows them as skipped).

    good, skipped = read_samples(run_dir / SAMPLES_FILE)   # skipped: [SkippedLine(line=7, reason=...)]

A line is bad when it is not JSON, lacks a field or has one of the wrong type (msgspec names
it: "Expected `int`, got `str` - at `$.iteration`"), when its per-token lists differ in length
from `tokens`, or when its turn spans do not cover the tokens one after another. A missing file
reads as no samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from stream_rlhf.telemetry.sample_log import OBSERVATION, POLICY, SampleRecord

PER_TOKEN = ("logprob", "advantage", "kl")
TURN_KINDS = (POLICY, OBSERVATION)


@dataclass(frozen=True)
class SkippedLine:
    line: int
    """1-based line number in samples.jsonl."""
    reason: str


@dataclass(frozen=True)
class LoggedSample:
    line: int
    record: SampleRecord


def read_samples(path: Path) -> tuple[list[LoggedSample], list[SkippedLine]]:
    good: list[LoggedSample] = []
    skipped: list[SkippedLine] = []
    if not path.is_file():
        return good, skipped
    decoder = msgspec.json.Decoder(SampleRecord)
    for number, text in enumerate(path.read_bytes().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = decoder.decode(text)
        except msgspec.DecodeError as error:
            skipped.append(SkippedLine(number, str(error)))
            continue
        if (reason := _length_mismatch(record) or _bad_turns(record)) is not None:
            skipped.append(SkippedLine(number, reason))
            continue
        good.append(LoggedSample(number, record))
    return good, skipped


def _length_mismatch(record: SampleRecord) -> str | None:
    for name in PER_TOKEN:
        values = getattr(record, name)
        if values is not None and len(values) != len(record.tokens):
            return f"`{name}` has {len(values)} values for {len(record.tokens)} tokens"
    return None


def _bad_turns(record: SampleRecord) -> str | None:
    """Why `turns` is not a cover of the tokens by consecutive, non-empty spans of a known kind."""
    if record.turns is None:
        return None
    end = 0
    for start, stop, kind in record.turns:
        if start != end or stop <= start or kind not in TURN_KINDS:
            return (f"`turns` span {json.dumps([start, stop, kind])}: expected a non-empty span from token {end}, "
                    f"kind {' or '.join(TURN_KINDS)}")
        end = stop
    if end != len(record.tokens):
        return f"`turns` cover {end} of {len(record.tokens)} tokens"
    return None
