"""GPU benchmarks of fp8blk (not installed). Run from the repository root: python -m bench.<name>."""


def machine(gpu_name, gpus=1):
    """The machine part of a result's file name, ``<benchmark>-<machine>.json``: the last word
    of the GPU's name in lower case, with ``x<gpus>`` when several take part ("NVIDIA H200", 2
    -> "h200x2"), as ``bench/run_gpu.sh`` names them."""
    name = gpu_name.decode() if isinstance(gpu_name, bytes) else str(gpu_name)
    return name.split()[-1].lower() + (f"x{gpus}" if gpus > 1 else "")
