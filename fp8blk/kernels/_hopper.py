"""Hopper (sm_90a) device primitives as Numba ``@intrinsic`` inline PTX, for the grouped GEMM
kernel (``_grouped_gemm_kernel``): shared-memory barriers (``mbarrier``), the copy engine
(``cp.async.bulk``, 2-D tensor copies from a tensor map in global memory), warpgroup matrix
multiply-accumulate (``wgmma`` m64n128k32 e4m3, fp32 accumulators as 64-tuples of float32 per
thread), the register split between warpgroups (``setmaxnreg``), and the staged epilogue
(``stmatrix`` into swizzled boxes, bulk tensor stores out). GPU only: imported when the kernel
is first built, never under the simulator (these instructions have none). PTX semantics: the
PTX ISA, sections "mbarrier", "cp.async.bulk.tensor", "wgmma", "stmatrix", "setmaxnreg".
"""
from __future__ import annotations

from ._numba import inline_asm, intrinsic, ir, types

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _asm(builder, ret, args, text, constraints):
    """Inline PTX kept where it stands (every instruction here has effects the compiler does
    not see: barriers, asynchronous copies, tensor-core state)."""
    return inline_asm(builder, ret, args, text, constraints, side_effect=True)


def _u32(builder, v):
    if v.type.width == 32:
        return v
    return builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32)


def _u64(builder, v):
    return v if v.type.width == 64 else builder.zext(v, _I64)


def void_asm(text, operands=0):
    """An intrinsic ``op(a, b, ...)`` that emits the PTX `text` on `operands` (0 to 2) 32-bit
    register operands $0, $1 (shared-memory addresses, counts; wider integers truncated),
    with a memory clobber."""
    constraints = ",".join(["r"] * operands + ["~{memory}"])

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [_u32(builder, a) for a in args], text, constraints)
        return context.get_dummy_value()

    if operands == 0:
        @intrinsic
        def op(typingctx):
            return types.void(), codegen
    elif operands == 1:
        @intrinsic
        def op(typingctx, a):
            return types.void(a), codegen
    else:
        @intrinsic
        def op(typingctx, a, b):
            return types.void(a, b), codegen
    return op


fence_mbarrier_init = void_asm("fence.mbarrier_init.release.cluster;")
wgmma_fence = void_asm("wgmma.fence.sync.aligned;")
wgmma_commit = void_asm("wgmma.commit_group.sync.aligned;")
# mbar_init(addr, count); mbar_arrive(addr); mbar_arrive_tx(addr, nbytes): arrive and add
# nbytes to the phase's expected transaction count
mbar_init = void_asm("mbarrier.init.shared::cta.b64 [$0], $1;", 2)
mbar_arrive = void_asm("mbarrier.arrive.shared::cta.b64 _, [$0];", 1)
mbar_arrive_tx = void_asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", 2)


@intrinsic
def mbar_try_wait(typingctx, addr, parity):
    """1 once the barrier's phase of parity `parity` has completed, else 0 (after a bounded
    hardware wait)."""
    def codegen(context, builder, sig, args):
        return _asm(builder, _I32, [_u32(builder, args[0]), _u32(builder, args[1])],
                    "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                    "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}")
    return types.uint32(addr, parity), codegen


@intrinsic
def tma_load_2d(typingctx, dst, tmap, at, c0, c1, mbar):
    """Bulk tensor copy of the box at (c0 inner, c1 outer) of the tensor map at tmap + at
    (elements; global memory, 64-byte aligned) to shared address `dst`, completing on barrier
    `mbar`."""
    def codegen(context, builder, sig, args):
        tm = builder.ptrtoint(builder.gep(args[1], [args[2]]), _I64)
        _asm(builder, ir.VoidType(), [_u32(builder, args[0]), tm, _u32(builder, args[3]),
                                      _u32(builder, args[4]), _u32(builder, args[5])],
             "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
             " [$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}")
        return context.get_dummy_value()
    return types.void(dst, tmap, at, c0, c1, mbar), codegen


@intrinsic
def bulk_load(typingctx, dst, src, offset, nbytes, mbar):
    """Bulk copy of `nbytes` (a multiple of 16) from src + offset (elements) to shared address
    `dst`, completing on barrier `mbar`."""
    def codegen(context, builder, sig, args):
        g = builder.ptrtoint(builder.gep(args[1], [args[2]]), _I64)
        _asm(builder, ir.VoidType(), [_u32(builder, args[0]), g, _u32(builder, args[3]),
                                      _u32(builder, args[4])],
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
             " [$0], [$1], $2, [$3];", "r,l,r,r,~{memory}")
        return context.get_dummy_value()
    return types.void(dst, src, offset, nbytes, mbar), codegen


@intrinsic
def ld_shared_f32(typingctx, addr):
    def codegen(context, builder, sig, args):
        return _asm(builder, _F32, [_u32(builder, args[0])], "ld.shared.f32 $0, [$1];",
                    "=f,r,~{memory}")
    return types.float32(addr), codegen


tensormap_release = void_asm("fence.proxy.tensormap::generic.release.gpu;")


@intrinsic
def tensormap_acquire(typingctx, tmap, at):
    """Order this thread's later tensor-map reads of tmap + at (elements) after the generic
    writes released before them (``tensormap_release``)."""
    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [builder.ptrtoint(builder.gep(args[0], [args[1]]), _I64)],
             "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l,~{memory}")
        return context.get_dummy_value()
    return types.void(tmap, at), codegen


@intrinsic
def shared_base(typingctx, arr):
    """The 32-bit shared-memory address of a shared array's first element."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.ptrtoint(data, _I64)
        return _asm(builder, _I32, [p], "{ .reg .u64 t; cvta.to.shared.u64 t, $1; "
                    "cvt.u32.u64 $0, t; }", "=r,l")
    return types.uint32(arr), codegen


N_ACC = 64                                   # 64 x 128 fp32 tile over 128 threads
ACC = types.UniTuple(types.float32, N_ACC)


def _unpack(builder, tup):
    return [builder.extract_value(tup, i) for i in range(N_ACC)]


@intrinsic
def acc_zeros(typingctx):
    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, ACC, [ir.Constant(_F32, 0.0)] * N_ACC)
    return ACC(), codegen


@intrinsic
def wgmma_wait0(typingctx, acc):
    outs = ",".join(["=f"] * N_ACC)
    ties = ",".join(str(i) for i in range(N_ACC))

    def codegen(context, builder, sig, args):
        st = ir.LiteralStructType([_F32] * N_ACC)
        r = _asm(builder, st, _unpack(builder, args[0]), "wgmma.wait_group.sync.aligned 0;",
                 f"{outs},{ties},~{{memory}}")
        return context.make_tuple(builder, ACC, [builder.extract_value(r, i)
                                                 for i in range(N_ACC)])
    return ACC(acc), codegen


@intrinsic
def mma_block(typingctx, acc, desc_a, desc_b):
    """A fresh partial product of one 128-deep block: four wgmma m64n128k32 (e4m3 x e4m3,
    fp32), the first overwriting acc, each k32 step 32 bytes on (2 descriptor units) inside
    the 128-byte swizzled rows."""
    regs = ", ".join(f"${i}" for i in range(N_ACC))

    def codegen(context, builder, sig, args):
        st = ir.LiteralStructType([_F32] * N_ACC)
        vals = _unpack(builder, args[0])
        da, db = _u64(builder, args[1]), _u64(builder, args[2])
        for step in range(4):
            scale_d = "0" if step == 0 else "1"
            text = (f"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                    "{" + regs + "}, $" + str(N_ACC) + ", $" + str(N_ACC + 1) +
                    f", {scale_d}, 1, 1;")
            cons = ",".join(["=f"] * N_ACC) + ",l,l," + ",".join(
                str(i) for i in range(N_ACC)) + ",~{memory}"
            off = ir.Constant(_I64, 2 * step)
            r = _asm(builder, st, [builder.add(da, off), builder.add(db, off)] + vals, text,
                     cons)
            vals = [builder.extract_value(r, i) for i in range(N_ACC)]
        return context.make_tuple(builder, ACC, vals)
    return ACC(acc, desc_a, desc_b), codegen


@intrinsic
def promote_rows(typingctx, final, part, s0, s1):
    """final + part * s[row]: the thread's elements 4j, 4j+1 sit in its row r0, 4j+2, 4j+3 in
    row r0 + 8 (the wgmma fp32 accumulator layout)."""
    def codegen(context, builder, sig, args):
        f, p = _unpack(builder, args[0]), _unpack(builder, args[1])
        out = [builder.fadd(f[i], builder.fmul(p[i], args[2] if (i % 4) < 2 else args[3]))
               for i in range(N_ACC)]
        return context.make_tuple(builder, ACC, out)
    return ACC(final, part, types.float32, types.float32), codegen


@intrinsic
def promote_rows_cols(typingctx, final, part, s0, s1, cols_addr):
    """final + part * (s[row] * t[col]): the 1x128 x 1x128 (weight-gradient) promotion. s0 / s1
    are the thread's two rows' scales; its columns' scales are read from shared memory, fp32
    at cols_addr + 4 (8j + e) for its columns col + 8j + e (cols_addr already at col)."""
    def codegen(context, builder, sig, args):
        f, p = _unpack(builder, args[0]), _unpack(builder, args[1])
        a = _u32(builder, args[4])
        pair = ir.LiteralStructType([_F32, _F32])
        out = list(f)
        for j in range(N_ACC // 4):
            r = _asm(builder, pair, [builder.add(a, ir.Constant(_I32, 32 * j))],
                     "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r,~{memory}")
            cs = (builder.extract_value(r, 0), builder.extract_value(r, 1))
            for e in range(4):
                i = 4 * j + e
                sr = args[2] if e < 2 else args[3]
                out[i] = builder.fadd(f[i], builder.fmul(p[i], builder.fmul(sr, cs[e % 2])))
        return context.make_tuple(builder, ACC, out)
    return ACC(final, part, types.float32, types.float32, cols_addr), codegen


@intrinsic
def stmatrix_swizzled(typingctx, row_addr, sw, half, acc):
    """The warp's 16 x 128 slice of the accumulator as bf16 into two 64-row boxes of 128-byte
    rows (columns 0-63 at box 0, 64-127 at box 0 + 8192 bytes), in the copy engine's 128-byte
    swizzle: the 16-byte chunk j of row r at chunk j ^ (r % 8). Eight stmatrix.x4:
    instruction g stores the 8 x 8 matrices (row half h, column block j) = (0, 2g), (1, 2g),
    (0, 2g + 1), (1, 2g + 1); `row_addr` is box 0's address of this lane's row for its matrix
    (lane L: row L % 8 + 8 ((L // 8) % 2)), `sw` that row % 8, `half` = L // 16 (its
    matrix's column block within the pair)."""
    def codegen(context, builder, sig, args):
        a, sw, half = (_u32(builder, v) for v in args[:3])
        vals = _unpack(builder, args[3])

        def word(h, j):
            lo, hi = vals[4 * j + 2 * h], vals[4 * j + 2 * h + 1]
            return _asm(builder, _I32, [hi, lo], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        for g in range(8):
            chunk = builder.xor(builder.add(half, ir.Constant(_I32, 2 * (g % 4))), sw)
            at = builder.add(a, builder.add(builder.shl(chunk, ir.Constant(_I32, 4)),
                                            ir.Constant(_I32, 8192 * (g // 4))))
            regs = [word(0, 2 * g), word(1, 2 * g), word(0, 2 * g + 1), word(1, 2 * g + 1)]
            _asm(builder, ir.VoidType(), [at] + regs,
                 "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
                 "r,r,r,r,r,~{memory}")
        return context.get_dummy_value()
    return types.void(row_addr, sw, half, ACC), codegen


@intrinsic
def tma_store_2d(typingctx, src, tmap, at, c0, c1):
    """Bulk tensor copy of shared address `src` to the box at (c0 inner, c1 outer) of the
    tensor map at tmap + at, in this thread's bulk group (commit, then wait before `src` is
    written again)."""
    def codegen(context, builder, sig, args):
        tm = builder.ptrtoint(builder.gep(args[1], [args[2]]), _I64)
        _asm(builder, ir.VoidType(), [tm, _u32(builder, args[3]), _u32(builder, args[4]),
                                      _u32(builder, args[0])],
             "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$0, {$1, $2}], [$3];",
             "l,r,r,r,~{memory}")
        return context.get_dummy_value()
    return types.void(src, tmap, at, c0, c1), codegen


# the bulk stores' groups: commit; wait until their shared sources have been read (the staging
# may be written again) or until they are complete (before the kernel ends); and the fence that
# makes generic-proxy shared writes (stmatrix) visible to the copy engine
bulk_commit = void_asm("cp.async.bulk.commit_group;")
bulk_wait_read = void_asm("cp.async.bulk.wait_group.read 0;")
bulk_wait = void_asm("cp.async.bulk.wait_group 0;")
fence_proxy_async = void_asm("fence.proxy.async.shared::cta;")


# named barriers of one math warpgroup (0 is __syncthreads'); immediates, so that ptxas
# reserves only these
bar_sync_wg1 = void_asm("bar.sync 1, 128;")
bar_sync_wg2 = void_asm("bar.sync 2, 128;")
# the register split of warp-specialized Hopper GEMMs (DeepGEMM's, CUTLASS's): 40 for the
# producer warpgroup, 232 for each of two math warpgroups (128 x 40 + 256 x 232 <= 65536)
setmaxnreg_producer = void_asm("setmaxnreg.dec.sync.aligned.u32 40;")
setmaxnreg_math = void_asm("setmaxnreg.inc.sync.aligned.u32 232;")
