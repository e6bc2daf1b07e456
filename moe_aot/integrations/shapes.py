"""The layer's contract on shapes, shared by the PyTorch ops (op.py) and the JAX function
(jax.py): each checks its own array types, ranks and dtypes, then hands the shapes here, so both
refuse a mismatch with the same sentence."""
from __future__ import annotations

from ..runtime.library import KernelArgumentError
from ..variants import INTERLEAVE


def check_layer_shapes(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, out=None, *,
                       bias_names=("b13", "b2"), source: str = "from prepare_weights") -> None:
    """Shapes (tuples, ranks already checked) of x [M, H], w13 [E, 2I, H] with I a multiple of
    the interleave, w2 [E, H, I], topk_weights and topk_ids [M, K], the optional expert biases
    b13 [E, 2I] and b2 [E, H] (both or neither; ``bias_names`` are the caller's names for them)
    and the optional out [M, H]. ``source`` says where a right w13 comes from."""
    M, H = x
    E, I2, H1 = w13
    I = I2 // 2
    if H1 != H or I2 % (2 * INTERLEAVE):
        raise KernelArgumentError(f"w13 must have shape (experts, 2*intermediate, {H}) with intermediate a "
                                  f"multiple of {INTERLEAVE} ({source}), got {tuple(w13)}")
    if tuple(w2) != (E, H, I):
        raise KernelArgumentError(f"w2 must have shape ({E}, {H}, {I}) to match w13 {tuple(w13)}, got {tuple(w2)}")
    if topk_ids[0] != M or tuple(topk_weights) != tuple(topk_ids):
        raise KernelArgumentError(f"topk_weights and topk_ids must both have shape ({M}, top_k) for x of {M} "
                                  f"tokens, got {tuple(topk_weights)} and {tuple(topk_ids)}")
    n13, n2 = bias_names
    if (b13 is None) != (b2 is None):
        raise KernelArgumentError(f"expert biases come in pairs: give both {n13} [E, 2I] and {n2} [E, H], or neither")
    if b13 is not None:
        for name, got, want in ((n13, b13, (E, I2)), (n2, b2, (E, H))):
            if tuple(got) != want:
                raise KernelArgumentError(f"{name} must have shape {want} ({n13} interleaved as w13's rows), "
                                          f"got {tuple(got)}")
    if out is not None and tuple(out) != (M, H):
        raise KernelArgumentError(f"out must have shape ({M}, {H}) like x, got {tuple(out)}")
