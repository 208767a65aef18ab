"""The rank-agreement probe of fp8blk.comm.agree: values and their complements reduced with MAX
give each value's minimum and maximum over ranks, signed (top 0) and unsigned (top = mask)."""
import contextlib

import numpy as np

from fp8blk.comm.agree import Agreement, all_agree, fingerprint, probe_row


def _reduced(rows, dtype):
    return np.max(np.array(rows, dtype=dtype), axis=0)


def test_signed_probe_reads_min_and_max():
    rows = [probe_row([5, 7]), probe_row([5, -3]), probe_row([5, 9])]
    agreement = Agreement(_reduced(rows, np.int64))
    assert agreement.same(0) and not agreement.same(1) and not agreement.same()
    assert (agreement.low, agreement.high) == ([5, -3], [5, 9])


def test_unsigned_probe_with_a_top():
    rows = [probe_row([3, 200], top=255), probe_row([3, 17], top=255)]
    agreement = Agreement(_reduced(rows, np.uint8), top=255)
    assert agreement.same(0) and not agreement.same(1)
    assert (agreement.low[1], agreement.high[1]) == (17, 200)


def test_all_agree_counts_as_metadata_and_takes_a_host_reduction():
    class One:
        def __init__(self):
            self.meta = 0

        def metadata(self):
            self.meta += 1
            return contextlib.nullcontext()

        def all_reduce(self, buf, op):
            assert op == "max" and buf.dtype == np.int64

    comm = One()
    assert all_agree(comm, [fingerprint("x"), 4]).same() and comm.meta == 1
    seen = []
    assert all_agree(comm, [1], lambda row: seen.append(row) or row).same()
    assert comm.meta == 1 and list(seen[0]) == [1, -1]


def test_fingerprint_is_stable_and_62_bits():
    assert fingerprint("a", (1, 2)) == fingerprint("a", (1, 2)) != fingerprint("a", (2, 1))
    assert 0 <= fingerprint(None) < 1 << 62
