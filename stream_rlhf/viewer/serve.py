"""`stream-rlhf view RUN --serve`: the run folder over HTTP on 127.0.0.1 only (view.html and the
files it links), until Ctrl-C.

    server = folder_server(run_dir, port)   # port 0: any free one; server.server_address[1] says which
    server.serve_forever()
"""

from __future__ import annotations

import functools
import logging
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger("stream_rlhf")
HOST = "127.0.0.1"


class _Handler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # to the log, not stderr
        log.debug("view server: " + format, *args)


def folder_server(folder: str | Path, port: int) -> ThreadingHTTPServer:
    handler = functools.partial(_Handler, directory=str(folder))
    return ThreadingHTTPServer((HOST, port), handler)
