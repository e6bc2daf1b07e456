"""The backward's weight gradients at run time (templates/hopper_wgrad.py, built by `moe-aot build
--backward`), and their torch reference. No DSL: the kernels are loaded from the database.

Both GEMMs read the forward's routing layout (templates/routing.py, harness.reference's
routing_reference): rows sorted by expert, each expert's segment padded to the routing's tile_m,
`expert_offsets` [E + 1] its bounds, `expert_counts` [E] its routed rows, `sorted_ids` [R] each
row's routed pair p = m * top_k + k or -1. Per expert e, over its rows r:

    dW13[e] (2I x H) = sum_r da[r]^T x[p_r // top_k]      (da [R, 2I] in row order, x gathered)
    dW2[e]  (H x I)  = sum_r dO[p_r // top_k]^T hw[r]     (dO gathered, hw [R, I] in row order)

with da and hw zero on padding rows (the gathered rows are zero there). K of each expert is read
on the device: no host sync; experts without rows get zeros; no atomics (bitwise repeatable).
"""
from __future__ import annotations

import torch

from ..gemm_limits import WGRAD_TILE_K
from ..spec import make_spec
from ..variants import wgrad_kernels, wgrad_tile_map
from .library import KernelArgumentError
from .store import KernelMissingError, KernelStore

_KERNELS: dict[tuple, tuple | None] = {}


def wgrad_kernels_for(experts: int, top_k: int, hidden: int, intermediate: int, device: torch.device,
                      store: KernelStore | None = None, tiles=None):
    """(dW13 kernel, dW2 kernel) of this layer shape for `device`, or None where the database has
    them not (the caller then runs torch's grouped GEMMs); looked up once per shape and device.
    ``tiles``: (dW13, dW2) variants.WgradTiles other than the defaults (a BackwardVariant's)."""
    from .layer import device_target

    key = (experts, top_k, hidden, intermediate, device.index, tiles)
    if key not in _KERNELS:
        spec = make_spec(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                         target=device_target(device))
        kvs = wgrad_kernels(spec, None if tiles is None else wgrad_tile_map(tiles))
        store = store or KernelStore()
        try:
            _KERNELS[key] = tuple(store.load(kv.name, spec.target, device.index) for kv in kvs) or None
        except KernelMissingError:
            _KERNELS[key] = None
    return _KERNELS[key]


def _check(da, x, d_out, hw, sorted_ids, expert_offsets, expert_counts, top_k, routing_tile_m):
    if routing_tile_m % WGRAD_TILE_K:
        raise KernelArgumentError(f"the routing's tile_m {routing_tile_m} must be a multiple of {WGRAD_TILE_K}: "
                                  "the weight-gradient GEMMs read each expert's rows in whole 64-row k-tiles")
    R, M = sorted_ids.shape[0], x.shape[0]
    for name, t, rows in (("da", da, R), ("hw", hw, R), ("x", x, M), ("d_out", d_out, M)):
        if t.dim() != 2 or t.shape[0] != rows:
            raise KernelArgumentError(f"{name} must be [{rows}, columns] (rows of sorted_ids [R] for da and hw, "
                                      f"of x [M, H] for d_out), got {tuple(t.shape)}")
    if d_out.shape[1] != x.shape[1] or da.shape[1] % 2 or hw.shape[1] * 2 != da.shape[1]:
        raise KernelArgumentError(f"da [R, 2I], x [M, H], d_out [M, H], hw [R, I] disagree: {tuple(da.shape)}, "
                                  f"{tuple(x.shape)}, {tuple(d_out.shape)}, {tuple(hw.shape)}")
    if expert_offsets.dim() != 1 or expert_counts.shape != (expert_offsets.shape[0] - 1,) or top_k < 1:
        raise KernelArgumentError(f"expert_offsets must be [E + 1], expert_counts [E] and top_k >= 1, got "
                                  f"{tuple(expert_offsets.shape)}, {tuple(expert_counts.shape)} and {top_k}")


def weight_gradients(da, x, d_out, hw, sorted_ids, expert_offsets, expert_counts, top_k: int, routing_tile_m: int,
                     kernels, dw13: torch.Tensor | None = None, dw2: torch.Tensor | None = None):
    """(dW13 [E, 2I, H], dW2 [E, H, I]) bf16 by the compiled kernels (`wgrad_kernels_for`) on the
    current stream; `dw13` / `dw2`: buffers to write (every element is written), else new ones."""
    _check(da, x, d_out, hw, sorted_ids, expert_offsets, expert_counts, top_k, routing_tile_m)
    E, H, I = expert_offsets.shape[0] - 1, x.shape[1], hw.shape[1]
    if dw13 is None:
        dw13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=x.device)
    if dw2 is None:
        dw2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=x.device)
    k13, k2 = kernels
    k13(da, x, sorted_ids, expert_offsets, expert_counts, dw13)
    k2(d_out, hw, sorted_ids, expert_offsets, expert_counts, dw2)
    return dw13, dw2


def weight_gradients_reference(da, x, d_out, hw, sorted_ids, expert_offsets, top_k: int):
    """weight_gradients in fp32 torch ops, expert by expert (reads the offsets on the host)."""
    E, H, I = expert_offsets.shape[0] - 1, x.shape[1], hw.shape[1]
    ids = sorted_ids.long()
    tok = torch.where(ids >= 0, ids // top_k, 0)
    live = (ids >= 0).unsqueeze(1)
    dw13 = torch.zeros(E, 2 * I, H, dtype=torch.float32, device=x.device)
    dw2 = torch.zeros(E, H, I, dtype=torch.float32, device=x.device)
    offs = expert_offsets.tolist()
    for e in range(E):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            xs = torch.where(live[lo:hi], x.index_select(0, tok[lo:hi]).float(), 0.0)
            ds = torch.where(live[lo:hi], d_out.index_select(0, tok[lo:hi]).float(), 0.0)
            dw13[e] = da[lo:hi].float().t() @ xs
            dw2[e] = ds.t() @ hw[lo:hi].float()
    return dw13, dw2
