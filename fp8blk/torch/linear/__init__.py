"""Float8BlockLinear: ``nn.Linear`` with its three GEMMs in block-scaled FP8, and
``convert_to_float8_block`` to swap a model's ``nn.Linear`` modules in place.

Math (TransformerEngine's block-scaling recipe, docs/torch.md), for x (..., K) viewed as (M, K),
W (N, K), dY (M, N):

    forward   y  = x[1x128] @ W[128x128].T            (+ bias in high precision)
    dgrad     dx = dY[1x128] @ W.columnwise[128x128]  (W's tiles transposed: the same bytes)
    wgrad     dW = dY.columnwise[128x1].T @ x.columnwise[128x1]   (reduction over tokens)

x and dY are each quantized ONCE, rowwise and columnwise in one fused pass. The activation
saved for the backward pass is x's columnwise FP8 buffer (M*K bytes plus scales), not the
high-precision x (2*M*K bytes in bf16): about half the activation memory of nn.Linear. W
itself is saved (a parameter, held anyway), not its FP8 buffers: the backward pass quantizes
it again, columnwise only (the same bytes as the FP8 transpose of its rowwise tiles), which
costs one read of W and keeps N*K bytes per layer out of the memory held between the passes.
Output dtype = x's dtype; dW is produced in W's dtype, dbias = dY summed over tokens. A layer
whose input is kept between the passes anyway (attention's output, a recomputed product)
keeps x itself instead of the FP8 copy (``keep_input``) and makes the copy in backward.

Interface with the FSDP2 weight subclass (``fp8blk/torch/fsdp/weights.py``): the layer gets
its quantized weight only through :func:`fp8blk.torch.linear.functional.weight_block_tensor`. A weight with a method
``fp8blk_block_tensor(rowwise: bool, columnwise: bool) -> fp8blk.BlockTensor`` (Block2D, or
MXFP8 under an MXFP8 config; the recipe must equal ``config.weight``) is asked for its FP8 form
and used as it is (no requantization); any other weight is quantized from its high-precision
values. The forward pass asks for ``rowwise=True, columnwise=False``, the backward pass for
``rowwise=False, columnwise=True``. The weight is an input of the autograd function and is
saved for backward either way, so dW flows to it.

torch.compile: quantize, transpose and GEMM are custom ops with fake implementations, so
``torch.compile(model, fullgraph=True)`` traces the layer without graph breaks (plain weights);
where the eager hot path's per-signature plan serves the signature, the plan runs instead as
x's quantize and the GEMM forward, one op backward (``compiled``: the same bytes, a fraction
of the host time; siblings' quantize ops merge in the graph's CSE).
A layer whose weight is an FSDP2 FP8 weight, or that runs an fp8blk sequence-parallel style,
runs eagerly under torch.compile (a graph break around the layer; see ``module``).

The room: ``module`` (the nn.Module and the converter), ``functional`` (the autograd function,
the general path, and the operand choice of each GEMM), ``plans`` (the eager CUDA hot path:
one plan per call signature), ``compiled`` (the plan as torch ops, for torch.compile),
``dtensor`` (torch's tensor-parallel plans: DTensor weights).

    import torch, fp8blk as fb
    from fp8blk.torch import convert_to_float8_block
    model = torch.nn.Sequential(torch.nn.Linear(384, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 320))
    convert_to_float8_block(model)          # in place; Float8BlockConfig() by default
    y = model(torch.randn(8, 32, 384))
    y.sum().backward()
"""
from .functional import float8_block_linear
from .module import Float8BlockLinear, convert_to_float8_block

__all__ = ["Float8BlockLinear", "convert_to_float8_block", "float8_block_linear"]
