"""Float8BlockConfig: which recipes a :class:`~fp8blk.torch.Float8BlockLinear` quantizes with.

Default (TransformerEngine's ``Float8BlockScaling``): activations and gradients Block1D (1x128
rowwise, 128x1 columnwise), weights Block2D (128x128 tiles), E4M3 everywhere, power-of-two
scales. Options: E5M2 gradients (``Float8BlockConfig(grad=fb.Block1D(fb.E5M2))``) and MXFP8
(``Float8BlockConfig.mxfp8()``: 1x32/32x1 blocks with E8M0 scales for all three operands).
``low_memory_forward=True`` trades a little GPU time for a lower forward peak (below).
Beside it, the torch dtypes the adapters name: each FP8 format's float8 dtype (what the uint8
data bytes are viewed as for a GEMM) and the high-precision dtypes a layer and a GEMM output take.

    import fp8blk as fb
    from fp8blk.torch import Float8BlockConfig
    cfg = Float8BlockConfig(grad=fb.Block1D(fb.E5M2))
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import E4M3, MXFP8, Block1D, Block2D, Format

_FP8_DTYPE = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}

FP8_DTYPES = tuple(_FP8_DTYPE.values())
HIGH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_dtype(fmt: Format):
    """torch.float8_e4m3fn for E4M3, torch.float8_e5m2 for E5M2."""
    return _FP8_DTYPE[fmt]



@dataclass(frozen=True)
class Float8BlockConfig:
    """Recipes of the three quantized operands of a linear layer.

    ``activation``: the layer input x (Block1D or MXFP8); ``weight``: W (Block2D or MXFP8);
    ``grad``: the output gradient dY (Block1D or MXFP8). Block1D activations/gradients go with
    Block2D weights; MXFP8 goes with MXFP8 everywhere (its GEMMs pair 1x32 blocks).

    ``low_memory_forward``: by default the forward pass quantizes x rowwise (for its GEMM)
    and columnwise (saved for the weight gradient) in one fused pass, so both FP8 copies of x
    exist during the GEMM: the layer's peak is x + y + W's FP8 tiles + 2 FP8 copies of x.
    With ``True`` the rowwise copy is made and used in two halves of the tokens, each freed
    after its GEMM, and the columnwise copy after the GEMMs, when W's FP8 tiles are freed:
    the peak is x + y + the larger of (W's tiles + half an FP8 copy of x) and (one FP8 copy
    of x) -- below torchao's blockwise Linear, which holds x + y + W's tiles + one FP8 copy
    (figures: docs/torch.md). It costs a second read of x and one more GEMM launch per step. The
    halves apply where the per-signature plan serves the layer (CUDA tensors, Block1D and
    Block2D recipes, plain weights); elsewhere x is quantized rowwise, used and freed, then
    columnwise (a peak of x + y + W's tiles + one FP8 copy of x), except under fp8blk's
    sequence-parallel styles, which all-gather both FP8 copies of x together and ignore the
    option. The bytes and results are the default's.
    """

    activation: object = field(default_factory=lambda: Block1D(E4M3))
    weight: object = field(default_factory=lambda: Block2D(E4M3))
    grad: object = field(default_factory=lambda: Block1D(E4M3))
    low_memory_forward: bool = False

    def __post_init__(self):
        if not isinstance(self.low_memory_forward, bool):
            raise TypeError(f"Float8BlockConfig.low_memory_forward must be a bool, got "
                            f"{self.low_memory_forward!r}")
        mx = [isinstance(r, MXFP8) for r in (self.activation, self.weight, self.grad)]
        if any(mx) and not all(mx):
            raise ValueError(f"Float8BlockConfig: MXFP8 must be used for activation, weight "
                             f"and grad together (its GEMMs pair 1x32 blocks), got {self!r}; "
                             f"use Float8BlockConfig.mxfp8()")
        if not any(mx):
            for name, kind in (("activation", Block1D), ("weight", Block2D), ("grad", Block1D)):
                recipe = getattr(self, name)
                if not isinstance(recipe, kind):
                    raise TypeError(f"Float8BlockConfig.{name} must be fp8blk.{kind.__name__}"
                                    f"(...) (or MXFP8 for all three), got {recipe!r}")

    @classmethod
    def mxfp8(cls, grad_fmt: Format = E4M3, low_memory_forward: bool = False
              ) -> "Float8BlockConfig":
        """MXFP8 (1x32 blocks, E8M0 scales) for all operands; E4M3 data, ``grad_fmt`` for dY."""
        return cls(activation=MXFP8(E4M3), weight=MXFP8(E4M3), grad=MXFP8(grad_fmt),
                   low_memory_forward=low_memory_forward)

    @property
    def is_mxfp8(self) -> bool:
        return isinstance(self.weight, MXFP8)

    @property
    def block_multiple(self) -> int:
        """What in/out features must be multiples of: 32 for MXFP8, 1 for the 128-block
        recipes (their edge blocks are partial)."""
        return 32 if self.is_mxfp8 else 1


_DEFAULT = Float8BlockConfig()


def config_or_default(config, where: str) -> Float8BlockConfig:
    """`config` itself, or the default Float8BlockConfig when it is None; a TypeError naming
    `where` (the caller and argument) for anything else, e.g. a bare recipe or a dict."""
    if config is None:
        # one shared (frozen) instance: nothing is constructed inside a torch.compile trace,
        # where torch 2.11's dynamo cannot trace the recipes' hashing
        return _DEFAULT
    if not isinstance(config, Float8BlockConfig):
        hint = (" (a recipe is one operand's: wrap it, e.g. Float8BlockConfig(activation=..., "
                "weight=..., grad=...))" if isinstance(config, (Block1D, Block2D, MXFP8)) else "")
        raise TypeError(f"{where}: config must be a fp8blk.torch.Float8BlockConfig or None, "
                        f"got {config!r}{hint}")
    return config


__all__ = ["Float8BlockConfig", "config_or_default", "fp8_dtype", "FP8_DTYPES", "HIGH_DTYPES"]
