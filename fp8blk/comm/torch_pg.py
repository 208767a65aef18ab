"""TorchComm: the Communicator protocol over a torch.distributed process group, for use inside
torch programs (FSDP2 / tensor-parallel code that already has a process group).

Buffers (NumPy, CuPy or torch) are handed to torch without copies through DLPack. A group
whose backend needs another device (NCCL takes CUDA tensors, gloo CPU tensors) gets a staged
copy that is copied back afterwards. Bytes move as uint8 (gloo cannot gather float8 dtypes).
Floating-point MAX on CPU (gloo, whose MAX propagates NaN) runs as integer MAX over
order-preserving keys, so it ignores NaN like ``fmaxf``, as NCCL does on the GPU.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from .base import Communicator, Handle, float_to_max_keys, is_float, max_keys_to_float


def _dist():
    import torch.distributed as dist

    return dist


def _in_order(*steps):
    """One post-processing callable running the given steps (None entries skipped) in order."""
    def run():
        for step in steps:
            if step is not None:
                step()
    return run


class TorchComm(Communicator):
    """Collectives over ``group`` (a ``torch.distributed`` ProcessGroup; None: the default
    group). ``torch.distributed.init_process_group`` must have been called."""

    def __init__(self, group=None):
        super().__init__()
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchComm needs torch.distributed.init_process_group(...) to "
                               "have been called (e.g. under torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self._cpu_ok = "gloo" in backend or "mpi" in backend
        self._cuda_ok = "nccl" in backend or "cuda" in backend

    # -- conversions --------------------------------------------------------------------------
    def _needs_staging(self, arr) -> bool:
        return not self._cuda_ok if _arrays.is_device(arr) else not self._cpu_ok

    def _work(self, arr, dtype=None):
        """(torch tensor on a device the group takes, copy-back function or None)."""
        tensor = _arrays.from_backend(arr, _arrays.TORCH, dtype)
        if not self._needs_staging(arr):
            return tensor, None
        staged = tensor.cpu() if tensor.is_cuda else tensor.cuda()

        def copy_back():
            tensor.copy_(staged)
        return staged, copy_back

    def _global(self, rank):
        if self.group is None:
            return rank
        return _dist().get_global_rank(self.group, rank)

    @staticmethod
    def _handle(work, post, async_op):
        if async_op and work is not None:
            return Handle(waiter=work.wait, post=post)
        if work is not None:
            work.wait()
        post()
        return Handle.completed()

    def _reduce_op(self, op):
        reduce_op = _dist().ReduceOp
        return reduce_op.SUM if op == "sum" else reduce_op.MAX

    def _host_keys(self, arr, dtype):
        """Keys for NaN-ignoring MAX where the reduction runs on the CPU: (host key array
        gloo can reduce, finish function restoring the floats into ``arr``)."""
        host = arr.get() if _arrays.is_device(arr) else arr
        keys = float_to_max_keys(host, dtype)
        work = keys.astype(np.int32) if keys.dtype.itemsize == 2 else keys  # gloo lacks int16

        def finish():
            if work is not keys:
                keys[...] = work.astype(keys.dtype)
            max_keys_to_float(keys)
            if host is not arr:
                arr.set(host)
        return work, finish

    def _keys_on_cpu(self, arr, dtype, op) -> bool:
        if not (op == "max" and is_float(dtype)):
            return False
        return not _arrays.is_device(arr) or not self._cuda_ok

    # -- hooks --------------------------------------------------------------------------------
    def _all_reduce(self, buf, dtype, op, async_op):
        dist = _dist()
        if self._keys_on_cpu(buf, dtype, op):
            keys, finish = self._host_keys(buf, dtype)
            tensor, copy_back = self._work(keys)
        else:
            finish = None
            tensor, copy_back = self._work(buf, dtype)
        work = dist.all_reduce(tensor, op=self._reduce_op(op), group=self.group,
                               async_op=async_op)

        return self._handle(work, _in_order(copy_back, finish), async_op)

    def _all_gather(self, inp, out, async_op):
        dist = _dist()
        send, _ = self._work(inp)
        recv, copy_back = self._work(out)
        work = dist.all_gather_into_tensor(recv, send, group=self.group, async_op=async_op)
        return self._handle(work, copy_back or (lambda: None), async_op)

    def _reduce_scatter(self, inp, out, dtype, op, async_op):
        dist = _dist()
        if self._keys_on_cpu(inp, dtype, op):
            host_in = inp.get() if _arrays.is_device(inp) else np.array(inp, copy=True)
            keys = float_to_max_keys(host_in, dtype)  # a copy: inputs stay intact
            wide = keys.astype(np.int32) if keys.dtype.itemsize == 2 else keys
            recv_wide = np.empty(out.shape, dtype=wide.dtype)
            send, _ = self._work(wide)
            recv, copy_back = self._work(recv_wide)

            def finish():
                result = recv_wide.astype(keys.dtype)
                max_keys_to_float(result)
                if _arrays.is_device(out):
                    out.set(result.view(out.dtype))
                else:
                    out[...] = result.view(out.dtype)
        else:
            finish = None
            send, _ = self._work(inp, dtype)
            recv, copy_back = self._work(out, dtype)
        work = dist.reduce_scatter_tensor(recv, send, op=self._reduce_op(op), group=self.group,
                                          async_op=async_op)

        return self._handle(work, _in_order(copy_back, finish), async_op)

    def _broadcast(self, buf, root, async_op):
        dist = _dist()
        tensor, copy_back = self._work(buf)
        work = dist.broadcast(tensor, src=self._global(root), group=self.group,
                              async_op=async_op)
        return self._handle(work, copy_back or (lambda: None), async_op)

    def _barrier(self):
        _dist().barrier(group=self.group)
