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
from .base import (Communicator, Handle, float_to_max_keys, is_float, max_keys_to_float,
                   torch_gather_out)

# a part of at most this many bytes per rank rides along in a pack (TorchComm.gather_parts):
# the quantized gather's in-band status is 8 bytes per rank
RIDE_ALONG = 8


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
        self.stream_ordered = self._cuda_ok  # NCCL work only orders streams on wait()
        self.orders_torch_stream = True
        self._host_pg = None  # a gloo group for host buffers when the group takes CUDA only

    # -- conversions --------------------------------------------------------------------------
    def _host_group(self):
        """The group that carries host (CPU) tensors: the group itself when its backend takes
        them, else a gloo group over the same ranks, made on the first host collective (by
        the group's ranks only: ``use_local_synchronization``). None if gloo is unavailable
        (host buffers are then staged through the device)."""
        if self._cpu_ok:
            return self.group
        if self._host_pg is None:
            dist = _dist()
            try:
                ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
                extra = {} if ranks == sorted(ranks) else {"sort_ranks": False}
                self._host_pg = dist.new_group(ranks=ranks, backend="gloo",
                                               use_local_synchronization=True, **extra)
            except Exception:  # no gloo, or a torch without these options: stage instead
                self._host_pg = False
        return self._host_pg or None

    def _route(self, arr):
        """(group, staged) for an array: host arrays take the host group where there is one."""
        if _arrays.is_device(arr) or getattr(arr, "is_cuda", False):
            return self.group, not self._cuda_ok
        if self._cpu_ok:
            return self.group, False
        host = self._host_group()
        return (host, False) if host is not None else (self.group, True)

    def _work(self, arr, dtype=None):
        """(torch tensor on a device its group takes, copy-back function or None, group)."""
        tensor = arr if _is_torch(arr) else _arrays.from_backend(arr, _arrays.TORCH, dtype)
        group, staged = self._route(arr)
        if not staged:
            return tensor, None, group
        staged = tensor.cpu() if tensor.is_cuda else tensor.cuda()

        def copy_back():
            tensor.copy_(staged)
        return staged, copy_back, group

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

    def all_gather(self, inp, out=None, async_op=False):
        """As :meth:`Communicator.all_gather`. A contiguous torch tensor on the device the
        group's backend takes (CUDA for NCCL, CPU for gloo), with ``out`` None or a
        contiguous tensor of the gathered shape and dtype on the same device, goes straight to
        ``all_gather_into_tensor`` (as uint8): no DLPack crossing, no staging. Everything else
        takes the general path."""
        direct = self._direct_gather(inp, out)
        if direct is None:
            return super().all_gather(inp, out, async_op)
        send, recv, out = direct
        self.record("all_gather", send.numel())
        # synchronous NCCL: the current stream waits for the collective (no Work.wait() call)
        work = _all_gather_single(_dist())(recv, send, group=self.group, async_op=async_op)
        if async_op:
            return Handle(waiter=work.wait, post=lambda: None).then(lambda: out)
        return out

    def _direct_gather(self, inp, out):
        torch = _arrays.torch_module()
        if torch is None or type(inp) is not torch.Tensor or not (
                self._cuda_ok if inp.is_cuda else self._cpu_ok):
            return None
        out = torch_gather_out(torch, inp, out, self.size)
        if out is None:
            return None
        return inp.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8), out

    # -- hooks --------------------------------------------------------------------------------
    def _all_reduce(self, buf, dtype, op, async_op):
        dist = _dist()
        if self._keys_on_cpu(buf, dtype, op):
            keys, finish = self._host_keys(buf, dtype)
            tensor, copy_back, group = self._work(keys)
        else:
            finish = None
            tensor, copy_back, group = self._work(buf, dtype)
        work = dist.all_reduce(tensor, op=self._reduce_op(op), group=group, async_op=async_op)

        return self._handle(work, _in_order(copy_back, finish), async_op)

    def _all_gather(self, inp, out, async_op):
        dist = _dist()
        send, _, _ = self._work(inp)
        recv, copy_back, group = self._work(out)
        work = _all_gather_single(dist)(recv, send, group=group, async_op=async_op)
        return self._handle(work, copy_back or (lambda: None), async_op)

    def _reduce_scatter(self, inp, out, dtype, op, async_op):
        dist = _dist()
        if self._keys_on_cpu(inp, dtype, op):
            host_in = inp.get() if _arrays.is_device(inp) else np.array(inp, copy=True)
            keys = float_to_max_keys(host_in, dtype)  # a copy: inputs stay intact
            wide = keys.astype(np.int32) if keys.dtype.itemsize == 2 else keys
            recv_wide = np.empty(out.shape, dtype=wide.dtype)
            send, _, _ = self._work(wide)
            recv, copy_back, group = self._work(recv_wide)

            def finish():
                result = recv_wide.astype(keys.dtype)
                max_keys_to_float(result)
                if _arrays.is_device(out):
                    out.set(result.view(out.dtype))
                else:
                    out[...] = result.view(out.dtype)
        else:
            finish = None
            send, _, _ = self._work(inp, dtype)
            recv, copy_back, group = self._work(out, dtype)
        work = _reduce_scatter_single(dist)(recv, send, op=self._reduce_op(op), group=group,
                                          async_op=async_op)

        return self._handle(work, _in_order(copy_back, finish), async_op)

    def _broadcast(self, buf, root, async_op):
        dist = _dist()
        tensor, copy_back, group = self._work(buf)
        work = dist.broadcast(tensor, src=self._global(root), group=group, async_op=async_op)
        return self._handle(work, copy_back or (lambda: None), async_op)

    def _barrier(self):
        _dist().barrier(group=self.group)

    def _all_to_all_v(self, parts, async_op):
        """One ``all_to_all_single`` with split sizes per part (gloo implements it on CPU
        tensors, NCCL as grouped send/recv), on uint8 tensors; NumPy/CuPy buffers are wrapped
        through DLPack, and staged where the group takes the other device."""
        dist = _dist()
        works, posts = [], []
        for send, send_counts, recv, recv_counts in parts:
            recv_t, copy_back, group = self._work(recv)
            send_t = self._work(send)[0]
            if send_t.device != recv_t.device:
                send_t = send_t.to(recv_t.device)
            works.append(dist.all_to_all_single(recv_t, send_t, list(recv_counts),
                                                list(send_counts), group=group,
                                                async_op=True))
            posts.append(copy_back)

        def wait(keep=parts):  # keep: the buffers the tensors view live until completion
            for work in works:
                work.wait()
        if async_op:
            return Handle(waiter=wait, post=_in_order(*posts))
        wait()
        _in_order(*posts)()
        return Handle.completed()

    #: Parts of one grouped gather whose largest-rank bytes add up to at most this many
    #: bytes per rank move in ONE collective (packed, see :meth:`gather_parts`); above it each
    #: part is its own collective, without the packing copies.
    coalesce_limit = 32 * 2**20

    def gather_parts(self, items, stream_ptr=None):
        """The parts in ONE collective where they can be (more than one non-empty part of over
        ``RIDE_ALONG`` bytes per rank, none staged to another device, at most
        ``coalesce_limit`` bytes per rank; smaller parts join such a pack): this rank's
        bytes of every part packed into one uint8 buffer (each part padded to its largest
        rank's count), one ``all_gather_single`` into a (size, packed) staging buffer, then
        one strided copy per part (equal counts) or one per rank and part into the parts'
        buffers. Otherwise each part is an in-place ``all_gather_single`` for equal counts;
        for unequal counts a list ``all_gather`` on NCCL (which takes uneven sizes), or, on
        gloo, every rank's bytes padded to the largest count. Torch tensors are used as they
        are; NumPy/CuPy arrays are wrapped through DLPack. Returns None when complete (or
        enqueued on the current stream: synchronous NCCL) or ``finish()``."""
        dist = _dist()
        # On CUDA tensors with NCCL the caller makes its stream wait at once
        # (fp8blk.comm.gather.streams.run): a synchronous collective does exactly that, without
        # a Work object to wait on (each Work.wait() costs host time per item)
        sync = self._cuda_ok and stream_ptr is not None
        parts = [self._part(send, recv, counts) for send, recv, counts in items]
        live = [p for p in parts if any(p[2])]
        # packing costs a copy of every part in and out, and saves a collective per part: the
        # parts of at most RIDE_ALONG bytes per rank (the gather's 8-byte status) join a pack
        # but never cause one, so one large part keeps its in-place gather
        if sum(max(p[2]) > RIDE_ALONG for p in live) > 1 and self._coalescible(live):
            return self._gather_packed(dist, live, sync)
        works, posts = [], []
        for send_t, recv_t, counts, copy_back, group in parts:
            mine = counts[self.rank]
            quiet = sync and recv_t.is_cuda and copy_back is None
            if all(c == mine for c in counts):
                if mine:
                    works.append(_all_gather_single(dist)(recv_t, send_t, group=group,
                                                             async_op=not quiet))
            elif recv_t.is_cuda:
                works.append(dist.all_gather(list(recv_t.split(list(counts))), send_t,
                                             group=group, async_op=not quiet))
            else:
                width = max(counts)
                padded = recv_t.new_zeros(width)
                padded[:mine] = send_t
                staging = recv_t.new_empty(width * self.size)
                works.append(_all_gather_single(dist)(staging, padded, group=group,
                                                         async_op=True))
                posts.append(_compact(recv_t, staging, counts, width))
            if copy_back is not None:
                posts.append(copy_back)

        works = [w for w in works if w is not None]
        if not works and not posts:
            return None

        def finish():
            for work in works:
                work.wait()
            for post in posts:
                post()
        return finish

    def _part(self, send, recv, counts):
        """(send tensor: this rank's bytes, recv tensor, counts, copy_back or None, group)."""
        recv_t, copy_back, group = self._work(recv)
        mine, start = counts[self.rank], sum(counts[: self.rank])
        if send is None:
            send_t = recv_t[start: start + mine]
        else:
            send_t = self._work(send)[0]
            if send_t.device != recv_t.device:
                send_t = send_t.to(recv_t.device)
        return send_t, recv_t, counts, copy_back, group

    def _coalescible(self, parts):
        first = parts[0]
        return (all(p[3] is None and p[4] is first[4] and p[1].device == first[1].device
                    for p in parts)
                and sum(max(p[2]) for p in parts) <= self.coalesce_limit)

    def _gather_packed(self, dist, parts, sync):
        """ONE all_gather_single of the parts packed per rank (see :meth:`gather_parts`)."""
        torch = _arrays.torch_module()
        widths = [max(p[2]) for p in parts]
        total = sum(widths)
        recv0 = parts[0][1]
        if all(all(c == w for c in p[2]) for p, w in zip(parts, widths)):
            send = torch.cat([p[0] for p in parts])  # one kernel for every part
        else:
            send = recv0.new_empty(total)  # padding bytes are never read
            offset = 0
            for p, width in zip(parts, widths):
                mine = p[2][self.rank]
                if mine:
                    send[offset: offset + mine].copy_(p[0])
                offset += width
        staging = recv0.new_empty(self.size * total)
        quiet = sync and recv0.is_cuda
        work = _all_gather_single(dist)(staging, send, group=parts[0][4],
                                        async_op=not quiet)
        table = staging.view(self.size, total)

        def unpack():
            offset = 0
            for (_, recv_t, counts, _, _), width in zip(parts, widths):
                if all(c == width for c in counts):
                    recv_t.view(self.size, width).copy_(table[:, offset: offset + width])
                else:
                    start = 0
                    for r, count in enumerate(counts):
                        if count:
                            recv_t[start: start + count].copy_(
                                table[r, offset: offset + count])
                        start += count
                offset += width
        if work is None:  # synchronous NCCL: enqueued after the collective on this stream
            unpack()
            return None

        def finish(keep=send):  # keep: the send buffer lives until the collective is done
            work.wait()
            unpack()
        return finish

    def meta_all_gather(self, row):
        """Metadata through the host group (gloo) with a NumPy-backed tensor: no device
        staging, no stream drain."""
        group = self._host_group()
        if group is None:
            return super().meta_all_gather(row)
        torch = _arrays.torch_module()
        table = np.empty((self.size, row.size), dtype=np.int64)
        with self.metadata():
            self.record("all_gather", row.nbytes)
            _all_gather_single(_dist())(torch.from_numpy(table.reshape(-1)),
                                           torch.from_numpy(row), group=group)
        return table

    def meta_all_reduce_max(self, row):
        group = self._host_group()
        if group is None:
            return super().meta_all_reduce_max(row)
        with self.metadata():
            self.record("all_reduce", row.nbytes)
            _dist().all_reduce(_arrays.torch_module().from_numpy(row), op=_dist().ReduceOp.MAX,
                               group=group)
        return row


def _all_gather_single(dist):
    """``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor`` is deprecated there)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single(dist):
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_torch(arr):
    torch = _arrays.torch_module()
    return torch is not None and isinstance(arr, torch.Tensor)


def _compact(recv, staging, counts, width):
    def run():
        offset = 0
        for r, count in enumerate(counts):
            if count:
                recv[offset: offset + count].copy_(staging[r * width: r * width + count])
            offset += count
    return run
