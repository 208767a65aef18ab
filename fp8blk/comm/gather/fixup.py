"""The fix-up of a fast gather: staged parts moved into place (``plan.moves``), the scale
padding written (``plan.fills``), Block2D columnwise derived by FP8 transpose. Worked out once
per set of output buffers and replayed."""
from __future__ import annotations

from ..._dispatch import backend_for
from .arrays import U8
from .copies import uniform_byte
from .streams import nothing


def fix_up_post(plan, targets, stagings, ops, stream):
    """The fix-up of a multi-rank fast gather into ``targets`` as a callable, built once per
    set of buffers. On the device every move and fill is one runtime call enqueued on
    ``stream`` (the communication stream): a cudaMemcpy2DAsync per rank and staged part, a
    cudaMemsetAsync per fill whose bytes are all equal, else a copy from a constant block made
    here. On the host (NumPy, CPU torch) they are copies between strided byte views."""
    derive = derive_post(plan, targets) if plan.derive_columnwise else None
    if not plan.moves and not plan.fills:
        return derive or nothing
    if ops.device:
        calls, constants = _device_fix_up_calls(plan, targets, stagings, ops, stream)

        def device_post(keep=constants):  # keep: constant blocks the calls copy from
            for function, args in calls:
                function(*args)
            if derive is not None:
                derive()
        return device_post
    steps = _host_fix_up_steps(plan, targets, stagings, ops)

    def host_post():
        for dst, value in steps:
            if isinstance(value, (int, float)):
                ops.fill(dst, value)
            else:
                ops.copy(dst, value)
        if derive is not None:
            derive()
    return host_post


def derive_post(plan, targets):
    """Block2D columnwise by FP8 transpose of the gathered rowwise (on the current stream)."""
    derive = backend_for(targets[0]).block2d_columnwise_from_rowwise
    out = (targets[2], targets[3])

    def post():  # returns None: a Handle would take a value for its result
        derive(targets[0], targets[1], out=out)
    return post


def _device_fix_up_calls(plan, targets, stagings, ops, stream):
    """(calls, constants): the runtime calls ``(function, args)`` of the fix-up (see
    :mod:`fp8blk.comm.gather.copies`), addresses and sizes worked out once, and the constant
    blocks they copy fills from (filled here on the current stream, which the communication
    stream waits for, in begin(), before the first call reads them)."""
    copies = ops.copies()
    calls, constants = [], []
    for index, dst, dst_pitch, src, src_pitch, width, height in plan.moves:
        calls.append(copies.copy2d(ops.ptr(targets[index]) + dst, dst_pitch,
                                   ops.ptr(stagings[index]) + src, src_pitch, width, height,
                                   stream))
    for index, offset, (height, width), strides, value in plan.fills:
        if not height or not width:
            continue
        dtype = plan.out_layouts[index].dtype
        item = dtype.itemsize
        dst, pitch, row = ops.ptr(targets[index]) + offset, strides[0] * item, width * item
        byte = uniform_byte(value, dtype)
        if byte is not None and (height == 1 or pitch == row):
            calls.append(copies.memset(dst, byte, height * row, stream))
            continue
        constant = ops.empty((height, width), dtype)
        ops.fill(constant, value)
        constants.append(constant)
        calls.append(copies.copy2d(dst, pitch, ops.ptr(constant), row, row, height, stream))
    return calls, constants


def _host_fix_up_steps(plan, targets, stagings, ops):
    """[(destination view, source view or fill value)] of the fix-up on host arrays: each
    move as a (height, width) byte view pair, then the scale padding as typed views."""
    steps = []
    flats = {}

    def flat(index):
        if index not in flats:
            flats[index] = ops.flat_bytes(targets[index])
        return flats[index]
    for index, dst, dst_pitch, src, src_pitch, width, height in plan.moves:
        steps.append((ops.window(flat(index), dst, (height, width), (dst_pitch, 1), U8),
                      ops.window(stagings[index], src, (height, width), (src_pitch, 1), U8)))
    for index, offset, shape, strides, value in plan.fills:
        steps.append((ops.window(flat(index), offset, shape, strides,
                                 plan.out_layouts[index].dtype), value))
    return steps

