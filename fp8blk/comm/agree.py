"""Rank agreement: the probe by which every rank learns whether all ranks hold the same values
(so that, when they do not, every rank raises the same error instead of entering a mismatched
collective), the fingerprint such values are made of, and the metadata scope their
collectives count under.

The probe: each value v travels with its complement ``top - v`` in ONE MAX all-reduce. The
maxima come back as max(v) and top - min(v), so every rank reads min and max of each value and
they are equal exactly when all ranks sent the same v. ``top`` is 0 for signed values
(v, -v) and the largest value of the dtype for unsigned ones. Used by the packed collectives
(layout check), the quantized gather (plan check) and the master-weight cast (its header).
"""
from __future__ import annotations

import contextlib
import hashlib

import numpy as np


def fingerprint(*parts) -> int:
    """A stable 62-bit hash of ``repr(parts)`` (the same in every process, unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def metadata_scope(comm):
    """``comm.metadata()`` where the communicator has it (collectives inside count as
    metadata in ``comm.stats``), else a scope that does nothing."""
    scope = getattr(comm, "metadata", None)
    return scope() if scope is not None else contextlib.nullcontext()


def probe_row(values, top=0) -> list:
    """``values`` followed by their complements ``top - v``: the entries a probe MAX-reduces."""
    values = [int(v) for v in values]
    return values + [top - v for v in values]


class Agreement:
    """A reduced probe row (:func:`probe_row` of n values, MAX over ranks) read back:
    ``high[i]`` / ``low[i]`` the largest and smallest value i over ranks."""

    __slots__ = ("high", "low")

    def __init__(self, reduced, top=0):
        values = [int(v) for v in reduced]
        n = len(values) // 2
        self.high = values[:n]
        self.low = [top - v for v in values[n:]]

    def same(self, i=None) -> bool:
        """Whether every rank sent the same value i (every value when i is None)."""
        if i is not None:
            return self.high[i] == self.low[i]
        return self.high == self.low


def all_agree(comm, values, reduce_max=None) -> Agreement:
    """One MAX all-reduce, counted as metadata, of the int64 probe of ``values``.
    ``reduce_max(row)``: the communicator's own host-only reduction of a small int64 array
    (returns the reduced array), used instead of ``comm.all_reduce`` where given."""
    row = np.array(probe_row(values), dtype=np.int64)
    if reduce_max is not None:
        row = reduce_max(row)
    else:
        with metadata_scope(comm):
            comm.all_reduce(row, op="max")
    return Agreement(row)


__all__ = ["fingerprint", "metadata_scope", "probe_row", "Agreement", "all_agree"]
