"""A process and its descendants, from /proc: what the benchmarks measure a whole run by (its
stage processes, engines and their children), not just the process they started.

    table = process_table()                    # {pid: /proc/<pid>/stat fields after the name}
    pids = tree(root_pid, table)               # root_pid and every descendant still alive
"""

from __future__ import annotations

import os


def process_table() -> dict[int, list[str]]:
    """The /proc/<pid>/stat fields after the command name, by pid: [state, ppid, ...]. Processes
    that end while it is read are left out."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                table[int(entry)] = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
    return table


def tree(root: int, table: dict[int, list[str]]) -> list[int]:
    """`root` and its descendants in `table`."""
    members = []
    for pid in table:
        ancestor = pid
        while ancestor > 1 and ancestor != root:
            ancestor = int(table[ancestor][1]) if ancestor in table else 0
        if ancestor == root:
            members.append(pid)
    return members
