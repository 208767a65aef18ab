"""``python -m fp8blk info``: versions, and whether a GPU is usable (if not, why and what to
install)."""
from __future__ import annotations

import sys

GPU_EXTRA = "pip install 'fp8blk[gpu]'"


def probe_gpu():
    """(cupy or None, why not, compute capability (major, minor) or None): the kernels run when
    CuPy is installed, a CUDA driver answers and it sees a device of compute capability 8.9 or
    newer. `why not` is "" when they do."""
    try:
        import cupy
    except ImportError:
        return None, f"CuPy is not installed ({GPU_EXTRA})", None
    except Exception as exc:  # a broken CuPy install (missing CUDA libraries)
        return None, f"CuPy does not import: {type(exc).__name__}: {exc} ({GPU_EXTRA})", None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorNoDevice, cudaErrorInsufficientDriver, no libcuda
        text = str(exc)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return None, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)", None
        return None, (f"no usable CUDA driver ({type(exc).__name__}: {text}); install the "
                      f"NVIDIA driver"), None
    if count < 1:
        return None, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)", None
    from ..kernels.prebuild import MIN_CC

    cc_text = cupy.cuda.Device().compute_capability
    cc = (int(cc_text[:-1]), int(cc_text[-1]))
    if cc < MIN_CC:
        return None, (f"the GPU has compute capability {cc[0]}.{cc[1]}; the kernels need "
                      f"{MIN_CC[0]}.{MIN_CC[1]} or newer (sm_89, sm_90, sm_100, sm_120)"), cc
    return cupy, "", cc


def gpu_module():
    """CuPy if the kernels can run on its current device, else None."""
    return probe_gpu()[0]


def run(args) -> int:
    import ml_dtypes
    import numpy as np

    import fp8blk as fb

    print(f"fp8blk {fb.__version__}, python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}")
    for name in ("numba", "numba_cuda", "cupy", "mpi4py", "torch"):
        try:
            module = __import__(name)
            print(f"  {name:<11}{getattr(module, '__version__', '?')}")
        except Exception as exc:  # optional dependencies
            print(f"  {name:<11}not available ({type(exc).__name__})")
    cupy, why, cc = probe_gpu()
    if cupy is not None:
        print(f"  GPU        yes: {_device_name(cupy)}, compute capability {cc[0]}.{cc[1]}")
    else:
        print(f"  GPU        no: {why}; fp8blk runs on the CPU (NumPy reference)")
    return 0


def _device_name(cupy):
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)
