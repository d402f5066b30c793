"""Ports for the servers the tests start (Slurm's daemons, mlflow server, PostgreSQL, a browser's UI).

Drawn distinct (seen in CI: a private Slurm's controller and its node drawn the same port, the node bound it
first and the controller died on "Address already in use"), and from below the kernel's ephemeral range and
above Ray's worker ports (10002-19999): a port the kernel hands out to a probe socket goes back to the range
that every outgoing connection of the other worker (Ray, vLLM, mlflow clients) draws from, before the server
binds it. Nothing on the machine hands out ports of this band by itself.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports no socket of this machine holds now, from the band between Ray's worker ports
    and the ephemeral range, chosen at random so that two workers asking at once rarely draw the same."""
    band = range(RAY_WORKER_PORTS_END + 1, max(ephemeral_start(), RAY_WORKER_PORTS_END + 1001))
    chosen = []
    for port in random.sample(band, 200 + count):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"not {count} free ports in {band.start}-{band.stop - 1}")


def free_port() -> int:
    return free_ports(1)[0]
