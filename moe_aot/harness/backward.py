"""The fused backward measured the way the tuner measures the forward (`moe-aot tune --backward`):
one BackwardVariant's kernels checked against an fp32 reference on NaN-poisoned memory, then the
whole backward (integrations.autograd.moe_backward_fused, reading the forward's pre-activations;
for variants.TORCH_DATA moe_backward_torch with the compiled GLU backward) replayed from CUDA graphs
over several routings, median.

The reference runs expert by expert in fp32 from the bf16 inputs (x, the weights, dO, the routing)
and compares each expert's weight gradients as it goes, so DeepSeek-V3's fp32 weights and
gradients are never all held at once.
"""
from __future__ import annotations

import torch

from ..integrations import autograd
from ..runtime.layer import backward_plan, glu_backward_kernel, split_biases
from ..runtime.store import KernelMissingError
from ..variants import INTERLEAVE
from .measure import summarize, timed_graphs, timing_method
from .reference import rel_err, row_rel_err
from .verify import ROW_TOLERANCE, TOLERANCE, random_routing, timing_generator

INPUT_SETS = 2  # each captured backward keeps its own gradients (DeepSeek-V3: 22 GB per set)


def backward_inputs(spec, tokens: int, w13, b13, device, n: int = INPUT_SETS, generator=None):
    """n sets of (x, topk_weights, topk_ids, dO, pre-activations) with different routings; without
    a generator, the same sets for every variant of the bucket (verify.timing_generator)."""
    sets = []
    for i in range(n):
        gen = generator or timing_generator(spec, tokens, i, device)
        x = torch.randn(tokens, spec.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        tw, ids = random_routing(tokens, spec, device, generator=gen)
        grad = torch.randn(tokens, spec.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        sets.append((x, tw, ids, grad, autograd.preact_torch(x, w13, ids, b13)))
    return sets


def check_backward(spec, grads, x, w13, w2, tw, ids, grad, b13=None, b2=None) -> dict:
    """Errors of the backward's gradients (dx, dw13, dw2, dtopk_weights, db13, db2) against fp32 on
    the same bf16 inputs: dx as a whole and its worst row; each expert's dW13 / dW2 (and bias
    gradients), the worst expert reported (an expert without rows must get exact zeros); the
    routing weights' gradient as a whole (a dot product over I terms: per element it cancels)."""
    dx, dw13, dw2, dtw, db13, db2 = grads
    M, K = ids.shape
    E, I2, H = w13.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(0, E - 1), minlength=E).tolist()
    dx_ref = torch.zeros(M, H, dtype=torch.float32, device=x.device)
    dtw_ref = torch.zeros(M * K, dtype=torch.float32, device=x.device)
    worst = {"dw13": 0.0, "dw2": 0.0, "db13": 0.0, "db2": 0.0}
    start = 0
    for e in range(E):
        pairs = order[start:start + counts[e]]
        start += counts[e]
        got = {"dw13": dw13[e], "dw2": dw2[e], "db13": None if db13 is None else db13[e],
               "db2": None if db2 is None else db2[e]}
        if not counts[e]:
            for k, g in got.items():
                if g is not None and not torch.equal(g, torch.zeros_like(g)):
                    worst[k] = float("inf")
            continue
        m = pairs // K
        xs, ds = x[m].float(), grad[m].float()
        w = tw.reshape(-1)[pairs].float().unsqueeze(1)
        w13e = w13[e].float()
        a = xs @ w13e.t()
        if b13 is not None:
            a = a + b13[e].float()
        av = a.view(len(pairs), -1, 2, INTERLEAVE)
        G = ds @ w2[e].float()
        h, dg, du = autograd._glu_backward(spec.activation, av[:, :, 0], av[:, :, 1],
                                           G.view(len(pairs), -1, INTERLEAVE), w.unsqueeze(2))
        h = h.reshape(len(pairs), -1)
        da = torch.stack((dg, du), dim=2).reshape(len(pairs), I2)
        ref = {"dw13": da.t() @ xs, "dw2": (ds * w).t() @ h, "db13": da.sum(0), "db2": (ds * w).sum(0)}
        for k, g in got.items():
            if g is not None:
                worst[k] = max(worst[k], rel_err(g, ref[k]))
        dx_ref.index_add_(0, m, da @ w13e)
        dtw_ref[pairs] = (G * h).sum(1) + (0 if b2 is None else (ds * b2[e].float()).sum(1))
    out = {"dx": rel_err(dx, dx_ref), "dx_row": row_rel_err(dx, dx_ref),
           "dtopk_weights": rel_err(dtw.reshape(-1), dtw_ref)}
    out.update({k: v for k, v in worst.items() if not (k.startswith("db") and b13 is None)})
    bounds = {"dx_row": ROW_TOLERANCE}
    out["ok"] = all(v == v and v <= bounds.get(k, TOLERANCE) for k, v in out.items())
    return out


def poison_free_memory(device, fraction: float = 0.3) -> None:
    """Fill a part of the caching allocator's free memory with NaN and free it again, so an
    output a kernel leaves unwritten reads NaN (the GPU tests' way)."""
    free, _ = torch.cuda.mem_get_info(device)
    junk = torch.empty(int(free * fraction) // 4, device=device)
    junk.fill_(float("nan"))
    del junk


def measure_backward(spec, variant, tokens: int, w13, w2, store, device, replays: int = 20,
                     sets=None, warmup_s: float = 0.1, nvml=None) -> dict:
    """Check then time the backward `variant` (a BackwardVariant; its kernels from `store`) at
    `tokens`: {"ok", "errors", and when ok median_us, ...}. Raises KernelMissingError when the
    database lacks one of its kernels."""
    w13, b13, w2, b2 = split_biases(spec, w13, w2)
    plan = backward_plan(spec.experts, spec.top_k, spec.hidden, spec.intermediate, spec.activation, spec.bias,
                         device, tokens, store, variant)
    if plan is None:
        raise KernelMissingError(f"{variant.name(spec)}: a kernel of it is not in the database "
                                 "(`moe-aot tune --backward --compile-only` compiles them)")
    _, kern, wk = plan
    sets = sets or backward_inputs(spec, tokens, w13, b13, device)
    glu = None
    if kern is None:  # torch's data GEMMs (variants.TORCH_DATA) around the GLU kernel it names
        glu = glu_backward_kernel(spec.experts, spec.top_k, spec.hidden, spec.intermediate, spec.activation,
                                  spec.bias, device, store)
        if glu is None:
            raise KernelMissingError(f"{variant.name(spec)}: its GLU backward kernel is not in the database "
                                     "(`moe-aot tune --backward --compile-only` compiles it)")

    def run(s):
        x, tw, ids, grad, preact = s
        if kern is None:
            return autograd.moe_backward_torch(grad, x, w13, w2, tw, ids, spec.activation, INTERLEAVE, b13, b2,
                                               preact, glu)
        return autograd.moe_backward_fused(kern, grad, x, w13, w2, tw, ids, spec.activation, b13, b2, preact, wk)

    poison_free_memory(device)
    x, tw, ids, grad, _ = sets[0]
    errors = check_backward(spec, run(sets[0]), x, w13, w2, tw, ids, grad, b13, b2)
    ok = errors.pop("ok")
    if not ok:
        return {"ok": False, "errors": errors}
    timed = _timed_fitting([lambda s=s: run(s) for s in sets], replays, warmup_s, nvml)
    torch.cuda.empty_cache()  # the graphs' pools (each set's gradients) go with them
    if timed is None:
        raise torch.cuda.OutOfMemoryError(f"{variant.name(spec)} at {tokens} tokens: one captured "
                                          "backward does not fit in this GPU's memory")
    times, state, used = timed
    return {"ok": True, "errors": errors, **summarize(times), **timing_method(warmup_s, state),
            "input_sets": used}


def _timed_fitting(fns, replays: int, warmup_s: float, nvml):
    """timed_graphs over all of `fns`, or over the first alone where the graphs of all do not fit
    (each holds its own gradients: at DeepSeek-V3 16384 tokens two input sets' 21 GiB graph
    pools plus torch's weight gradients' 14 GiB dW13 are more than an 80 GB card holds beside the
    weights). Past L2's size (the only sizes where this happens) a second routing changes nothing
    the replays could reuse.
    (times, gpu state, input sets used), or None where one graph does not fit either."""
    for n in (len(fns), 1) if len(fns) > 1 else (1,):
        oom = False
        try:
            times, state = timed_graphs(fns[:n], replays, warmup_s, nvml)
        except torch.cuda.OutOfMemoryError:
            oom = True  # retried outside the handler, so its traceback frees the captured graphs
        if not oom:
            return times, state, n
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return None
