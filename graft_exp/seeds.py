"""Seeds of a job's random draws, derived from the run seed and a purpose: the driver's and the backends'."""

from __future__ import annotations

import hashlib


def derive_seed(*parts) -> int:
    """A 31-bit seed from the run seed and a purpose (step, role, ...): reproducible and independent
    of everything that happened before, so a resumed job draws exactly what an uninterrupted one does."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF
