"""The one place sockets are made: the broker's ROUTER, stages' DEALERs, and CURVE keys.

Binding beyond loopback requires CURVE: the broker loads `broker.key_secret` from the key folder
and admits only clients whose public key is in `authorized_clients/`; clients load
`client.key_secret` and the broker's public key from the same folder. `stream-rlhf keys DIR`
writes such a folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from stream_rlhf.broker.topology import needs_curve
from stream_rlhf.config import ConfigError


ENVELOPE_BYTES = 256
"""What CURVE adds to a frame on the wire (33 bytes today), with room to spare."""


def generate_keys(key_dir: str | Path) -> Path:
    """Write broker and client key pairs; the client's public key is authorized."""
    key_dir = Path(key_dir)
    authorized = key_dir / "authorized_clients"
    authorized.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(key_dir, "broker")
    public, _ = zmq.auth.create_certificates(key_dir, "client")
    shutil.copy(public, authorized / "client.key")
    return key_dir


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise CurveKeyError(f"{what}: {path} not found (create keys with `stream-rlhf keys {path.parent}`)")
    return zmq.auth.load_certificate(path)


class CurveKeyError(ConfigError):
    """A CURVE key file is missing or unreadable; the message names the file. A config error:
    the command line says it in one line (exit 2), without a traceback."""


def router(context: zmq.Context, address: str, key_dir: str | None, max_message_bytes: int) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
    """Bind the broker's ROUTER. Non-loopback addresses without keys are refused."""
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    sock.router_handover = 1  # a reconnecting instance with the same id takes over its route
    # libzmq closes the connection of a peer whose frame is over this, without reading it; the
    # broker counts those (connwatch.py). It checks the frame on the wire, which CURVE makes a
    # few bytes longer; a frame within that allowance is rejected (with a reason) by the broker.
    sock.maxmsgsize = max_message_bytes + ENVELOPE_BYTES
    auth = None
    if needs_curve(address) and not key_dir:
        sock.close()
        raise CurveKeyError(f"broker address {address} is not loopback: CURVE keys are required")
    if key_dir:
        try:
            public, secret = _load(Path(key_dir) / "broker.key_secret", "broker secret key")
        except CurveKeyError:
            sock.close()
            raise
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=str(Path(key_dir) / "authorized_clients"))
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.bind(address)
    return sock, auth


def dealer(context: zmq.Context, address: str, identity: str, key_dir: str | None) -> zmq.Socket:
    """A stage's (or control client's) DEALER to the broker, routed by its instance id."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 5000  # a send with no connection at all fails (zmq.Again) instead of hanging
    sock.routing_id = identity.encode()
    if key_dir:
        try:
            public, secret = _load(Path(key_dir) / "client.key_secret", "client secret key")
            server_public, _ = _load(Path(key_dir) / "broker.key", "broker public key")
        except CurveKeyError:
            sock.close()
            raise
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public
    elif needs_curve(address):
        sock.close()
        raise CurveKeyError(f"broker address {address} is not loopback: CURVE keys are required")
    sock.connect(address)
    return sock
