"""Numba CUDA kernels: the GPU backend of fp8blk, for CuPy arrays and torch CUDA tensors.

``backend`` holds the functions ``fp8blk._dispatch`` calls (those of ``fp8blk.reference``, on
device arrays); ``prebuild`` is what ``python -m fp8blk prebuild`` asks of the kernels (and
what a process has built and loaded); ``tuning`` the settings the launchers' ``use_settings``
take (benchmarks and sweeps).

Modules come in pairs named by operation: a launcher (``quantize``, ``dequantize``,
``transpose``, ``partial_amax``, ``partial_cast``, ``rms_norm``: launch plans, allocation,
launch; the function of the operation is inside, e.g. ``quantize.quantize``) and its builder
(``_quantize_kernel``, ...: the Numba kernel code, compiled on first use per variant).
``rms_norm`` is also the torch room's door to the RMSNorm kernels (``fp8blk.torch.norm``).
``master_batch`` is the master-weight kernels' batch table; ``_specs`` the numba-free kinds,
specs (every setting that changes generated code is a spec field) and launch geometry both
sides share; ``_launch`` the launchers' helpers (input kinds, plan caches, tuning);
``_adapters`` the array families a launch takes (CuPy, torch CUDA, NumPy under the simulator);
``_kernel_lib`` the device functions the builders share. ``_compiled`` gives launchers their
kernels: from fp8blk's disk cache (``_cache``; ``FP8BLK_CACHE_DIR``, ``FP8BLK_KERNEL_CACHE=0``
to turn it off; ``python -m fp8blk prebuild`` fills it ahead of time), else compiled once per
cache folder. ``_numba`` is the only module importing numba.cuda, only builders and
``_kernel_lib`` import ``_numba``, and launchers import builders only on a cache miss: a
process whose kernels are cached never imports numba.
"""
from . import backend

__all__ = ["backend"]
