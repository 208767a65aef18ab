"""What the hardware's cvt.rn.satfinite.e4m3x2 / e5m2x2 (the kernels' FP8 conversion) writes
for NaN inputs, raw and after x * 1.0: a one-thread-per-input kernel written with the kernels'
Numba room. On the H200 (numba-cuda 0.30.4) every input below -- 0x7FC00000, 0xFFC00000,
0x7F800001, 0xFFFFFFFF, 0xFF800001, 0x7FFFFFFF -- gives 0x7F in both formats, raw and after the
multiply: the quantize kernels' NaN rule does not depend on the sign or payload.

    python3 -m bench.profile.nan_probe
"""
import json

import cupy
import numpy as np


def log(*a):
    print(*a, flush=True)


def nan_probe():
    """{input bits: bytes written} for the NaN inputs above."""
    from fp8blk.kernels._numba import (bits_f32, compile_kernel, cuda, pack4_e4m3, pack4_e5m2,
                                       ptr, types)

    def k(src, dst, one):
        i = cuda.threadIdx.x
        v = bits_f32(src[i])
        dst[4 * i] = pack4_e4m3(v, v, v, v)
        dst[4 * i + 1] = pack4_e5m2(v, v, v, v)
        w = v * bits_f32(one[0])
        dst[4 * i + 2] = pack4_e4m3(w, w, w, w)
        dst[4 * i + 3] = pack4_e5m2(w, w, w, w)
    fn = compile_kernel(k, (ptr(types.uint32), ptr(types.uint32), ptr(types.uint32)))
    vals = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0xFF800001, 0x7FFFFFFF]
    src = cupy.asarray(np.array(vals, dtype=np.uint32))
    dst = cupy.zeros(4 * len(vals), dtype=np.uint32)
    one = cupy.asarray(np.array([0x3F800000], dtype=np.uint32))
    fn((1, 1, 1), (len(vals), 1, 1), (src, dst, one))
    d = dst.get().reshape(len(vals), 4)
    out = {}
    for v, row in zip(vals, d):
        out[f"0x{v:08X}"] = {"e4m3_raw": f"0x{row[0] & 0xFF:02X}",
                             "e5m2_raw": f"0x{row[1] & 0xFF:02X}",
                             "e4m3_after_mul1": f"0x{row[2] & 0xFF:02X}",
                             "e5m2_after_mul1": f"0x{row[3] & 0xFF:02X}"}
        log("  nan probe", f"0x{v:08X}", out[f"0x{v:08X}"])
    return out


if __name__ == "__main__":
    print(json.dumps(nan_probe(), indent=1))
