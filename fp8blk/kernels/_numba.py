"""The one module that imports ``numba.cuda``; low-level device primitives with simulator twins.

Everything GPU-specific that Numba cannot express directly lives here, so that a switch to
numba-cuda-mlir (or a new Numba release) touches one file:

* a NumPy >= 2.5 shim (numba-cuda 0.30.4 overloads the removed ``np.row_stack``);
* ``cuda``, ``types`` and ``SIM`` (True under ``NUMBA_ENABLE_CUDASIM=1``);
* device primitives. On the GPU they are ``@intrinsic`` inline PTX (16-byte non-coherent loads,
  vector stores, ``cvt.rn.satfinite`` FP8 packs, bf16/fp16 conversions, bit casts); under the
  simulator they are plain Python on NumPy scalars with the same results (bit arithmetic for
  FP8, shared-memory exchange instead of warp shuffles);
* ``compile_cubin(pyfunc, argtypes, launch_bounds, cc, name)``: the one compile route of the
  kernel cache (``_cache``): LTO-IR, then nvJitLink for the target architecture, with or
  without a GPU; ``sim_kernel`` the simulator's stand-in; ``compile_ptx_sm90`` for CPU tests;
  ``compile_kernel``: Numba's own launch route (a CUDA dispatcher), kept for comparisons and
  one-off benchmark kernels.

Conventions used by every primitive:
  * pointers are ``CPointer(uint32)`` / ``CPointer(uint8)`` / ... on the GPU and 1-D NumPy
    arrays of that dtype under the simulator; indices count elements of the pointer's type;
  * FP8 packs take four float32 values and return one uint32 holding their bytes, the first
    value in the lowest byte (the byte at the lowest address after a little-endian store).
"""
from __future__ import annotations

import numpy as np

from ._specs import SIM as _SIM_ENV

if not hasattr(np, "row_stack"):  # numba-cuda 0.30.4 overloads it; NumPy 2.5 removed it
    np.row_stack = np.vstack

import threading  # noqa: E402

from numba import config as _numba_config  # noqa: E402
from numba import cuda, types  # noqa: E402

SIM = bool(_numba_config.ENABLE_CUDASIM)
if SIM != _SIM_ENV:
    raise RuntimeError(
        f"Numba's CUDA simulator is {'on' if SIM else 'off'} but NUMBA_ENABLE_CUDASIM in the "
        f"environment says {'on' if _SIM_ENV else 'off'} (a Numba config file?): set the "
        f"variable to match, before Python starts")

__all__ = ["cuda", "types", "SIM", "device", "f32_bits", "bits_f32", "ld_v4",
           "fmax32", "pack4_e4m3", "pack4_e5m2", "pack4_fp8", "bf16x2_f32", "f16x2_f32",
           "f32_bf16_bits", "f32_f16_bits", "group_fmax", "ptr", "compile_kernel",
           "compile_ptx_sm90", "compile_cubin", "cubin_entries", "sim_kernel", "FULL_MASK",
           "prmt", "rsqrt_f32", "exp_f32", "fma_f32"]

FULL_MASK = 0xFFFFFFFF


def ptr(dtype):
    """Numba argument type of a raw device pointer to `dtype`, e.g. ``ptr(types.uint32)``."""
    return types.CPointer(dtype)


def device(fn):
    """Decorator for device helpers: an always-inlined Numba device function (or, under the
    simulator, a simulated device function)."""
    if SIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, inline="always")(fn)


if SIM:
    # ---------------------------------------------------------------------------------------
    # Simulator twins: NumPy scalar arithmetic with the hardware's results.

    _U32 = np.uint32

    def f32_bits(x):
        """float32 -> its uint32 bit pattern."""
        return np.float32(x).view(np.uint32)

    def bits_f32(u):
        """uint32 bit pattern -> float32."""
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)

    def ld_v4(p, i):
        """Four uint32 words p[i..i+3] (one 16-byte load on the GPU; i % 4 == 0)."""
        return _U32(p[i]), _U32(p[i + 1]), _U32(p[i + 2]), _U32(p[i + 3])

    def fmax32(a, b):
        """NaN-ignoring max of two float32 (fmaxf: NaN only if both are NaN)."""
        return np.fmax(np.float32(a), np.float32(b))

    def _encode_fp8(v, mbits, bias, fmax):
        """Round one float32 to FP8 (RNE, satfinite, NaN -> 0x7F) by bit arithmetic."""
        v = np.float32(v)
        if v != v:
            return 0x7F
        sign = (int(f32_bits(v)) >> 24) & 0x80
        mag = min(abs(v), np.float32(fmax))
        shift = 23 - mbits
        if mag < np.float32(2.0 ** (1 - bias)):
            code = int(np.rint(mag * np.float32(2.0 ** (mbits - 1 + bias))))
        else:
            b = int(f32_bits(mag))
            code = ((b + (1 << (shift - 1)) - 1 + ((b >> shift) & 1)) >> shift) \
                - ((127 - bias) << mbits)
        return code | sign

    def pack4_e4m3(a, b, c, d):
        return _U32(_encode_fp8(a, 3, 7, 448.0) | (_encode_fp8(b, 3, 7, 448.0) << 8)
                    | (_encode_fp8(c, 3, 7, 448.0) << 16) | (_encode_fp8(d, 3, 7, 448.0) << 24))

    def pack4_e5m2(a, b, c, d):
        return _U32(_encode_fp8(a, 2, 15, 57344.0) | (_encode_fp8(b, 2, 15, 57344.0) << 8)
                    | (_encode_fp8(c, 2, 15, 57344.0) << 16)
                    | (_encode_fp8(d, 2, 15, 57344.0) << 24))

    def bf16x2_f32(w):
        """uint32 holding two bf16 (element 0 in the low half) -> two float32."""
        w = int(w)
        return bits_f32((w & 0xFFFF) << 16), bits_f32(w & 0xFFFF0000)

    def f16x2_f32(w):
        """uint32 holding two fp16 (element 0 in the low half) -> two float32."""
        w = int(w)
        return (np.float32(np.uint16(w & 0xFFFF).view(np.float16)),
                np.float32(np.uint16(w >> 16).view(np.float16)))

    def f32_bf16_bits(x):
        """float32 -> bf16 bits (round to nearest even; NaN -> 0x7FC0 as ml_dtypes gives for
        the quiet NaN)."""
        import ml_dtypes

        x = np.float32(x)
        if x != x:
            return np.uint16(0x7FC0)
        return np.array(x).astype(ml_dtypes.bfloat16).view(np.uint16)[()]

    def f32_f16_bits(x):
        """float32 -> fp16 bits (round to nearest even, overflow to inf; NaN -> 0x7E00)."""
        x = np.float32(x)
        if x != x:
            return np.uint16(0x7E00)
        with np.errstate(over="ignore"):
            return np.float16(x).view(np.uint16)

    def group_fmax(v, lane_mask_lo, lane_mask_hi, scratch, tid):
        """fmax of `v` over the lanes whose lane ids differ from this one only in the bits
        lane_mask_lo..lane_mask_hi (powers of two, lo <= hi); every thread of the block must
        call it. ``scratch``: a float32 shared array of at least blockDim.x entries."""
        th = threading.current_thread()
        scratch[tid] = v
        th.syncthreads()
        bits = 0
        m = lane_mask_lo
        while m <= lane_mask_hi:
            bits |= m
            m *= 2
        base = tid & ~bits
        out = np.float32(np.nan)
        for other in range(32):
            if other & ~bits == 0:
                out = np.fmax(out, scratch[base | other])
        th.syncthreads()
        return np.float32(out)

    def pack4_fp8(fmt_is_e4m3):
        return pack4_e4m3 if fmt_is_e4m3 else pack4_e5m2

    def prmt(a, b, selector):
        """PTX ``prmt.b32`` (default mode): byte i of the result is byte (selector nibble i)
        of the 8-byte value b:a."""
        both = (int(b) << 32) | int(a)
        out = 0
        for i in range(4):
            sel = (int(selector) >> (4 * i)) & 0x7
            out |= ((both >> (8 * sel)) & 0xFF) << (8 * i)
        return np.uint32(out)

else:
    # ---------------------------------------------------------------------------------------
    # GPU: inline PTX through @intrinsic.
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I16 = ir.IntType(16)
    _F32 = ir.FloatType()

    def _asm(builder, ret, args, text, constraints, side_effect=False):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    # for the intrinsics of other kernel modules (``_hopper``): the one inline-PTX emitter, and
    # llvmlite / Numba's intrinsic decorator without a second import of numba.cuda
    inline_asm = _asm

    @intrinsic
    def f32_bits(typingctx, x):
        """float32 -> its uint32 bit pattern."""
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _I32)
        return types.uint32(types.float32), codegen

    @intrinsic
    def bits_f32(typingctx, u):
        """uint32 bit pattern -> float32 (any integer type is truncated to 32 bits)."""
        def codegen(context, builder, sig, args):
            v = args[0]
            if v.type.width != 32:
                v = builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32)
            return builder.bitcast(v, _F32)
        return types.float32(u), codegen

    # Wide loads and stores through inline PTX, addressed either as an element index of the
    # pointer (``_index_addr``) or as a byte offset from it (``_byte_addr``, the ``*_at``
    # variants below).
    _I8P = ir.IntType(8).as_pointer()

    def _index_addr(builder, p, i):
        return builder.gep(p, [i])

    def _byte_addr(builder, p, off):
        return builder.gep(builder.bitcast(p, _I8P), [off])

    def _ld_v4_intrinsic(address):
        @intrinsic
        def ld_v4(typingctx, p, i):
            sig = types.UniTuple(types.uint32, 4)(p, i)

            def codegen(context, builder, sig, args):
                st = ir.LiteralStructType([_I32] * 4)
                r = _asm(builder, st, [address(builder, args[0], args[1])],
                         "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(r, k) for k in range(4)])
            return sig, codegen
        return ld_v4

    def _st_vec_intrinsic(address, n):
        regs = ", ".join(f"${k + 1}" for k in range(n))
        text = f"st.global.v{n}.u32 [$0], {{{regs}}};"
        constraints = "l," + ",".join(["r"] * n) + ",~{memory}"

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [address(builder, args[0], args[1])] + list(args[2:]),
                 text, constraints, True)
            return context.get_dummy_value()

        def typed(p, i):
            return types.void(p, i, *([types.uint32] * n)), codegen

        if n == 2:
            def st_vec(typingctx, p, i, a, b):
                return typed(p, i)
        else:
            def st_vec(typingctx, p, i, a, b, c, d):
                return typed(p, i)
        return intrinsic(st_vec)

    def _st_u32_intrinsic(address):
        @intrinsic
        def st_u32(typingctx, p, i, v):
            sig = types.void(p, i, types.uint32)

            def codegen(context, builder, sig, args):
                addr = builder.bitcast(address(builder, args[0], args[1]), _I32.as_pointer())
                builder.store(args[2], addr, align=4)
                return context.get_dummy_value()
            return sig, codegen
        return st_u32

    # four uint32 words p[i..i+3] in one ld.global.nc.v4.u32 (16-byte aligned)
    ld_v4 = _ld_v4_intrinsic(_index_addr)

    def _pack4(kind):
        text = ("{\n.reg .b16 lo, hi;\n"
                f"cvt.rn.satfinite.{kind}x2.f32 lo, $2, $1;\n"
                f"cvt.rn.satfinite.{kind}x2.f32 hi, $4, $3;\n"
                "mov.b32 $0, {lo, hi};\n}")

        @intrinsic
        def pack4(typingctx, a, b, c, d):
            sig = types.uint32(types.float32, types.float32, types.float32, types.float32)

            def codegen(context, builder, sig, args):
                return _asm(builder, _I32, list(args), text, "=r,f,f,f,f")
            return sig, codegen
        return pack4

    pack4_e4m3 = _pack4("e4m3")
    pack4_e5m2 = _pack4("e5m2")

    @intrinsic
    def _fmax_f32(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return _asm(builder, _F32, list(args), "max.f32 $0, $1, $2;", "=f,f,f")
        return types.float32(types.float32, types.float32), codegen

    fmax32 = _fmax_f32

    @intrinsic
    def bf16x2_f32(typingctx, w):
        """uint32 holding two bf16 (element 0 in the low half) -> two float32."""
        sig = types.UniTuple(types.float32, 2)(types.uint32)

        def codegen(context, builder, sig, args):
            w = args[0]
            lo = builder.bitcast(builder.shl(w, ir.Constant(_I32, 16)), _F32)
            hi = builder.bitcast(builder.and_(w, ir.Constant(_I32, 0xFFFF0000)), _F32)
            return context.make_tuple(builder, sig.return_type, [lo, hi])
        return sig, codegen

    @intrinsic
    def f16x2_f32(typingctx, w):
        """uint32 holding two fp16 (element 0 in the low half) -> two float32."""
        sig = types.UniTuple(types.float32, 2)(types.uint32)

        def codegen(context, builder, sig, args):
            st = ir.LiteralStructType([_F32, _F32])
            r = _asm(builder, st, [args[0]],
                     "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\n"
                     "cvt.f32.f16 $1, h;\n}", "=f,=f,r")
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(r, 0), builder.extract_value(r, 1)])
        return sig, codegen

    def _f32_to_16(cvt, nan_bits):
        # NaN is written as the quiet NaN NumPy / ml_dtypes produce, not the GPU's canonical one.
        text = ("{\n.reg .b16 h;\n.reg .pred p;\n"
                f"cvt.rn.{cvt}.f32 h, $1;\n"
                "setp.nan.f32 p, $1, $1;\n"
                f"@p mov.b16 h, {nan_bits};\n"
                "mov.b16 $0, h;\n}")

        @intrinsic
        def conv(typingctx, x):
            def codegen(context, builder, sig, args):
                return _asm(builder, _I16, [args[0]], text, "=h,f")
            return types.uint16(types.float32), codegen
        return conv

    f32_bf16_bits = _f32_to_16("bf16", "0x7FC0")
    f32_f16_bits = _f32_to_16("f16", "0x7E00")

    @cuda.jit(device=True, inline="always")
    def group_fmax(v, lane_mask_lo, lane_mask_hi, scratch, tid):
        """fmax of `v` over the lanes whose lane ids differ from this one only in the bits
        lane_mask_lo..lane_mask_hi (powers of two, lo <= hi), by xor shuffles; every lane of
        the warp must call it. ``scratch`` and ``tid`` are unused here (simulator only)."""
        m = lane_mask_lo
        while m <= lane_mask_hi:
            v = fmax32(v, cuda.shfl_xor_sync(FULL_MASK, v, m))
            m *= 2
        return v

    def pack4_fp8(fmt_is_e4m3):
        return pack4_e4m3 if fmt_is_e4m3 else pack4_e5m2

    @intrinsic
    def prmt(typingctx, a, b, selector):
        """PTX ``prmt.b32``: byte i of the result is byte (selector nibble i) of b:a."""
        sig = types.uint32(types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, list(args), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
        return sig, codegen


# ------------------------------------------------------------------------------------------
# Compilation and launch


def compile_ptx_sm90(pyfunc, argtypes, launch_bounds=None):
    """PTX of kernel `pyfunc` for compute capability 9.0, without a GPU (CPU tests).

    Device helpers need Numba to believe a cc-9.0 device is current; the patch is scoped to
    this call.
    """
    import numba.cuda.dispatcher as dispatcher

    class _CC90:
        compute_capability = (9, 0)

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _CC90()
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, types.void(*argtypes), cc=(9, 0),
                                  launch_bounds=launch_bounds)
    finally:
        dispatcher.get_current_device = saved
    return ptx


class _SimKernel:
    """Simulator launch with the same call convention as a CuPy Function:
    ``k(grid, block, args)``, pointer arguments being 1-D NumPy arrays."""

    def __init__(self, pyfunc):
        self._kernel = cuda.jit(pyfunc)

    def __call__(self, grid, block, args, shared_mem=0):
        with np.errstate(all="ignore"):
            self._kernel[grid, block](*args)


def compile_kernel(pyfunc, argtypes, launch_bounds=None):
    """Compile kernel `pyfunc` for the current GPU with raw-pointer / scalar `argtypes` and
    return a launchable ``f(grid, block, args)``.

    On the GPU this is a ``cupy.cuda.function.Function`` loaded from Numba's cubin: launching
    it costs a few microseconds, passes CuPy arrays as their data pointers, and runs on CuPy's
    current stream (pass integer scalars as ``numpy.int64``). Under the simulator, a
    ``_SimKernel`` taking NumPy arrays. Callers cache the result (compiling is slow).
    """
    if SIM:
        return _SimKernel(pyfunc)
    import cupy

    sig = types.void(*argtypes)
    kwargs = {"launch_bounds": launch_bounds} if launch_bounds else {}
    dispatcher = cuda.jit(sig, **kwargs)(pyfunc)
    overload = dispatcher.overloads[tuple(argtypes)]
    cubin = overload._codelibrary.get_cubin()
    module = cupy.cuda.function.Module()
    image = getattr(cubin, "code", cubin)  # numba-cuda 0.30 returns a cuda.core ObjectCode
    if isinstance(image, str):
        with open(image, "rb") as f:
            image = f.read()
    module.load(bytes(image))
    function = module.get_function(overload.entry_name)
    return function


def _cuda_arch(cc):
    """nvJitLink architecture of compute capability (major, minor): sm_90a for 9.0 and later
    (the architecture-specific variant, as a Numba launch on such a device uses), else sm_XY."""
    major, minor = int(cc[0]), int(cc[1])
    return f"sm_{major}{minor}{'a' if (major, minor) >= (9, 0) else ''}"


def cubin_entries(cubin):
    """Names of the kernel entry functions in an ELF cubin (FUNC symbols marked as CUDA
    entries: ``st_other`` bit 0x10)."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
            for i in range(shnum)]
    names = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in secs:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = secs[link][4]
        for j in range(size // entsize):
            st_name, st_info, st_other, _, _, _ = struct.unpack_from("<IBBHQQ", cubin,
                                                                     off + j * entsize)
            if st_info & 0xF == 2 and st_other & 0x10:
                end = cubin.index(b"\0", strtab + st_name)
                names.append(cubin[strtab + st_name:end].decode())
    return names


_compile_lock = threading.Lock()


def compile_cubin(pyfunc, argtypes, launch_bounds, cc, name):
    """(entry name, cubin bytes) of kernel `pyfunc` with raw-pointer / scalar `argtypes` for
    compute capability `cc` ((major, minor)), with or without a GPU: Numba compiles it to
    LTO-IR, nvJitLink links it for :func:`_cuda_arch` (the route a Numba launch takes, which
    links LTO-IR by default, so the code is the same).

    The cubin is a function of its inputs only: the kernel is named `name` (its mangled name
    also carries the module and Numba's per-process function counter, which is pinned to 0
    for the kernel here), and Numba sees a device of compute capability `cc` while it
    compiles (device helpers ask for it)."""
    import numba.cuda.dispatcher as dispatcher
    from cuda.core import Linker, LinkerOptions, ObjectCode
    from numba.cuda.core import bytecode

    class _Device:
        compute_capability = (int(cc[0]), int(cc[1]))

    pyfunc.__qualname__ = name
    identity = bytecode.FunctionIdentity
    descriptor = identity.__dict__["from_function"]     # the classmethod object
    from_function = identity.from_function

    def pinned(cls, func):
        ident = from_function.__func__(cls, func)
        if func is pyfunc:
            ident.unique_id = 0
            ident.unique_name = f"{ident.func_qualname}$0"
        return ident

    with _compile_lock:
        saved = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: _Device()
        identity.from_function = classmethod(pinned)
        try:
            ltoir, _ = cuda.compile(pyfunc, types.void(*argtypes), device=False, abi="numba",
                                    cc=_Device.compute_capability, output="ltoir",
                                    launch_bounds=launch_bounds)
        finally:
            identity.from_function = descriptor
            dispatcher.get_current_device = saved
    linker = Linker(ObjectCode.from_ltoir(ltoir),
                    options=LinkerOptions(arch=_cuda_arch(cc), link_time_optimization=True))
    cubin = bytes(linker.link("cubin").code)
    linker.close()
    entries = cubin_entries(cubin)
    if len(entries) != 1:
        raise RuntimeError(f"expected one kernel entry in the cubin of {name}, got {entries}")
    return entries[0], cubin


def sim_kernel(pyfunc):
    """The simulated kernel of `pyfunc` (``NUMBA_ENABLE_CUDASIM=1`` only)."""
    if not SIM:
        raise RuntimeError("sim_kernel needs NUMBA_ENABLE_CUDASIM=1")
    return _SimKernel(pyfunc)


# ------------------------------------------------------------------------------------------
# rsqrt_f32(v): 1/sqrt(v) as CUDA's rsqrtf computes it (``rsqrt.approx.f32``, what torch's
# ``torch.rsqrt`` runs for float32 on the GPU; within 2 ulp of the exact value). The simulator
# twin rounds the exact value once.

if SIM:
    def rsqrt_f32(v):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.float32(1.0 / np.sqrt(np.float64(np.float32(v))))
else:
    @intrinsic
    def rsqrt_f32(typingctx, v):
        def codegen(context, builder, sig, args):
            return _asm(builder, _F32, [args[0]], "rsqrt.approx.f32 $0, $1;", "=f,f")
        return types.float32(types.float32), codegen


# ------------------------------------------------------------------------------------------
# exp_f32(v): e**v as CUDA's expf computes it (libdevice ``__nv_expf``, what torch's float
# opmath ``::exp`` runs; within 2 ulp of the exact value); fma_f32(a, b, c): a * b + c rounded
# once (``fma.rn.f32``, what nvcc's default contraction makes of ``c + a * b``). The simulator
# twins round the float64 result once.

if SIM:
    def exp_f32(v):
        with np.errstate(over="ignore"):
            return np.float32(np.exp(np.float64(np.float32(v))))

    def fma_f32(a, b, c):
        return np.float32(np.float64(np.float32(a)) * np.float64(np.float32(b))
                          + np.float64(np.float32(c)))
else:
    import math as _math

    @device
    def exp_f32(v):
        return _math.exp(v)

    @device
    def fma_f32(a, b, c):
        return cuda.fma(a, b, c)


# ------------------------------------------------------------------------------------------
# Single warp shuffles of float32 values with simulator twins (the simulator has no warp
# shuffles: there the exchange goes through a shared-memory `scratch` of >= blockDim.x floats,
# and every thread of the block must call, as on the GPU every lane of the warp must).

if SIM:
    def shfl_xor_f32(v, lane_mask, scratch, tid):
        """float32 `v` of the lane whose id is this lane's xor `lane_mask`."""
        import threading

        th = threading.current_thread()
        scratch[tid] = v
        th.syncthreads()
        out = np.float32(scratch[tid ^ int(lane_mask)])
        th.syncthreads()
        return out

    def shfl_idx_f32(v, src_lane, scratch, tid):
        """float32 `v` of lane `src_lane` (0..31) of this thread's warp."""
        import threading

        th = threading.current_thread()
        scratch[tid] = v
        th.syncthreads()
        out = np.float32(scratch[(tid & ~31) | int(src_lane)])
        th.syncthreads()
        return out
else:
    @cuda.jit(device=True, inline="always")
    def shfl_xor_f32(v, lane_mask, scratch, tid):
        """float32 `v` of the lane whose id is this lane's xor `lane_mask` (``shfl.bfly``)."""
        return cuda.shfl_xor_sync(FULL_MASK, v, lane_mask)

    @cuda.jit(device=True, inline="always")
    def shfl_idx_f32(v, src_lane, scratch, tid):
        """float32 `v` of lane `src_lane` (0..31) of this thread's warp (``shfl.idx``)."""
        return cuda.shfl_sync(FULL_MASK, v, src_lane)


# ------------------------------------------------------------------------------------------
# Packed 2 x 16-bit maxima (``max.bf16x2`` / ``max.f16x2``): per half, the larger value; a NaN
# half loses to a number (fmaxf semantics), two NaN halves give a NaN. Exact (a selection).

if SIM:
    def _half_value(h, is_bf16):
        h = int(h) & 0xFFFF
        if is_bf16:
            return float(np.uint32(h << 16).view(np.float32))
        return float(np.uint16(h).view(np.float16))

    def _max16x2(a, b, is_bf16, nan_half):
        out = 0
        for sh in (0, 16):
            x = (int(a) >> sh) & 0xFFFF
            y = (int(b) >> sh) & 0xFFFF
            xv = _half_value(x, is_bf16)
            yv = _half_value(y, is_bf16)
            if xv != xv and yv != yv:
                h = nan_half
            elif xv != xv:
                h = y
            elif yv != yv:
                h = x
            else:
                h = x if xv >= yv else y
            out |= h << sh
        return np.uint32(out)

    def max_bf16x2(a, b):
        """Per-half max of two uint32 words each holding two bf16 (NaN-ignoring)."""
        return _max16x2(a, b, True, 0x7FFF)

    def max_f16x2(a, b):
        """Per-half max of two uint32 words each holding two fp16 (NaN-ignoring)."""
        return _max16x2(a, b, False, 0x7FFF)

    def absmax_bf16x2(a, b):
        """Per-half max of |a| and |b| (bf16 halves; NaN-ignoring)."""
        return _max16x2(int(a) & 0x7FFF7FFF, int(b) & 0x7FFF7FFF, True, 0x7FFF)

    def absmax_f16x2(a, b):
        """Per-half max of |a| and |b| (fp16 halves; NaN-ignoring)."""
        return _max16x2(int(a) & 0x7FFF7FFF, int(b) & 0x7FFF7FFF, False, 0x7FFF)
else:
    def _word_of_two(text, argtype, constraint):
        """uint32 f(a, b) of two `argtype` operands running the PTX `text` ($0 the result, $1
        a, $2 b; `constraint` the operands' register class)."""
        @intrinsic
        def op(typingctx, a, b):
            sig = types.uint32(argtype, argtype)

            def codegen(context, builder, sig, args):
                return _asm(builder, _I32, list(args), text, f"=r,{constraint},{constraint}")
            return sig, codegen
        return op

    def _packed16x2_intrinsic(instruction):
        """uint32 op(uint32 a, uint32 b) running PTX `instruction` on two packed halves."""
        return _word_of_two(f"{instruction} $0, $1, $2;", types.uint32, "r")

    max_bf16x2 = _packed16x2_intrinsic("max.bf16x2")
    max_f16x2 = _packed16x2_intrinsic("max.f16x2")
    # max.xorsign.abs: the larger magnitude per half (NaN-ignoring like max); its sign bit is
    # the xor of the inputs' signs, so callers take |.| of the final value.
    absmax_bf16x2 = _packed16x2_intrinsic("max.xorsign.abs.bf16x2")
    absmax_f16x2 = _packed16x2_intrinsic("max.xorsign.abs.f16x2")


# ------------------------------------------------------------------------------------------
# Vector loads / stores addressed by a BYTE offset from a pointer of any element type (saves
# the index scaling and shifts when the caller's natural offset is in bytes, e.g. FP8 data).
# The address must be aligned to the access size; the simulator twins check that (a
# misaligned access faults on the GPU) and that the bytes lie inside the buffer.

if SIM:
    def _words_at(p, off, nwords):
        """uint32 view of the 4 * nwords bytes at byte offset `off` of the simulated pointer
        p, checking the access is aligned to its size and inside the buffer."""
        off = int(off)
        size = 4 * nwords
        assert (int(p.ctypes.data) + off) % size == 0, f"misaligned {size}-byte access"
        assert 0 <= off and off + size <= p.nbytes, f"{size}-byte access outside the buffer"
        return p.view(np.uint8)[off:off + size].view(np.uint32)

    def ld_v4_at(p, off):
        """Four uint32 words at byte offset `off` (16-byte aligned) of pointer p."""
        w = _words_at(p, off, 4)
        return _U32(w[0]), _U32(w[1]), _U32(w[2]), _U32(w[3])

    def st_v2_at(p, off, a, b):
        """Store two uint32 words at byte offset `off` (8-byte aligned) of pointer p."""
        _words_at(p, off, 2)[:] = (a, b)

    def st_v4_at(p, off, a, b, c, d):
        """Store four uint32 words at byte offset `off` (16-byte aligned) of pointer p."""
        _words_at(p, off, 4)[:] = (a, b, c, d)

    def st_u32_at(p, off, v):
        """Store one uint32 word at byte offset `off` (4-byte aligned) of pointer p."""
        _words_at(p, off, 1)[0] = v
else:
    # byte-offset versions of the GPU loads / stores above
    ld_v4_at = _ld_v4_intrinsic(_byte_addr)
    st_v2_at = _st_vec_intrinsic(_byte_addr, 2)
    st_v4_at = _st_vec_intrinsic(_byte_addr, 4)
    st_u32_at = _st_u32_intrinsic(_byte_addr)


# ------------------------------------------------------------------------------------------
# FP8 decoding and 2 x 16-bit packing for dequantize (hardware conversions on sm_89+), and
# narrower non-coherent loads addressed by byte offset.
#   * e4m3x4_f32 / e5m2x4_f32(w): the four FP8 bytes of uint32 `w` (byte 0 first) as float32,
#     exact for every finite code; NaN codes give NaN (any payload), E5M2 +-inf stays +-inf;
#   * bf16x2_pack / f16x2_pack(a, b): uint32 holding round-to-nearest-even bf16 / fp16 of
#     float32 a (low half) and b (high half), a NaN half written as the quiet NaN NumPy and
#     ml_dtypes produce (bf16 0x7FC0, fp16 0x7E00), not the GPU's canonical 0x7FFF;
#   * ld_u32_at / ld_v2_at(p, off): one / two uint32 words at byte offset `off` (4- / 8-byte
#     aligned) of pointer p, through the non-coherent (read-only) path.

if SIM:
    def _decode_fp8(b, mbits, bias):
        """float32 value of FP8 byte b (E4M3: mbits 3, bias 7; E5M2: 2, 15), bit arithmetic."""
        b = int(b) & 0xFF
        emax = (1 << (7 - mbits)) - 1
        e = (b >> mbits) & emax
        m = b & ((1 << mbits) - 1)
        sign = -1.0 if b & 0x80 else 1.0
        if e == emax and mbits == 3 and m == 7:
            return np.float32(np.nan)
        if e == emax and mbits == 2:
            return np.float32(sign * np.inf) if m == 0 else np.float32(np.nan)
        if e == 0:
            return np.float32(sign * m * 2.0 ** (1 - bias - mbits))
        return np.float32(sign * (1.0 + m / 2.0 ** mbits) * 2.0 ** (e - bias))

    def e4m3x4_f32(w):
        """The four E4M3 bytes of uint32 w (byte 0 first) as float32."""
        w = int(w)
        return tuple(_decode_fp8(w >> (8 * i), 3, 7) for i in range(4))

    def e5m2x4_f32(w):
        """The four E5M2 bytes of uint32 w (byte 0 first) as float32."""
        w = int(w)
        return tuple(_decode_fp8(w >> (8 * i), 2, 15) for i in range(4))

    def bf16x2_pack(a, b):
        """bf16 bits of a (low half) and b (high half); NaN -> 0x7FC0."""
        return _U32(int(f32_bf16_bits(a)) | (int(f32_bf16_bits(b)) << 16))

    def f16x2_pack(a, b):
        """fp16 bits of a (low half) and b (high half); NaN -> 0x7E00."""
        return _U32(int(f32_f16_bits(a)) | (int(f32_f16_bits(b)) << 16))

    def _cvt_nan(bits, x):
        return 0x7FFF if np.float32(x) != np.float32(x) else int(bits)

    def bf16x2_cvt(a, b):
        """bf16 bits of a (low half) and b (high half) as CUDA's conversion writes them (torch's
        CUDA kernels): NaN -> 0x7FFF."""
        return _U32(_cvt_nan(f32_bf16_bits(a), a) | (_cvt_nan(f32_bf16_bits(b), b) << 16))

    def f16x2_cvt(a, b):
        """fp16 bits of a (low half) and b (high half) as CUDA's conversion writes them: NaN ->
        0x7FFF."""
        return _U32(_cvt_nan(f32_f16_bits(a), a) | (_cvt_nan(f32_f16_bits(b), b) << 16))

    def ld_u32_at(p, off):
        """One uint32 word at byte offset `off` (4-byte aligned) of pointer p."""
        return _U32(_words_at(p, off, 1)[0])

    def ld_v2_at(p, off):
        """Two uint32 words at byte offset `off` (8-byte aligned) of pointer p."""
        w = _words_at(p, off, 2)
        return _U32(w[0]), _U32(w[1])
else:
    def _fp8x4_intrinsic(kind):
        # cvt.rn.f16x2.<fp8>x2 puts the low byte of its 16-bit source in the low half; every
        # FP8 value is exact in fp16, and fp16 -> fp32 is exact.
        text = ("{\n.reg .b16 l, h, e0, e1, e2, e3;\n.reg .b32 p, q;\n"
                "mov.b32 {l, h}, $4;\n"
                f"cvt.rn.f16x2.{kind}x2 p, l;\n"
                f"cvt.rn.f16x2.{kind}x2 q, h;\n"
                "mov.b32 {e0, e1}, p;\n"
                "mov.b32 {e2, e3}, q;\n"
                "cvt.f32.f16 $0, e0;\ncvt.f32.f16 $1, e1;\n"
                "cvt.f32.f16 $2, e2;\ncvt.f32.f16 $3, e3;\n}")

        @intrinsic
        def fp8x4(typingctx, w):
            sig = types.UniTuple(types.float32, 4)(types.uint32)

            def codegen(context, builder, sig, args):
                st = ir.LiteralStructType([_F32] * 4)
                r = _asm(builder, st, [args[0]], text, "=f,=f,=f,=f,r")
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(r, k) for k in range(4)])
            return sig, codegen
        return fp8x4

    e4m3x4_f32 = _fp8x4_intrinsic("e4m3")
    e5m2x4_f32 = _fp8x4_intrinsic("e5m2")

    def _pack16x2_qnan_intrinsic(kind, qnan_word):
        # cvt.rn.<kind>x2.f32 d, hi, lo; then every NaN half (set.nan gives 0xFFFF there) is
        # replaced by the quiet-NaN half: d ^ ((d ^ Q) & mask).
        text = ("{\n.reg .b32 d, m, t;\n"
                f"cvt.rn.{kind}x2.f32 d, $2, $1;\n"
                f"set.nan.u32.{kind}x2 m, d, d;\n"
                f"xor.b32 t, d, {qnan_word};\n"
                "and.b32 t, t, m;\n"
                "xor.b32 $0, d, t;\n}")

        @intrinsic
        def pack(typingctx, a, b):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig, args):
                return _asm(builder, _I32, list(args), text, "=r,f,f")
            return sig, codegen
        return pack

    bf16x2_pack = _pack16x2_qnan_intrinsic("bf16", "0x7FC07FC0")
    f16x2_pack = _pack16x2_qnan_intrinsic("f16", "0x7E007E00")

    # cvt.rn.<kind>x2.f32 d, hi, lo as it is: a NaN becomes 0x7FFF (torch's CUDA bytes)
    bf16x2_cvt = _word_of_two("cvt.rn.bf16x2.f32 $0, $2, $1;", types.float32, "f")
    f16x2_cvt = _word_of_two("cvt.rn.f16x2.f32 $0, $2, $1;", types.float32, "f")

    def _ld_at_intrinsic(n):
        if n == 1:
            text, constraints = "ld.global.nc.u32 $0, [$1];", "=r,l"
        else:
            text, constraints = "ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l"

        @intrinsic
        def ld_at(typingctx, p, off):
            ret = types.uint32 if n == 1 else types.UniTuple(types.uint32, n)
            sig = ret(p, off)

            def codegen(context, builder, sig, args):
                addr = _byte_addr(builder, args[0], args[1])
                if n == 1:
                    return _asm(builder, _I32, [addr], text, constraints)
                r = _asm(builder, ir.LiteralStructType([_I32] * n), [addr], text, constraints)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(r, k) for k in range(n)])
            return sig, codegen
        return ld_at

    ld_u32_at = _ld_at_intrinsic(1)
    ld_v2_at = _ld_at_intrinsic(2)


def fp8x4_f32(fmt_is_e4m3):
    """The FP8 word decoder of a format: e4m3x4_f32 or e5m2x4_f32."""
    return e4m3x4_f32 if fmt_is_e4m3 else e5m2x4_f32


__all__ += ["e4m3x4_f32", "e5m2x4_f32", "fp8x4_f32", "bf16x2_pack", "f16x2_pack", "bf16x2_cvt",
            "f16x2_cvt", "ld_u32_at",
            "ld_v2_at"]


# ------------------------------------------------------------------------------------------
# Narrow stores at byte offsets of a uint8 pointer, and a pointer's address: the rows of a
# (K, M) byte array with M % 16 != 0 start at every alignment, so a kernel writing them finds
# each row's alignment from the address and uses the widest store that fits
# (_kernel_lib.tile_row_storer; its 8- and 16-byte stores are st_v2_at / st_v4_at).
#   * addr_of(p): the address of pointer p as uint64 (simulator: of the simulated buffer);
#   * st8_u8 / st8_u16 / st8_u32(p, off, v): the low 1 / 2 / 4 bytes of uint32 v at byte
#     offset `off` of uint8 pointer p (address aligned to the size; the simulator checks it).

if SIM:
    def addr_of(p):
        """Address of pointer p (the simulated array's buffer)."""
        return np.uint64(p.ctypes.data)

    def _st8(p, off, v, nbytes):
        off = int(off)
        assert (int(p.ctypes.data) + off) % nbytes == 0, f"misaligned {nbytes}-byte store"
        for i in range(nbytes):
            p[off + i] = (int(v) >> (8 * i)) & 0xFF

    def st8_u8(p, off, v):
        """Store the low byte of v at byte offset off of uint8 pointer p."""
        _st8(p, off, v, 1)

    def st8_u16(p, off, v):
        """Store the low 2 bytes of v at byte offset off (2-byte aligned address)."""
        _st8(p, off, v, 2)

    st8_u32 = st_u32_at
else:
    @intrinsic
    def addr_of(typingctx, p):
        """Address of pointer p as uint64."""
        def codegen(context, builder, sig, args):
            return builder.ptrtoint(args[0], ir.IntType(64))
        return types.uint64(p), codegen

    def _st8_scalar_intrinsic(bits):
        text = f"st.global.u{bits} [$0], $1;"
        constraints = "l," + ("h" if bits < 32 else "r") + ",~{memory}"

        @intrinsic
        def st8(typingctx, p, off, v):
            sig = types.void(p, off, types.uint32)

            def codegen(context, builder, sig, args):
                v = args[2] if bits == 32 else builder.trunc(args[2], _I16)
                _asm(builder, ir.VoidType(), [_index_addr(builder, args[0], args[1]), v],
                     text, constraints, True)
                return context.get_dummy_value()
            return sig, codegen
        return st8

    st8_u8 = _st8_scalar_intrinsic(8)
    st8_u16 = _st8_scalar_intrinsic(16)
    st8_u32 = _st8_scalar_intrinsic(32)

__all__ += ["addr_of", "st8_u8", "st8_u16", "st8_u32"]
