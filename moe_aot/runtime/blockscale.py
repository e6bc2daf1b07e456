"""Launch the block-scaled quantization kernel (templates/blockscale_quant.py) from the database:
x [rows, K] bf16 -> moe_aot.blockscale.Quantized (the bytes its torch reference gives, bit for
bit). No DSL; the kernels are compiled elsewhere (tools/check_blockscale.py --build, or
compiler.compile_into with variants.BlockScaleShape)."""
from __future__ import annotations

import torch

from ..blockscale import BLOCK, Quantized, check_format
from ..variants import BlockScaleShape, blockscale_kernel
from .library import KernelArgumentError, KernelLibrary
from .store import KernelStore

_KERNELS: dict[tuple, KernelLibrary] = {}


def quantize_kernel(fmt: str, k: int, device: torch.device, store: KernelStore | None = None) -> KernelLibrary:
    """The compiled quantizer of `fmt` at K = k for `device`, loaded once per (store, format, K,
    device); raises store.KernelMissingError when the database has none."""
    from .layer import device_target

    shape = BlockScaleShape(fmt, k, device_target(device))
    store = store or KernelStore()
    key = (id(store), fmt, k, device.index)
    if key not in _KERNELS:
        _KERNELS[key] = store.load(blockscale_kernel(shape).name, shape.target, device.index)
    return _KERNELS[key]


def quantize(x: torch.Tensor, fmt: str, global_amax: torch.Tensor | None = None, out: Quantized | None = None,
             store: KernelStore | None = None) -> Quantized:
    """x [rows, K] bf16 (CUDA, contiguous) -> Quantized(values, scales, global_amax) in `fmt` on
    the current stream. nvfp4 needs global_amax (fp32 [1] on x's device; e.g. x.abs().amax()):
    the kernel reads it on the device, so nothing waits for the host. `out`: a Quantized of
    preallocated buffers to write into."""
    check_format(fmt)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cuda:
        raise KernelArgumentError("x must be a CUDA bf16 tensor [rows, K]")
    rows, k = x.shape
    if k % BLOCK[fmt]:
        raise KernelArgumentError(f"K={k} must be a multiple of {fmt}'s block of {BLOCK[fmt]}")
    if (fmt == "nvfp4") != (global_amax is not None):
        raise KernelArgumentError("global_amax (fp32 [1]) is needed by nvfp4 and by no other format")
    lib = quantize_kernel(fmt, k, x.device, store)
    if out is None:
        cols = k if fmt == "mxfp8" else k // 2
        out = Quantized(torch.empty(rows, cols, dtype=torch.uint8, device=x.device),
                        torch.empty(rows, k // BLOCK[fmt], dtype=torch.uint8, device=x.device), global_amax)
    if out.values.shape[:1] != (rows,) or out.scales.shape[:1] != (rows,):
        raise KernelArgumentError(f"out's values and scales must have x's {rows} rows, got "
                                  f"{tuple(out.values.shape)} and {tuple(out.scales.shape)}")
    if rows:  # an empty grid is no launch
        args = (x, out.values, out.scales) + ((global_amax,) if fmt == "nvfp4" else ())
        lib(*args)
    return Quantized(out.values, out.scales, global_amax)
