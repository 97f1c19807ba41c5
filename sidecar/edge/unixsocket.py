"""Is anything listening on a Unix socket path? One stdlib connect, before gRPC gets involved.

Serving uses it before it removes a socket file (a Python gRPC server silently takes over a path, and
a second sidecar with the same ``--socket`` but another ``--state-dir`` holds no lock that would keep
it out); ``status`` uses it to say in one line why it cannot ask.

Beside the main socket the sidecar serves its health service alone on a second one, ``health_socket``
of it (``sidecar.edge.descriptors`` says why); ``hami-mig-sidecar health`` derives it the same way,
so the probes name only ``--socket``.
"""

from __future__ import annotations

import enum
import errno
import socket
import stat
from pathlib import Path

PROBE_TIMEOUT_S = 2.0
HEALTH_SUFFIX = ".health"


def health_socket(socket: Path) -> Path:
    """The health listener's socket beside ``socket``: ``sidecar.sock`` -> ``sidecar.sock.health``."""
    return socket.with_name(socket.name + HEALTH_SUFFIX)


class Probe(enum.Enum):
    ANSWERS = "answers"  # a process accepted the connection: the socket is live
    REFUSED = "refused"  # a socket file nobody listens on: left by a process that died
    MISSING = "missing"  # nothing at the path
    NOT_A_SOCKET = "not a socket"  # something else at the path


def probe(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Connect to ``path`` once and close. A connect that times out counts as ANSWERS: a listener
    with a full backlog is still a listener. Raises OSError for anything else (permission denied,
    a path longer than a socket address can hold)."""
    try:
        # connect() answers ECONNREFUSED for a regular file too; only a socket can be stale.
        if not stat.S_ISSOCK(path.stat().st_mode):
            return Probe.NOT_A_SOCKET
    except FileNotFoundError:
        return Probe.MISSING
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe_socket:
        probe_socket.settimeout(timeout_s)
        try:
            probe_socket.connect(str(path))
        except FileNotFoundError:
            return Probe.MISSING
        except ConnectionRefusedError:
            return Probe.REFUSED
        except TimeoutError:
            return Probe.ANSWERS
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                return Probe.REFUSED
            raise
    return Probe.ANSWERS
