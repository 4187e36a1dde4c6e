"""Counting the connections libzmq drops for a frame over the socket's max message size.

libzmq refuses a frame over ZMQ_MAXMSGSIZE by closing its connection, and tells the
application nothing. Its socket monitor emits EVENT_DISCONNECTED, the very event of a peer that
closed its socket or died: measured with libzmq 4.3.5 and pyzmq 27, no event, value or errno
tells the two apart. So our peers say goodbye before they close (stage runners and control
clients a final Heartbeat("stopped"), payload consumers a FetchRequest without fields), and a
connection that closes without one is counted (`connections_dropped`) and logged (rate-limited)
as what it is: an oversize frame, or a peer that died or never said goodbye.

libzmq queues a connection's last messages before it notices the close, so a disconnect read
from the monitor is judged only once the socket has been read dry after it (`collect`, read
the socket, then `judge`).
"""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import parse_monitor_message

from stream_rlhf.broker.ratelog import RateLimitedLog


class ConnectionWatch:
    def __init__(self, sock: zmq.Socket, what: str, limit_bytes: int, limit_name: str, ratelog: RateLimitedLog,
                 stats: dict[str, float], stat: str = "connections_dropped"):
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._what = what
        self._limit = f"{limit_bytes:,}-byte limit ({limit_name})"
        self._ratelog = ratelog
        self._stats = stats
        self._stat = stat
        self._goodbyes: set[int] = set()  # file descriptors of connections that said goodbye
        self._pending: list[int] = []  # disconnected file descriptors not judged yet

    def goodbye(self, frame: zmq.Frame) -> None:
        """`frame` (received with copy=False) was its peer's goodbye: its connection closes next."""
        self._goodbyes.add(frame.get(zmq.SRCFD))

    def collect(self) -> None:
        """Read the disconnects the monitor has seen so far (call before reading the socket dry)."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._pending.append(event["value"])

    def judge(self) -> None:
        """Count the collected disconnects of connections that said no goodbye (call once the
        socket has been read dry since `collect`)."""
        for fd in self._pending:
            if fd in self._goodbyes:
                self._goodbyes.discard(fd)
                continue
            self._stats[self._stat] = self._stats.get(self._stat, 0) + 1
            self._ratelog.log(
                logging.WARNING, "connection_dropped",
                "%s: a connection (fd %d) closed without a goodbye: a frame over the %s, which libzmq refuses "
                "by closing the connection, or a peer that died (%d so far)",
                self._what, fd, self._limit, int(self._stats[self._stat]),
            )
        self._pending.clear()

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)
