"""write_text_atomically from two threads of one process at once (two trainers of a device group
recording their checkpoint's pruning.json): neither fails, the file is always one text whole, and
no staging file is left."""

from __future__ import annotations

import threading
from pathlib import Path

from stream_rlhf.atomic_file import write_text_atomically


def test_two_threads_writing_one_file_at_once_neither_fails_nor_leaves_a_torn_file(tmp_path: Path):
    path = tmp_path / "checkpoints" / "iter-000001" / "pruning.json"
    texts = ['{"keep": 2, "parts": ["actor", "critic"]}', '{"keep": 2, "parts": ["actor", "critic", "medusa"]}']
    errors: list[BaseException] = []
    start = threading.Barrier(len(texts))

    def write_often(text: str) -> None:
        start.wait()
        try:
            for _ in range(500):
                write_text_atomically(path, text)
                assert path.read_text() in texts
        except BaseException as error:  # noqa: BLE001 - the main thread reports it
            errors.append(error)

    threads = [threading.Thread(target=write_often, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert path.read_text() in texts
    assert sorted(p.name for p in path.parent.iterdir()) == ["pruning.json"]
