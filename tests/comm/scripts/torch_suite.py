"""Run the communicator suite over a torch.distributed process group (TorchComm).

    PYTHONPATH=. torchrun --standalone --nproc-per-node N tests/comm/scripts/torch_suite.py [gloo|nccl]
    ... torch_suite.py gloo PARTS      # only PARTS (a comma list as comm_suite's), torch tensors

gloo (CPU): the suite runs on torch CPU tensors, and its collective part once more on NumPy
arrays. nccl (one GPU per process): on CUDA tensors. Each rank prints ``SUITE OK ...``.
A rank given FP8BLK_TEST_FAIL_RANK=r raises before its first collective (the launcher must
then end the job instead of hanging).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

from fp8blk.comm import TorchComm
from tests.comm.scripts import checks


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local)
        import cupy

        cupy.cuda.Device(local).use()  # CuPy does not follow torch.cuda.set_device
    # device_id binds the NCCL communicator to this GPU up front (no guessing in barrier())
    extra = {"device_id": torch.device("cuda", local)} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300), **extra)
    comm = TorchComm()
    fail_rank = os.environ.get("FP8BLK_TEST_FAIL_RANK")
    if fail_rank is not None and int(fail_rank) == comm.rank:
        raise RuntimeError(f"rank {comm.rank} fails on purpose")
    if backend == "nccl":
        checks.run_suite(comm, checks.TorchFamily("cuda"), "torch-nccl")
    elif len(sys.argv) > 2:
        checks.run_suite(comm, checks.TorchFamily("cpu"), "torch-gloo",
                         tuple(sys.argv[2].split(",")))
    else:
        checks.run_suite(comm, checks.TorchFamily("cpu"), "torch-gloo")
        checks.run_suite(comm, checks.Family(), "torch-gloo-numpy", ("collectives",))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
