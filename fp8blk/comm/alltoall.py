"""The all-to-all's counts and checks (docs/distributed.md, "All-to-all"): before any data
moves, ONE small metadata all_gather carries every rank's row of a table (its verdict on its
own arguments, the values all ranks must share, its send counts, the receive counts it
expects). Every rank then reads the same table: it learns its receive counts (column ``rank``
of the send counts) and raises the same error as every other rank, or none, so a bad call
never leaves a rank waiting in the data collective. Used by ``Communicator.all_to_all_v`` and
the quantized all-to-all (``fp8blk.comm.dispatch``).

An all_gather of the count vectors rather than an all_to_all of the counts: it is the one
metadata collective every backend has on host memory (``meta_all_gather``: no device staging,
no stream drain on NCCL or torch), and the whole send matrix on every rank is what lets every
rank check every pair (a rank's sends against what its peer expects) and word the same error.
Its size, 8 * (10 + 2 * size) bytes per rank, stays small at any expert-parallel width.
"""
from __future__ import annotations

import operator

import numpy as np

from .. import _arrays
from ..formats import recipe_code, recipe_from_code

# kinds of call (a rank in one kind of all-to-all while its peer is in another is an error)
PLAIN, QUANTIZED, HIGH_PRECISION = 1, 2, 3
_KIND_NAMES = {PLAIN: "all_to_all_v", QUANTIZED: "quantized_all_to_all",
               HIGH_PRECISION: "high_precision_all_to_all"}

# a rank's own verdict (column CODE), with the peer index and value it names
FINE, SEND_LENGTH, SEND_NEGATIVE, SEND_SUM, RECV_LENGTH, RECV_NEGATIVE, INPUT = range(7)

# row layout: CODE, PEER, VALUE, ROWS, KIND, WIDTH, DTYPE, RECIPE (kind, format and
# pow2_scales packed, 0: no recipe), EPSILON (amax_epsilon's float64 bits), OUT_ROWS, then the
# send counts (size) and the expected receive counts (size; -1 when not given)
CODE, PEER, VALUE, ROWS, KIND, WIDTH, DTYPE, RECIPE, EPSILON, OUT_ROWS = range(10)
HEAD = 10

_DTYPES = [np.dtype(d) for d in (np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32,
                                 np.int64, np.uint64, np.float16, np.float32, np.float64)]
_DTYPES.append(_arrays.BF16)


def dtype_code(dtype) -> int:
    """A small int naming ``dtype`` (0 for a dtype outside the table: then only itemsize and
    kind are compared, through the code's high bits)."""
    dtype = np.dtype(dtype)
    if dtype in _DTYPES:
        return 1 + _DTYPES.index(dtype)
    return 1000 * dtype.itemsize + ord(dtype.kind)


def _dtype_name(code) -> str:
    return str(_DTYPES[code - 1]) if 1 <= code <= len(_DTYPES) else f"dtype code {code}"


def _counts(counts, size, code_length, code_negative):
    """(list of ints or None, (code, peer, value) of the first problem or None)."""
    if hasattr(counts, "tolist"):  # NumPy / CuPy arrays, torch tensors
        counts = counts.tolist()
    try:
        values = [operator.index(c) for c in counts]
    except TypeError:
        return None, (code_length, -1, -1)
    if len(values) != size:
        return None, (code_length, -1, len(values))
    for peer, value in enumerate(values):
        if value < 0:
            return None, (code_negative, peer, value)
    return values, None


class Call:
    """What one rank brings to an all-to-all: the values its peers must share (``kind``,
    ``width``: elements per row, ``dtype``, ``recipe`` or None) and its rows and ``out``
    rows (-1: no out)."""

    __slots__ = ("kind", "width", "dtype", "recipe", "rows", "out_rows")

    def __init__(self, kind, width, dtype, rows, recipe=None, out_rows=-1):
        self.kind, self.width, self.dtype = int(kind), int(width), int(dtype)
        self.rows, self.recipe, self.out_rows = int(rows), recipe, int(out_rows)

    def recipe_columns(self):
        """(RECIPE, EPSILON): the whole recipe, so that every rank can name every rank's."""
        if self.recipe is None:
            return 0, 0
        kind, fmt, pow2, epsilon = recipe_code(self.recipe)
        return 1 + kind * 4 + fmt * 2 + pow2, epsilon


def _recipe_name(packed, epsilon):
    if packed == 0:
        return "no recipe"
    packed -= 1
    return repr(recipe_from_code([packed // 4, (packed // 2) % 2, packed % 2, epsilon]))


def exchange_counts(comm, call, send_counts, recv_counts=None, local_error=None):
    """(send counts, receive counts) as lists of ints, after the one metadata all_gather of
    the table; raises on every rank when any rank's arguments are bad or the ranks disagree.
    ``local_error``: an exception this rank found in its own input (it raises it; its peers
    raise a ValueError naming its rank)."""
    size, rank = comm.size, comm.rank
    row = np.zeros(HEAD + 2 * size, dtype=np.int64)
    row[HEAD + size:] = -1
    send, problem = _counts(send_counts, size, SEND_LENGTH, SEND_NEGATIVE)
    if problem is None and sum(send) != call.rows:
        problem = (SEND_SUM, -1, sum(send))
    recv = None
    if problem is None and recv_counts is not None:
        recv, problem = _counts(recv_counts, size, RECV_LENGTH, RECV_NEGATIVE)
    if local_error is not None:
        problem = (INPUT, -1, -1)
    if problem is not None:
        row[CODE:VALUE + 1] = problem
    else:
        row[HEAD: HEAD + size] = send
        if recv is not None:
            row[HEAD + size:] = recv
    row[ROWS:OUT_ROWS + 1] = (call.rows, call.kind, call.width, call.dtype,
                              *call.recipe_columns(), call.out_rows)
    table = comm.meta_all_gather(row)
    message = verdict(table, size)
    if message is not None:
        if table[rank, CODE] == INPUT and local_error is not None:
            raise local_error
        raise ValueError(message)
    return send, [int(v) for v in table[:, HEAD + rank]]


def verdict(table, size):
    """The error message every rank raises for this table (the first problem in rank order,
    then disagreements with rank 0, then mismatched pairs), or None."""
    what = _KIND_NAMES.get(int(table[0, KIND]), "all-to-all")
    for r in range(size):
        code, peer, value = (int(v) for v in table[r, CODE:VALUE + 1])
        rows = int(table[r, ROWS])
        if code == SEND_LENGTH or code == RECV_LENGTH:
            name = "send_counts" if code == SEND_LENGTH else "recv_counts"
            got = "not a sequence of ints" if value < 0 else f"{value} counts"
            return (f"{what}: rank {r}'s {name} is {got}; it needs one count per rank "
                    f"({size})")
        if code == SEND_NEGATIVE or code == RECV_NEGATIVE:
            name = "send_counts" if code == SEND_NEGATIVE else "recv_counts"
            return f"{what}: rank {r}'s {name}[{peer}] is {value}; counts must be >= 0"
        if code == SEND_SUM:
            return (f"{what}: rank {r}'s send_counts sum to {value} but it passes {rows} "
                    f"rows; they must sum to its rows")
        if code == INPUT:
            return (f"{what}: rank {r} rejected its own input (its error says why); no data "
                    f"moved")
    for r in range(1, size):
        for column, name in ((KIND, "the call"), (WIDTH, "the hidden size (elements per row)"),
                             (DTYPE, "the dtype"), (RECIPE, "the recipe")):
            span = slice(column, column + (2 if column == RECIPE else 1))
            first, mine = table[0, span].tolist(), table[r, span].tolist()
            if first == mine:
                continue
            if column == KIND:
                first, mine = _KIND_NAMES.get(first[0]), _KIND_NAMES.get(mine[0])
            elif column == DTYPE:
                first, mine = _dtype_name(first[0]), _dtype_name(mine[0])
            elif column == RECIPE:
                first, mine = _recipe_name(*first), _recipe_name(*mine)
            else:
                first, mine = first[0], mine[0]
            return f"{what}: ranks disagree on {name}: rank 0 has {first}, rank {r} has {mine}"
    sends = table[:, HEAD: HEAD + size]
    expects = table[:, HEAD + size:]
    for p in range(size):
        for r in range(size):
            expected = int(expects[p, r])
            if expected >= 0 and expected != int(sends[r, p]):
                return (f"{what}: rank {r} sends {int(sends[r, p])} rows to rank {p}, but "
                        f"rank {p} expects {expected} from rank {r} (its recv_counts[{r}])")
    for r in range(size):
        out_rows, received = int(table[r, OUT_ROWS]), int(sends[:, r].sum())
        if out_rows >= 0 and out_rows != received:
            return (f"{what}: rank {r}'s out has {out_rows} rows but it receives "
                    f"{received}")
    return None


def byte_counts(counts, row_bytes):
    return [c * row_bytes for c in counts]


def displacements(counts):
    """Offsets of each peer's block in a buffer laid out peer by peer."""
    out, offset = [], 0
    for c in counts:
        out.append(offset)
        offset += c
    return out


__all__ = ["PLAIN", "QUANTIZED", "HIGH_PRECISION", "Call", "dtype_code", "exchange_counts",
           "verdict", "byte_counts", "displacements"]
