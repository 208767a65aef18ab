"""The launchers' tuning, for benchmarks and sweeps: the settings each launcher's
``use_settings`` takes (``quantize.use_settings(QuantizeSettings(...))``,
``dequantize.use_settings(DequantizeSettings(...))``, ``partial_amax.use_settings`` and
``partial_cast.use_settings`` with ``MasterSettings(...)``). Every field is a field of the
kernels' specs, so kernels built under different settings are different cache entries; the
defaults are the H200 sweeps' choices (``bench/README.md``, "Kernel build choices").
"""
from ._specs import DequantizeSettings, MasterSettings, QuantizeSettings

__all__ = ["QuantizeSettings", "DequantizeSettings", "MasterSettings"]
