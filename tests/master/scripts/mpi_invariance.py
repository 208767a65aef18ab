"""cast_master_weights under real MPI: world-size invariance, repeated steps, fragments.

Run from the repository root:  mpiexec -n 4 python -m mpi4py -m tests.master.scripts.mpi_invariance SEED

Every rank builds the same scenarios from SEED (shards cut for this world size), calls
cast_master_weights through fp8blk.comm.MPIComm, and sends its buffers to rank 0, which checks
that the gathered bytes equal quantize(bf16(full weight)) and that exactly one collective per
recipe bucket was made, with the expected payload (plus, from the second call on, the rank
agreement's header on the first bucket). Prints "OK <size>" on rank 0 when all pass;
any failure raises, and ``-m mpi4py`` aborts every rank.
"""
import sys
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

import fp8blk as fb
from fp8blk.master import consensus
from fp8blk.master import cast_master_weights
from tests.master.scripts import cases


def _mpicomm(world):
    cls = getattr(fb.comm, "MPIComm", None)
    if cls is None:
        from fp8blk.comm.mpi import MPIComm as cls
    return cls(world)


def _gather(world, weights, frags):
    """Rank 0 gets every rank's buffers (and fragments) as NumPy arrays."""
    mine = ([list(w._buffers) for w in weights], frags)
    everything = world.gather(mine, root=0)
    if world.rank != 0:
        return None, None
    rank_weights = [[SimpleNamespace(_buffers=b) for b in bufs] for bufs, _ in everything]
    rank_frags = None if frags is None else [f for _, f in everything]
    return rank_weights, rank_frags


def run(seed):
    world = MPI.COMM_WORLD
    comm = _mpicomm(world)
    size, rank = comm.size, comm.rank
    plans = [(name, False) for name in cases.SCENARIOS] + [("batch20", True)]
    for case_no, (name, use_fragments) in enumerate(plans):
        rng = np.random.default_rng([seed, case_no, size])  # identical on every rank
        specs = cases.scenario(name)
        if use_fragments:
            specs = [s for s in specs if not (isinstance(s.recipe, fb.Block2D) and not s.rowwise)]
        fulls = [cases.make_full(rng, s.shape) for s in specs]
        ranges = cases.cut_ranges(rng, specs, size)
        local = np.random.default_rng([seed, case_no, size, rank])
        weights = [cases.alloc_weight(s, local) for s in specs]
        calls, b2_bytes, mx_bytes = cases.expected_payload(specs)
        # the steady state carries the agreement header in the first bucket's all-reduce
        unit = np.dtype(np.int32 if b2_bytes else np.uint8)
        header = consensus.header_size(unit) * unit.itemsize
        for step in range(2):  # repeated calls on the same weights, the master changing
            masters, starts = cases.rank_inputs(specs, fulls, ranges, rank, local)
            frags = cases.make_fragments(specs, ranges, rank, local)[0] if use_fragments \
                else None
            comm.reset_stats()
            cast_master_weights(weights, masters, starts, comm, fragments=frags)
            assert comm.stats.calls == calls, (name, comm.stats)
            extra = header if step > 0 and size > 1 else 0  # first call: verified (metadata)
            assert comm.stats.bytes == b2_bytes + mx_bytes + extra, (name, comm.stats)
            rank_weights, rank_frags = _gather(world, weights, frags)
            if rank == 0:
                cases.check(specs, fulls, ranges, rank_weights, rank_fragments=rank_frags)
            fulls = [cases.step_full(rng, f) for f in fulls]
    world.Barrier()
    if rank == 0:
        print(f"OK {size}", flush=True)


if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
