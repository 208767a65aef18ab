#!/usr/bin/env python3
"""Probe cuBLASLt algorithms for block-scaled FP8 GEMMs (sm_90, 1x128 / 128x128 fp32 scales)
through ctypes, against torch._scaled_mm on the same operands.

Standalone: needs torch (CUDA) only. Enum values are parsed at run time from the cublasLt.h /
cublas_api.h / library_types.h that sit next to the libcublasLt torch has loaded (the nvidia
wheel's include/ dir), falling back to the CUDA toolkit's headers, then to built-in values.

GEMM convention (the "TN" form torch uses): out (Ra, Rb) = a (Ra, K) @ b (Rb, K)^T, both
row-major.  In cuBLAS column-major terms: D^T (Rb x Ra, ld Rb) = op(A) op(B) with
A = b's bytes (K x Rb col-major, ld K, TRANSA=T) and B = a's bytes (K x Ra, ld K, TRANSB=N),
m = Rb, n = Ra, k = K.  A's scale is b's, B's scale is a's (torch swaps them the same way).
Scale memory (as torch takes it, see fp8blk/torch/scaled_mm.py cuda_scaled_mm):
  1x128   of an (R, K) operand: fp32 (K/128, R) contiguous, entry [kb, r]
  128x128 of an (R, K) operand: fp32 (R/128, K/128) contiguous, entry [rt, kt]

Usage: python3 -m bench.profile.probe_cublaslt_algos [--shapes 16384,8192,8192 ...] [--gemms fwd,dgrad,wgrad]
       [--enum first|all|none] [--reps 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes as C
import glob
import json
import os
import re
import statistics
import tempfile
import time

import torch

# ---------------------------------------------------------------------------------------------
# library + headers
# ---------------------------------------------------------------------------------------------


def loaded_cublaslt_path():
    a = torch.ones(8, 8, device="cuda")
    (a @ a).sum().item()
    for line in open("/proc/self/maps"):
        if "libcublasLt.so" in line:
            return line.split()[-1]
    return None


def header_dirs(libpath):
    dirs = []
    if libpath:
        d = os.path.dirname(os.path.realpath(libpath))
        dirs += [os.path.join(d, "..", "include"), os.path.join(d, "..", "..", "include")]
    sp = os.path.dirname(os.path.dirname(torch.__file__))
    dirs += glob.glob(os.path.join(sp, "nvidia", "*", "include"))
    dirs += glob.glob(os.path.join(sp, "nvidia", "include"))
    dirs += ["/usr/local/cuda/include", "/usr/local/cuda/targets/x86_64-linux/include",
             "/usr/include"]
    out = []
    for d in dirs:
        d = os.path.realpath(d)
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def find_header(name, dirs):
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_enums(text, vals, enums):
    text = strip_comments(text)
    for m in re.finditer(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        body, ename = m.group(1), m.group(2)
        cur = -1
        d = enums.setdefault(ename, {})
        for item in body.split(","):
            item = item.strip()
            if not item:
                continue
            km = re.match(r"(\w+)", item)
            if not km:
                continue
            k = km.group(1)
            if "=" in item:
                v = item.split("=", 1)[1].strip()
                v = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", v)
                try:
                    cur = int(eval(v, {"__builtins__": {}}, dict(vals)))
                except Exception:
                    continue
            else:
                cur += 1
            vals[k] = cur
            d[k] = cur


# built-in fallbacks (cuBLAS 12.9 / 13.0 headers); every value used is printed with its source
FALLBACK = dict(
    CUDA_R_32F=0, CUDA_R_16BF=14, CUDA_R_8F_E4M3=28, CUBLAS_COMPUTE_32F=68, CUBLAS_OP_N=0,
    CUBLAS_OP_T=1,
    CUBLASLT_MATMUL_DESC_TRANSA=3, CUBLASLT_MATMUL_DESC_TRANSB=4,
    CUBLASLT_MATMUL_DESC_A_SCALE_POINTER=17, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER=18,
    CUBLASLT_MATMUL_DESC_FAST_ACCUM=25, CUBLASLT_MATMUL_DESC_A_SCALE_MODE=31,
    CUBLASLT_MATMUL_DESC_B_SCALE_MODE=32,
    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F=4, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F=5,
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES=1,
    CUBLASLT_ALGO_CONFIG_ID=0, CUBLASLT_ALGO_CONFIG_TILE_ID=1,
    CUBLASLT_ALGO_CONFIG_SPLITK_NUM=2, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME=3,
    CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING=4, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION=5,
    CUBLASLT_ALGO_CONFIG_STAGES_ID=6, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID=7,
    CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID=8,
    CUBLASLT_ALGO_CAP_SPLITK_SUPPORT=0, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK=1,
    CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT=2, CUBLASLT_ALGO_CAP_TILE_IDS=6,
    CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX=7, CUBLASLT_ALGO_CAP_STAGES_IDS=13,
)

E = {}          # name -> value actually used
SRC = {}        # name -> where it came from
ENUMS = {}      # enum type name -> {name: value}


def load_constants(libpath):
    dirs = header_dirs(libpath)
    vals = {}
    hdrs = {}
    for h in ("library_types.h", "cublas_api.h", "cublasLt.h"):
        p = find_header(h, dirs)
        hdrs[h] = p
        if p:
            parse_enums(open(p, errors="replace").read(), vals, ENUMS)
    for k, v in FALLBACK.items():
        if k in vals:
            E[k], SRC[k] = vals[k], "header"
            if vals[k] != v:
                SRC[k] = f"header (differs from built-in {v})"
        else:
            E[k], SRC[k] = v, "BUILT-IN FALLBACK"
    for k, v in vals.items():
        E.setdefault(k, v)
    return hdrs, dirs


def rev(enum_name, value):
    for k, v in ENUMS.get(enum_name, {}).items():
        if v == value:
            return k
    return str(value)


def short(name, prefix):
    return name[len(prefix):] if name.startswith(prefix) else name


# ---------------------------------------------------------------------------------------------
# ctypes bindings
# ---------------------------------------------------------------------------------------------


class Algo(C.Structure):
    _fields_ = [("data", C.c_uint64 * 8)]


class HeurResult(C.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", C.c_size_t), ("state", C.c_int),
                ("wavesCount", C.c_float), ("reserved", C.c_int * 4)]


vp, i32, sz = C.c_void_p, C.c_int, C.c_size_t


def bind(path):
    lt = C.CDLL(path)
    sig = {
        "cublasLtGetVersion": (sz, []),
        "cublasLtGetCudartVersion": (sz, []),
        "cublasLtCreate": (i32, [C.POINTER(vp)]),
        "cublasLtMatmulDescCreate": (i32, [C.POINTER(vp), i32, i32]),
        "cublasLtMatmulDescDestroy": (i32, [vp]),
        "cublasLtMatmulDescSetAttribute": (i32, [vp, i32, vp, sz]),
        "cublasLtMatrixLayoutCreate": (i32, [C.POINTER(vp), i32, C.c_uint64, C.c_uint64,
                                             C.c_int64]),
        "cublasLtMatrixLayoutDestroy": (i32, [vp]),
        "cublasLtMatmulPreferenceCreate": (i32, [C.POINTER(vp)]),
        "cublasLtMatmulPreferenceDestroy": (i32, [vp]),
        "cublasLtMatmulPreferenceSetAttribute": (i32, [vp, i32, vp, sz]),
        "cublasLtMatmulAlgoGetHeuristic": (i32, [vp, vp, vp, vp, vp, vp, vp, i32,
                                                 C.POINTER(HeurResult), C.POINTER(i32)]),
        "cublasLtMatmul": (i32, [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                 C.POINTER(Algo), vp, sz, vp]),
        "cublasLtMatmulAlgoConfigGetAttribute": (i32, [C.POINTER(Algo), i32, vp, sz,
                                                       C.POINTER(sz)]),
        "cublasLtMatmulAlgoConfigSetAttribute": (i32, [C.POINTER(Algo), i32, vp, sz]),
        "cublasLtMatmulAlgoCapGetAttribute": (i32, [C.POINTER(Algo), i32, vp, sz,
                                                    C.POINTER(sz)]),
        "cublasLtMatmulAlgoGetIds": (i32, [vp, i32, i32, i32, i32, i32, i32, i32,
                                           C.POINTER(i32), C.POINTER(i32)]),
        "cublasLtMatmulAlgoInit": (i32, [vp, i32, i32, i32, i32, i32, i32, i32,
                                         C.POINTER(Algo)]),
        "cublasLtMatmulAlgoCheck": (i32, [vp, vp, vp, vp, vp, vp, C.POINTER(Algo),
                                          C.POINTER(HeurResult)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lt, name)
        f.restype, f.argtypes = res, args
    return lt


LT = None


def ck(st, what):
    if st != 0:
        raise RuntimeError(f"{what} -> cublasStatus {st}")


def set_attr(setter, obj, attr, value, ctype):
    buf = ctype(value)
    ck(setter(obj, attr, C.byref(buf), C.sizeof(buf)), f"SetAttribute({attr}={value})")


def cfg_get(algo, attr):
    n = sz(0)
    if LT.cublasLtMatmulAlgoConfigGetAttribute(C.byref(algo), attr, None, 0, C.byref(n)) != 0:
        return None
    buf = (C.c_uint8 * max(n.value, 1))()
    w = sz(0)
    if LT.cublasLtMatmulAlgoConfigGetAttribute(C.byref(algo), attr, buf, n.value,
                                               C.byref(w)) != 0:
        return None
    return int.from_bytes(bytes(buf)[: w.value], "little", signed=(attr == 0))


def cfg_size(algo, attr):
    n = sz(0)
    LT.cublasLtMatmulAlgoConfigGetAttribute(C.byref(algo), attr, None, 0, C.byref(n))
    return n.value


def cfg_set(algo, attr, value):
    n = cfg_size(algo, attr)
    if n == 0:
        return -1
    buf = (C.c_uint8 * n).from_buffer_copy(int(value).to_bytes(n, "little", signed=(attr == 0)))
    return LT.cublasLtMatmulAlgoConfigSetAttribute(C.byref(algo), attr, buf, n)


def cap_get(algo, attr, elem=4):
    n = sz(0)
    if LT.cublasLtMatmulAlgoCapGetAttribute(C.byref(algo), attr, None, 0, C.byref(n)) != 0:
        return None
    if n.value == 0:
        return []
    buf = (C.c_uint8 * n.value)()
    w = sz(0)
    if LT.cublasLtMatmulAlgoCapGetAttribute(C.byref(algo), attr, buf, n.value,
                                            C.byref(w)) != 0:
        return None
    b = bytes(buf)[: w.value]
    return [int.from_bytes(b[i:i + elem], "little") for i in range(0, len(b), elem)]


CFG_FIELDS = [("id", "CUBLASLT_ALGO_CONFIG_ID"), ("tile", "CUBLASLT_ALGO_CONFIG_TILE_ID"),
              ("stages", "CUBLASLT_ALGO_CONFIG_STAGES_ID"),
              ("splitk", "CUBLASLT_ALGO_CONFIG_SPLITK_NUM"),
              ("red", "CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME"),
              ("swz", "CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING"),
              ("custom", "CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION"),
              ("inner", "CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID"),
              ("cluster", "CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID")]


def algo_config(algo):
    return {f: cfg_get(algo, E[a]) for f, a in CFG_FIELDS}


def cfg_str(c):
    tile = short(rev("cublasLtMatmulTile_t", c["tile"]), "CUBLASLT_MATMUL_TILE_")
    st = short(rev("cublasLtMatmulStages_t", c["stages"]), "CUBLASLT_MATMUL_STAGES_")
    cl = short(rev("cublasLtClusterShape_t", c["cluster"]), "CUBLASLT_CLUSTER_SHAPE_")
    return (f"id={c['id']} tile={tile} st={st} cl={cl} sk={c['splitk']} red={c['red']} "
            f"swz={c['swz']} cu={c['custom']} in={c['inner']}")


# ---------------------------------------------------------------------------------------------
# one GEMM problem
# ---------------------------------------------------------------------------------------------


def rand_fp8(r, k, gen):
    return (torch.randn(r, k, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)


def rand_scale(shape, gen):
    e = torch.randint(-3, 3, shape, device="cuda", generator=gen).float()
    return torch.exp2(e) * (1 + torch.rand(shape, device="cuda", generator=gen) * 0.5)


class Problem:
    """out (Ra, Rb) = a (Ra, K) @ b (Rb, K)^T; a 1x128, b 1x128 or 128x128."""

    def __init__(self, name, ra, rb, k, b_blocks, seed=0, swap=False):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.name, self.ra, self.rb, self.k, self.b_blocks = name, ra, rb, k, b_blocks
        self.a = rand_fp8(ra, k, g)
        self.b = rand_fp8(rb, k, g)
        self.sa = rand_scale((k // 128, ra), g)                  # 1x128: [kb, r]
        if b_blocks == "128x128":
            self.sb = rand_scale((rb // 128, k // 128), g)       # [rt, kt]
            self.sb_torch = self.sb.t()
            self.b_mode = E["CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F"]
        else:
            self.sb = rand_scale((k // 128, rb), g)              # [kb, r]
            self.sb_torch = self.sb
            self.b_mode = E["CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F"]
        self.flops = 2.0 * ra * rb * k
        self.swap = swap
        # swap: cuBLAS A = a, B = b -> column-major D (ra x rb) = out^T row-major (rb, ra)
        self.out = torch.empty((rb, ra) if swap else (ra, rb), dtype=torch.bfloat16,
                               device="cuda")
        self.ref = None
        self.alpha, self.beta = C.c_float(1.0), C.c_float(0.0)
        self._make_descs()

    def torch_mm(self):
        return torch._scaled_mm(self.a, self.b.t(), self.sa.t(), self.sb_torch,
                                out_dtype=torch.bfloat16)

    def _make_descs(self):
        d = vp()
        ck(LT.cublasLtMatmulDescCreate(C.byref(d), E["CUBLAS_COMPUTE_32F"], E["CUDA_R_32F"]),
           "MatmulDescCreate")
        s = LT.cublasLtMatmulDescSetAttribute
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_TRANSA"], E["CUBLAS_OP_T"], C.c_int32)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_TRANSB"], E["CUBLAS_OP_N"], C.c_int32)
        vec = E["CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F"]
        (sA, mA), (sB, mB) = ((self.sb, self.b_mode), (self.sa, vec))
        if self.swap:
            (sA, mA), (sB, mB) = (sB, mB), (sA, mA)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_A_SCALE_POINTER"], sA.data_ptr(), vp)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_B_SCALE_POINTER"], sB.data_ptr(), vp)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_FAST_ACCUM"], 0, C.c_int8)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_A_SCALE_MODE"], mA, C.c_int32)
        set_attr(s, d, E["CUBLASLT_MATMUL_DESC_B_SCALE_MODE"], mB, C.c_int32)
        self.desc = d

        def lay(t, rows, cols, ld):
            L = vp()
            ck(LT.cublasLtMatrixLayoutCreate(C.byref(L), t, rows, cols, ld), "LayoutCreate")
            return L
        f8, bf = E["CUDA_R_8F_E4M3"], E["CUDA_R_16BF"]
        m, n = (self.ra, self.rb) if self.swap else (self.rb, self.ra)
        self.Ad = lay(f8, self.k, m, self.k)
        self.Bd = lay(f8, self.k, n, self.k)
        self.Cd = lay(bf, m, n, m)
        self.Dd = lay(bf, m, n, m)
        self.pA, self.pB = ((self.a, self.b) if self.swap else (self.b, self.a))

    def heuristic(self, n, ws_bytes):
        p = vp()
        ck(LT.cublasLtMatmulPreferenceCreate(C.byref(p)), "PrefCreate")
        set_attr(LT.cublasLtMatmulPreferenceSetAttribute, p,
                 E["CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES"], ws_bytes, C.c_uint64)
        res = (HeurResult * n)()
        cnt = i32(0)
        st = LT.cublasLtMatmulAlgoGetHeuristic(Handle, self.desc, self.Ad, self.Bd, self.Cd,
                                               self.Dd, p, n, res, C.byref(cnt))
        LT.cublasLtMatmulPreferenceDestroy(p)
        if st != 0:
            print(f"  cublasLtMatmulAlgoGetHeuristic -> status {st} (no algorithm)")
            return []
        return [res[i] for i in range(cnt.value)]

    def check(self, algo):
        r = HeurResult()
        st = LT.cublasLtMatmulAlgoCheck(Handle, self.desc, self.Ad, self.Bd, self.Cd, self.Dd,
                                        C.byref(algo), C.byref(r))
        return st, r

    def run(self, algo, ws, ws_bytes):
        st = LT.cublasLtMatmul(Handle, self.desc, C.byref(self.alpha), self.pA.data_ptr(),
                               self.Ad, self.pB.data_ptr(), self.Bd, C.byref(self.beta),
                               self.pA.data_ptr(), self.Cd, self.out.data_ptr(), self.Dd,
                               C.byref(algo), ws.data_ptr(), ws_bytes,
                               torch.cuda.current_stream().cuda_stream)
        if st != 0:
            raise RuntimeError(f"cublasLtMatmul -> {st}")


def bench(fn, warm, reps):
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


def compare(out, ref):
    if torch.equal(out, ref):
        return "bitwise", 0.0, 0
    d = (out.float() - ref.float()).abs()
    return "DIFF", float(d.max()), int((out != ref).sum())


def kernel_names(fns):
    """One kernel-name list per fn, from a torch.profiler CUDA trace (fill kernels as markers)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        marker = torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for f in fns:
                marker.fill_(1.0)
                f()
            marker.fill_(1.0)
            torch.cuda.synchronize()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
        os.unlink(path)
        ks = sorted((e["ts"], e["name"]) for e in ev if e.get("cat") == "kernel")
        groups, cur = [], None
        for _, n in ks:
            if "FillFunctor" in n:
                if cur is not None:
                    groups.append(cur)
                cur = []
            elif cur is not None:
                cur.append(n)
        return groups if len(groups) == len(fns) else None
    except Exception as ex:  # noqa: BLE001
        print(f"  (kernel-name profiling failed: {ex!r})")
        return None


def kshort(names):
    if not names:
        return "?"
    out = []
    for n in names:
        m = re.search(r"(nvjet\w+|sm90\w+|cutlass\w+|\w*gemm\w*|\w*splitK\w*|\w*reduce\w*)", n)
        out.append(m.group(1) if m else n[:60])
    return "+".join(out)


# ---------------------------------------------------------------------------------------------
# enumeration outside the heuristic: AlgoGetIds + AlgoInit + caps + config + AlgoCheck
# ---------------------------------------------------------------------------------------------


def cfg_key(c):
    return tuple(c[f] for f, _ in CFG_FIELDS)


TILE_DIMS = {64, 96, 128, 160, 192, 256}


def enumerate_configs(pb, budget_s, ws_bytes, verbose, only_ids=None, all_tiles=False,
                      splitks=(1,)):
    """Every (algo id, tile, stages, cluster, custom option) that AlgoCheck accepts, for
    tiles with both dims in TILE_DIMS; splitK=1, no swizzle (cap says unsupported)."""
    t0 = time.time()
    ids = (i32 * 512)()
    cnt = i32(0)
    f8, bf = E["CUDA_R_8F_E4M3"], E["CUDA_R_16BF"]
    args = (E["CUBLAS_COMPUTE_32F"], E["CUDA_R_32F"], f8, f8, bf, bf)
    st = LT.cublasLtMatmulAlgoGetIds(Handle, *args, 512, ids, C.byref(cnt))
    idl = [ids[i] for i in range(cnt.value)]
    if only_ids:
        idl = [i for i in idl if i in only_ids]
    if verbose:
        print(f"  AlgoGetIds status={st} -> {len(idl)} ids: {idl}")
    found, ntried, per_id_stats = [], 0, {}
    clusters = list(ENUMS.get("cublasLtClusterShape_t", {}).items())
    clusters = [v for k, v in clusters if re.search(r"_(AUTO|1x1x1|2x1x1|1x2x1|2x2x1|4x1x1|"
                                                     r"1x4x1|4x2x1|2x4x1)$", k)]
    def space(aid):
        a = Algo()
        if LT.cublasLtMatmulAlgoInit(Handle, *args, aid, C.byref(a)) != 0:
            return 0
        return (len(cap_get(a, E["CUBLASLT_ALGO_CAP_TILE_IDS"]) or [0])
                * len(cap_get(a, E["CUBLASLT_ALGO_CAP_STAGES_IDS"]) or [0])
                * ((cap_get(a, E["CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX"]) or [0])[0] + 1))
    idl.sort(key=space)          # small search spaces first; leftover time rolls over
    for n_id, aid in enumerate(idl):
        t_id = time.time()
        per_id = max(0.2, (budget_s - (t_id - t0)) / (len(idl) - n_id))
        algo = Algo()
        if LT.cublasLtMatmulAlgoInit(Handle, *args, aid, C.byref(algo)) != 0:
            continue
        tiles = cap_get(algo, E["CUBLASLT_ALGO_CAP_TILE_IDS"]) or [0]
        keep = []
        for t in tiles:
            m = re.search(r"_(\d+)x(\d+)$", rev("cublasLtMatmulTile_t", t))
            if t == 0 or (m and (all_tiles and int(m.group(1)) >= 64 and int(m.group(2)) >= 64)
                          or (m and int(m.group(1)) in TILE_DIMS and int(m.group(2)) in TILE_DIMS)):
                keep.append(t)
        stages = cap_get(algo, E["CUBLASLT_ALGO_CAP_STAGES_IDS"]) or [0]
        cmax = (cap_get(algo, E["CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX"]) or [0])[0]
        has_cl = cfg_size(algo, E["CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID"]) > 0
        n_before, n_chk, hit = len(found), 0, False
        for t in keep:
            for sg in stages:
                for cl in (clusters if has_cl else [None]):
                    for cu, sk in ((c, k) for c in range(cmax + 1) for k in splitks):
                        if time.time() - t_id > per_id:
                            hit = True
                            break
                        a2 = Algo()
                        LT.cublasLtMatmulAlgoInit(Handle, *args, aid, C.byref(a2))
                        if sk != 1:
                            cfg_set(a2, E["CUBLASLT_ALGO_CONFIG_SPLITK_NUM"], sk)
                        cfg_set(a2, E["CUBLASLT_ALGO_CONFIG_TILE_ID"], t)
                        cfg_set(a2, E["CUBLASLT_ALGO_CONFIG_STAGES_ID"], sg)
                        cfg_set(a2, E["CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION"], cu)
                        if cl is not None:
                            cfg_set(a2, E["CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID"], cl)
                        n_chk += 1
                        s2, r2 = pb.check(a2)
                        if s2 == 0 and r2.workspaceSize <= ws_bytes:
                            found.append((a2, r2.workspaceSize, r2.wavesCount))
        ntried += n_chk
        per_id_stats[aid] = dict(tiles_cap=len(tiles), tiles_tried=len(keep),
                                 stages=len(stages), custom_max=cmax, checks=n_chk,
                                 valid=len(found) - n_before, budget_hit=hit)
        if verbose:
            print(f"  id {aid}: {len(tiles)} tiles in cap ({len(keep)} tried), "
                  f"{len(stages)} stages, custom_max={cmax}, cluster cfg={has_cl}: "
                  f"{n_chk} checks, {len(found) - n_before} valid"
                  f"{' (per-id budget hit)' if hit else ''}")
    print(f"  enumeration: {ntried} AlgoCheck calls, {len(found)} accepted, "
          f"{time.time() - t0:.1f}s; per id: " + ", ".join(
              f"{k}:{v['valid']}/{v['checks']}" for k, v in per_id_stats.items()))
    return found, ntried, per_id_stats


def round_robin(fns, rounds):
    """Median and min time (us) of each fn: one call per event pair, calls interleaved across
    fns in rotating order, no sync until the end (the GPU queue stays full, so host launch
    latency is not timed)."""
    for f in fns:
        f()
    evs = [[] for _ in fns]
    n = len(fns)
    for r in range(rounds):
        for j in range(n):
            i = (j + r) % n
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[i]()
            e.record()
            evs[i].append((s, e))
    torch.cuda.synchronize()
    ts = [[s.elapsed_time(e) * 1e3 for s, e in ev] for ev in evs]
    return [statistics.median(t) for t in ts], [min(t) for t in ts]


def host_us(fn, n=40):
    """Host (CPU) time per call with the GPU queue kept busy."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return dt * 1e6


# ---------------------------------------------------------------------------------------------


def main():
    global LT, Handle
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["16384,8192,8192", "16384,4096,14336",
                                                     "8192,4096,4096"])
    ap.add_argument("--gemms", default="fwd,dgrad,wgrad")
    ap.add_argument("--nalgo", type=int, default=32)
    ap.add_argument("--ws-mib", type=int, default=32)
    ap.add_argument("--big-ws-mib", type=int, default=1024)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--enum", choices=["none", "first", "all"], default="all")
    ap.add_argument("--enum-budget-s", type=float, default=8.0)
    ap.add_argument("--final-n", type=int, default=6,
                    help="fastest candidates re-timed round-robin with torch")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--show", type=int, default=8, help="extra timed rows printed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--swap", action="store_true",
                    help="swap cuBLAS operands (A = a, B = b): computes out^T")
    ap.add_argument("--enum-ids", default="", help="comma list of algo ids to enumerate")
    ap.add_argument("--all-tiles", action="store_true", help="every tile in the cap")
    ap.add_argument("--splitk", default="1", help="split-K values to enumerate, e.g. 1,2,4")
    ap.add_argument("--dump-header", action="store_true")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    libpath = loaded_cublaslt_path()
    print(f"torch {torch.__version__} cuda {torch.version.cuda} dev "
          f"{torch.cuda.get_device_name()}")
    print(f"libcublasLt loaded by torch: {libpath} -> {os.path.realpath(libpath)}")
    LT = bind(libpath)
    print(f"cublasLtGetVersion() = {LT.cublasLtGetVersion()}  "
          f"cublasLtGetCudartVersion() = {LT.cublasLtGetCudartVersion()}")
    hdrs, dirs = load_constants(libpath)
    print(f"header search dirs: {dirs}")
    for h, p in hdrs.items():
        print(f"header {h}: {p}")
    vh = find_header("cublas_api.h", dirs)
    for cand in (find_header("cublas_version.h", dirs), vh):
        if cand:
            for line in open(cand, errors="replace"):
                if re.match(r"#define\s+CUBLAS_VER_(MAJOR|MINOR|PATCH|BUILD)\b", line):
                    print("  ", os.path.basename(cand), line.strip())
    print("constants used:")
    for k in FALLBACK:
        print(f"  {k:48s} = {E[k]:4d}   [{SRC[k]}]")
    for en in ("cublasLtMatmulMatrixScale_t",):
        print(f"  {en}: {ENUMS.get(en)}")
    if args.dump_header and hdrs.get("cublasLt.h"):
        txt = open(hdrs["cublasLt.h"], errors="replace").read()
        for pat in (r"typedef struct \{[^}]*\} cublasLtMatmulAlgo_t;",
                    r"typedef struct \{[^}]*\} cublasLtMatmulHeuristicResult_t;"):
            m = re.search(pat, txt, re.S)
            print(m.group(0) if m else f"(not found: {pat})")
        for k in ("CUBLASLT_MATMUL_DESC_A_SCALE_MODE", "CUBLASLT_MATMUL_DESC_B_SCALE_MODE",
                  "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER", "CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F",
                  "CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F"):
            for i, line in enumerate(txt.splitlines()):
                if re.search(r"\b" + k + r"\b\s*=", line):
                    print(f"  cublasLt.h:{i + 1}: {line.strip()}")
    print(f"sizeof(Algo)={C.sizeof(Algo)} sizeof(HeurResult)={C.sizeof(HeurResult)}")

    Handle = vp()
    ck(LT.cublasLtCreate(C.byref(Handle)), "cublasLtCreate")
    ws_bytes = args.ws_mib << 20
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    results = {"lib": os.path.realpath(libpath), "version": LT.cublasLtGetVersion(),
               "constants": {k: E[k] for k in FALLBACK}, "gemms": []}

    first = True
    for shp in args.shapes:
        M, K, N = (int(x) for x in shp.split(","))
        specs = {"fwd": (M, N, K, "128x128"), "dgrad": (M, K, N, "128x128"),
                 "wgrad": (N, K, M, "1x128")}
        for gname in args.gemms.split(","):
            ra, rb, kk, bb = specs[gname]
            title = (f"{gname} (M,K,N)=({M},{K},{N}): out ({ra},{rb}) = a({ra},{kk}) 1x128 @ "
                     f"b({rb},{kk})^T {bb}")
            print("\n" + "=" * 100 + "\n" + title)
            try:
                pb = Problem(gname, ra, rb, kk, bb, swap=args.swap)
                pb.ref = pb.torch_mm()
                if args.swap:
                    print("SWAPPED operands: cuBLAS A = a (1x128), B = b; output = out^T")
                    pb.ref = pb.ref.t().contiguous()
                torch.cuda.synchronize()
                heur = pb.heuristic(args.nalgo, ws_bytes)
                heur_big = pb.heuristic(args.nalgo, args.big_ws_mib << 20)
                print(f"heuristic: {len(heur)} algos with {args.ws_mib} MiB workspace, "
                      f"{len(heur_big)} with {args.big_ws_mib} MiB")
                cands, seen = [], set()
                for tagc, lst in (("h", heur), ("H", heur_big)):
                    for i, r in enumerate(lst):
                        k = cfg_key(algo_config(r.algo))
                        if k not in seen:
                            seen.add(k)
                            cands.append((f"{tagc}{i}", r.algo, r.workspaceSize, r.wavesCount))
                bigws = max([c[2] for c in cands] + [0])
                if bigws > ws.numel():
                    ws = torch.empty(bigws, dtype=torch.uint8, device="cuda")
                ws_n = ws.numel()
                do_enum = args.enum == "all" or (args.enum == "first" and first)
                ntried, idstats = 0, {}
                if do_enum:
                    found, ntried, idstats = enumerate_configs(
                        pb, args.enum_budget_s, ws_n, verbose=first,
                        only_ids=[int(x) for x in args.enum_ids.split(",")] if args.enum_ids
                        else None, all_tiles=args.all_tiles,
                        splitks=[int(x) for x in args.splitk.split(",")])
                    j = 0
                    for a2, wsz, wv in found:
                        k = cfg_key(algo_config(a2))
                        if k not in seen:
                            seen.add(k)
                            cands.append((f"e{j}", a2, wsz, wv))
                            j += 1
                rows, nwrong, t_h0 = [], 0, float("inf")
                t_chk = time.time()
                for tag, algo, wsz, wv in cands:
                    cfg = algo_config(algo)
                    row = dict(tag=tag, cfg=cfg, cfgs=cfg_str(cfg), ws=wsz, waves=wv, algo=algo)
                    try:
                        pb.out.fill_(float("nan"))
                        e0, e1 = (torch.cuda.Event(enable_timing=True),
                                  torch.cuda.Event(enable_timing=True))
                        e0.record()
                        pb.run(algo, ws, ws_n)
                        e1.record()
                        torch.cuda.synchronize()
                        t1 = e0.elapsed_time(e1) * 1e3
                        if tag == "h0":
                            t_h0 = t1
                        row["match"], row["maxdiff"], row["ndiff"] = compare(pb.out, pb.ref)
                        ok_num = row["match"] == "bitwise" or (
                            row["maxdiff"] <= 1e-2 * float(pb.ref.abs().max()))
                        if ok_num and t1 > 1.6 * t_h0:
                            row["us"], row["slow"] = t1, True     # one cold call: clearly slower
                        elif ok_num:
                            row["us"] = bench(lambda: pb.run(algo, ws, ws_n), 1, 3)
                        else:
                            nwrong += 1
                    except Exception as ex:  # noqa: BLE001
                        row["err"] = repr(ex)
                    rows.append(row)
                timed = sorted([r for r in rows if "us" in r], key=lambda r: r["us"])
                print(f"  {len(cands)} candidates: {len(timed)} numerically correct and timed, "
                      f"{nwrong} WRONG output, {sum('err' in r for r in rows)} errors "
                      f"({time.time() - t_chk:.1f}s)")
                wrong_ex = [r for r in rows if r.get("match") == "DIFF" and "us" not in r][:3]
                for r in wrong_ex:
                    print(f"    wrong e.g. {r['tag']}: maxdiff {r['maxdiff']:.3g} "
                          f"ndiff {r['ndiff']}  {r['cfgs']}")
                # final: torch + heuristic h0 + top-N by quick time, round-robin interleaved
                final = [r for r in rows if r["tag"] == "h0" and "us" in r]
                for r in timed:
                    if len(final) >= args.final_n + 1:
                        break
                    if r not in final:
                        final.append(r)
                fns = [pb.torch_mm] + [(lambda a=r["algo"]: pb.run(a, ws, ws_n)) for r in final]
                med, mn = round_robin(fns, args.rounds)
                names = kernel_names(fns)
                tt = med[0]
                h_t = host_us(pb.torch_mm)
                h_c = host_us(lambda: pb.run(final[0]["algo"], ws, ws_n)) if final else float("nan")
                h_h = host_us(lambda: pb.heuristic(1, ws_bytes), 20)
                print(f"host us/call: torch._scaled_mm {h_t:.1f}, ctypes cublasLtMatmul (cached algo) "
                      f"{h_c:.1f}, cublasLtMatmulAlgoGetHeuristic(1) alone {h_h:.1f}")
                for r, m, mi, nm in zip(final, med[1:], mn[1:], (names or [None] * 99)[1:]):
                    r["rr_us"], r["rr_min_us"] = m, mi
                    r["kernel"] = kshort(nm) if nm else "?"
                print(f"torch._scaled_mm: round-robin median {tt:.1f} us (min {mn[0]:.1f}), "
                      f"{pb.flops / tt / 1e6:.0f} TFLOP/s; kernel "
                      f"{kshort(names[0]) if names else '?'}")
                print(f"{'algo':>5} {'quick us':>9} {'RR med':>8} {'RR min':>8} {'TFLOP/s':>8} "
                      f"{'torch/x':>8} {'ws MiB':>7} {'waves':>6} {'match':>8}  config / kernel")
                shown = final + [r for r in timed if r not in final][: args.show]
                for r in shown:
                    rr = r.get("rr_us")
                    tf = pb.flops / (rr or r["us"]) / 1e6
                    print(f"{r['tag']:>5} {r['us']:9.1f} {rr or float('nan'):8.1f} "
                          f"{r.get('rr_min_us', float('nan')):8.1f} {tf:8.0f} "
                          f"{(tt / rr) if rr else float('nan'):8.3f} {r['ws'] / 2**20:7.1f} "
                          f"{r['waves']:6.2f} {r['match']:>8}  {r['cfgs']}  {r.get('kernel', '')}")
                for r in rows:
                    if r["tag"].startswith(("h", "H")) and r not in shown:
                        print(f"{r['tag']:>5} (heuristic) "
                              f"{'%.1f us' % r['us'] if 'us' in r else r.get('err', r.get('match'))}"
                              f"  {r['cfgs']}")
                best = min(final, key=lambda r: r["rr_us"]) if final else None
                if best:
                    print(f"BEST {best['tag']} {best['rr_us']:.1f} us "
                          f"({pb.flops / best['rr_us'] / 1e6:.0f} TFLOP/s) vs torch {tt:.1f} us "
                          f"-> {tt / best['rr_us']:.3f}x, {best['match']}; {best['cfgs']} "
                          f"{best.get('kernel', '')}")
                results["gemms"].append(dict(
                    gemm=gname, shape=[M, K, N], torch_rr_us=tt, torch_rr_min_us=mn[0],
                    host_us=dict(torch=h_t, ctypes=h_c, heuristic1=h_h),
                    torch_kernel=kshort(names[0]) if names else None, n_heur=len(heur),
                    n_heur_bigws=len(heur_big), n_enum_checked=ntried, enum_ids=idstats,
                    n_cands=len(cands), n_correct=len(timed), n_wrong=nwrong,
                    rows=[{k: v for k, v in r.items() if k != "algo"} for r in rows]))
                first = False
                del pb
                torch.cuda.empty_cache()
            except Exception as ex:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                results["gemms"].append(dict(gemm=gname, shape=[M, K, N], error=repr(ex)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


Handle = None

if __name__ == "__main__":
    main()
