"""The embedded shapes task written as a user's dataset usually comes: Parquet files of
conversations, images stored as PNG bytes inside the rows, the reference in a `solution` column.

    python -m stream_rlhf.data.shapes_parquet runs/shapes-parquet --train 1024 --eval 64
    # -> runs/shapes-parquet/train.parquet, eval.parquet; read them with
    #    --set data.train=runs/shapes-parquet/train.parquet --set data.fields.reference=solution

One row:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": {"bytes": b"\\x89PNG...", "path": null}},
                                               {"type": "text", "text": "how many red?"}]}],
     "solution": "2"}

The problems are `shapes.problems` (the same split of image layouts), so `shapes.reward` scores them.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stream_rlhf.data.shapes import Split, problems


def write_conversations(folder: str | Path, split: Split, count: int, seed: int) -> Path:
    """Write `count` problems of `split` as conversations to `folder/{split}.parquet`."""
    rows = []
    for problem in problems(split, count, seed):
        png = io.BytesIO()
        problem.image().save(png, format="PNG")
        question = problem.prompt.replace("<image>", "")
        content = [{"type": "image", "text": None, "image": {"bytes": png.getvalue(), "path": None}},
                   {"type": "text", "text": question, "image": None}]
        rows.append({"messages": [{"role": "user", "content": content}], "solution": problem.answer})
    path = Path(folder) / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--train", type=int, default=1024, help="train rows")
    parser.add_argument("--eval", type=int, default=64, help="eval rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, count in (("train", args.train), ("eval", args.eval)):
        print(write_conversations(args.folder, split, count, args.seed))


if __name__ == "__main__":
    main()
