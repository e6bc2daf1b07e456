"""The operand layouts the kernels and their callers agree on: w13's gate/up interleave and the
routing workspace's worst-case tile count. Imports no torch (torch is imported when a tensor
function runs), so the templates can name the layout they read without pulling torch into a
kernel compile; the runtime and the harness take it from here too."""
from __future__ import annotations

import math


def max_tiles(tokens: int, top_k: int, experts: int, tile_m: int) -> int:
    """Worst-case number of tile_m-row tiles after padding every expert's rows to tile_m."""
    pairs = tokens * top_k
    return max(1, math.ceil((pairs + min(experts, pairs) * (tile_m - 1)) / tile_m))


def interleave_gate_up(w_gate, w_up, block: int = 16):
    """[E, I, H] gate and up tensors -> [E, 2I, H] with rows alternating in blocks of `block`:
    rows [2jb, 2jb+b) are gate rows [jb, jb+b), rows [2jb+b, 2jb+2b) the matching up rows."""
    import torch

    E, I, H = w_gate.shape
    if w_up.shape != w_gate.shape or I % block:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must match, I % {block} == 0")
    g = w_gate.reshape(E, I // block, block, H)
    u = w_up.reshape(E, I // block, block, H)
    return torch.stack((g, u), dim=2).reshape(E, 2 * I, H).contiguous()


def split_gate_up(w13, block: int = 16):
    """The inverse of interleave_gate_up: [E, 2I, H] -> (gate, up), each [E, I, H]."""
    E, I2, H = w13.shape
    v = w13.reshape(E, I2 // (2 * block), 2, block, H)
    return v[:, :, 0].reshape(E, I2 // 2, H), v[:, :, 1].reshape(E, I2 // 2, H)
