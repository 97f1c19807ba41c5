"""How many connections the sidecar's sockets hold, so that the liveness probe always finds a descriptor.

Every connection a client keeps open takes one file descriptor of the sidecar. Once the process has
none left (EMFILE), grpc stops accepting on every listener alike ("File descriptor limit reached.
Retrying.") and the probe's ``hami-mig-sidecar health`` waits out its deadline: kubelet restarts a
sidecar that was only flooded. Measured before this bound, with the descriptor limit at 512: 512 bare
connections to the socket and the probe failed DEADLINE_EXCEEDED (``tests/e2e/test_edge_descriptors.py``).

So the budget, in descriptors:

* at start ``serve`` raises the soft ``RLIMIT_NOFILE`` to the hard limit (``raise_soft_limit``; a
  container's runtime often starts it far lower), and logs both;
* ``RESERVED`` of them stay for the sidecar's own files: the records and their directory, CDI specs,
  the state directory lock, NVML's device files, the metrics listener and its scrapes, grpc's and
  asyncio's own (epoll, eventfds, pipes) and stdio. Idle, serving eight GPUs, the process holds about
  20; each of the 16 worker threads writing a record and a CDI spec at once adds about four;
* the health service is served again on a listener of its own beside the main socket
  (``unixsocket.health_socket``), which holds at most ``HEALTH_CONNECTIONS``: the probes' ``health``
  asks there, so a flood on the main socket takes neither its place nor its descriptor;
* the main socket holds at most ``connection_cap`` connections: ``--max-connections``, or fewer where
  the limit leaves less. grpc closes a connection past the cap as soon as it has accepted it, and
  the client sees UNAVAILABLE, which the Go client retries with backoff.

A connection that stays open costs memory too, far less than a following stream (which the edge
bounds with ``--max-followers``): ``--max-connections``' default keeps them all well inside the
shipped memory limit (``docs/operations.md`` has the figures).
"""

from __future__ import annotations

import contextlib
import resource

import msgspec

RESERVED = 256
HEALTH_CONNECTIONS = 16  # three probes of kubelet at a time, each a process of its own, and an operator's


class DescriptorLimit(msgspec.Struct, frozen=True):
    """The process's ``RLIMIT_NOFILE``: the soft limit before ``serve`` raised it, now, and the hard one."""

    was: int
    soft: int
    hard: int


def raise_soft_limit() -> DescriptorLimit:
    """Raise the soft descriptor limit to the hard one (as far as the kernel lets it: an unlimited hard
    limit leaves the soft one where it was)."""
    was, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard not in (resource.RLIM_INFINITY, was):
        with contextlib.suppress(ValueError, OSError):  # the limit stays; connection_cap budgets with it
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return DescriptorLimit(was=was, soft=soft, hard=hard)


def connection_cap(wanted: int, soft: int | None = None) -> int:
    """The connections the main socket may hold: ``wanted`` (``--max-connections``), or what the soft
    descriptor limit (the process's own unless given) leaves past ``RESERVED`` and the health
    listener's, whichever is fewer. ValueError when that leaves none."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = soft - RESERVED - HEALTH_CONNECTIONS
    if room < 1:
        raise ValueError(
            f"the descriptor limit (RLIMIT_NOFILE) of {soft} leaves no room for connections: the sidecar "
            f"keeps {RESERVED} for its own files and {HEALTH_CONNECTIONS} for the health listener; "
            "raise the limit of the container"
        )
    return min(wanted, room)


__all__ = ["HEALTH_CONNECTIONS", "RESERVED", "DescriptorLimit", "connection_cap", "raise_soft_limit"]
