"""The fused MoE layer at run time: pick the kernels for the token count, check the inputs,
launch routing -> GEMM1+GLU -> GEMM2 -> combine on the caller's current stream.

No host-device synchronisation anywhere: every size comes from tensor shapes, routing runs on the
GPU into a preallocated workspace, so a whole forward can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..gemm_limits import (
    BLOCKSCALE_BLOCK,
    BLOCKSCALED,
    BS_ELEM_BITS,
    BS_FORMATS,
    FP8,
    H_SCALE_BLOCKS,
    SCALE_BLOCK,
    STANDINS,
    W4,
    W4_BLOCK,
    W4_CHUNK,
    bs_scale_layout,
    bs_stored_k,
    check_h_block,
)
from ..layout import interleave_gate_up, max_tiles
from ..spec import LayerSpec, make_spec, value_class
from ..variants import (
    BWD_TILE_M,
    INTERLEAVE,
    QUANT_IN_ROUTING,
    DecodeVariant,
    LayerVariant,
    backward_kernels,
    bucket_for,
    default_variant,
    tile_ms,
    training_kernels,
)
from .launch import LayerPlan, current_stream, feeds
from .library import KernelArgumentError, KernelLibrary
from .store import KernelMissingError, KernelStore


def prepare_weights(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Interleave gate and up weights ([E, I, H] each) once, at weight-load time, into the
    [E, 2I, H] layout GEMM1 reads (blocks of INTERLEAVE rows alternate gate / up)."""
    return interleave_gate_up(w_gate, w_up, INTERLEAVE)


def prepare_biases(b_gate: torch.Tensor, b_up: torch.Tensor) -> torch.Tensor:
    """Gate and up expert biases ([E, I] each) -> the [E, 2I] b13 GEMM1 adds, interleaved as
    prepare_weights interleaves the weights' rows."""
    if b_gate.dim() != 2 or b_up.shape != b_gate.shape:
        raise KernelArgumentError(f"gate and up biases must both be [experts, intermediate], got "
                                  f"{tuple(b_gate.shape)} and {tuple(b_up.shape)}")
    return interleave_gate_up(b_gate.unsqueeze(-1), b_up.unsqueeze(-1), INTERLEAVE).squeeze(-1).contiguous()


def split_biases(spec: LayerSpec, w13, w2):
    """(w13, b13, w2, b2) from the weights as forward takes them: a bias layer's (weights,
    biases) pairs, checked to be pairs; without biases (w13, None, w2, None)."""
    if not spec.bias:
        return w13, None, w2, None
    for name, w in (("w13", w13), ("w2", w2)):
        if not (isinstance(w, (tuple, list)) and len(w) == 2):
            raise KernelArgumentError(f"{name} must be a (bf16 weights, bf16 biases) pair for {spec.label()}, "
                                      f"whose spec has expert biases (bias=True); got {type(w).__name__}")
    return w13[0], w13[1], w2[0], w2[1]


@value_class(frozen=False)
class Workspace:
    """Buffers for up to `max_tokens` tokens, reused by every call (and by CUDA graph replays)."""
    counts: torch.Tensor
    offsets: torch.Tensor
    sorted_ids: torch.Tensor
    tile_expert: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    max_tokens: int
    # fp8 layers: x quantized with its scales, and GEMM1's e4m3 output with its scales (hs sized for
    # the smallest h scale block; h_scales views it for a variant's); block-scaled layers (mxfp8,
    # nvfp4, w4a8-mx): the same as uint8 value and scale bytes (blockscale.quantize's layout)
    xq: torch.Tensor | None = None
    xs: torch.Tensor | None = None
    hq: torch.Tensor | None = None
    hs: torch.Tensor | None = None
    # nvfp4: x's global amax (fp32 [1]), taken on the device each call unless w13 carries a calibrated one
    xg: torch.Tensor | None = None
    # the one-launch decode kernel's (h bf16 [pairs, I], bar int32 [words]) per (pairs, I, words),
    # made at its first use (decode_buffers)
    decode: dict | None = None

    def __init__(self, counts: torch.Tensor, offsets: torch.Tensor, sorted_ids: torch.Tensor,
                 tile_expert: torch.Tensor, h: torch.Tensor, y: torch.Tensor, max_tokens: int,
                 xq: torch.Tensor | None = None, xs: torch.Tensor | None = None, hq: torch.Tensor | None = None,
                 hs: torch.Tensor | None = None, xg: torch.Tensor | None = None, decode: dict | None = None):
        self.counts, self.offsets, self.sorted_ids, self.tile_expert = counts, offsets, sorted_ids, tile_expert
        self.h, self.y, self.max_tokens = h, y, max_tokens
        self.xq, self.xs, self.hq, self.hs, self.xg = xq, xs, hq, hs, xg
        self.decode = decode

    def decode_buffers(self, spec: LayerSpec, v: DecodeVariant) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, bar) of the one-launch decode kernel ``v``: h [max_tokens * top_k, I] bf16, written
        before it is read in each launch; bar, its barrier words, zeroed here once and never reset
        (the grid barrier's 64-bit counter grows by the kernel's CTA count per launch), so
        CUDA-graph replays reuse it. Made at the first call that needs them,
        on the device of the routing buffers; launches that share them must not overlap (as every
        buffer of a workspace)."""
        key = (v.max_tokens * spec.top_k, spec.intermediate, v.bar_words(spec))
        if self.decode is None:
            self.decode = {}
        bufs = self.decode.get(key)
        if bufs is None:
            dev = self.counts.device
            bufs = self.decode[key] = (torch.empty(key[:2], dtype=torch.bfloat16, device=dev),
                                       torch.zeros(key[2], dtype=torch.int32, device=dev))
        return bufs

    def h_scales(self, rows: int, h_block: int) -> torch.Tensor:
        """An fp8 layer's h scales of ``rows`` rows as the variant's GEMMs take them: [rows,
        I / h_block], contiguous, at the start of ``hs`` (which holds [R, I / 64])."""
        cols = self.hq.shape[1] // h_block
        return self.hs.view(-1)[: rows * cols].view(rows, cols)

    @classmethod
    def allocate(cls, spec: LayerSpec, max_tokens: int, device) -> "Workspace":
        # Padded rows grow with tile_m and tile counts shrink with it: size each buffer for the
        # worst tile_m any variant of this layer may use (sm_100a bf16: 256, umma's 2-CTA pairs).
        R = max(max_tiles(max_tokens, spec.top_k, spec.experts, m) * m for m in tile_ms(spec))
        T = max(max_tiles(max_tokens, spec.top_k, spec.experts, m) for m in tile_ms(spec))
        i32 = dict(dtype=torch.int32, device=device)
        bf = dict(dtype=torch.bfloat16, device=device)
        fp8 = spec.precision in FP8
        bs = spec.precision in BLOCKSCALED
        extra = {}
        if bs:
            u8 = dict(dtype=torch.uint8, device=device)
            act = BS_FORMATS[spec.precision][0]  # x's and h's format (w4a8-mx: mxfp8)
            bits, vec = BS_ELEM_BITS[act], BLOCKSCALE_BLOCK[act]
            # K-padded rows (gemm_limits.bs_stored_k: whole k-tiles, the padding quantized zeros)
            H, I = bs_stored_k(spec.target, spec.hidden), bs_stored_k(spec.target, spec.intermediate)
            extra = dict(xq=torch.empty(max_tokens, H * bits // 8, **u8), xs=torch.empty(max_tokens, H // vec, **u8),
                         hq=torch.empty(R, I * bits // 8, **u8), hs=torch.empty(R, I // vec, **u8),
                         xg=torch.empty(1, dtype=torch.float32, device=device) if spec.precision == "nvfp4" else None)
        if fp8:
            f8, f32 = dict(dtype=torch.float8_e4m3fn, device=device), dict(dtype=torch.float32, device=device)
            xs_shape = (max_tokens,) if spec.precision == "fp8" else (max_tokens, spec.hidden // SCALE_BLOCK)
            extra = dict(xq=torch.empty(max_tokens, spec.hidden, **f8), xs=torch.empty(xs_shape, **f32),
                         hq=torch.empty(R, spec.intermediate, **f8),
                         hs=torch.empty(R, spec.intermediate // min(H_SCALE_BLOCKS), **f32))
        return cls(torch.empty(spec.experts, **i32), torch.empty(spec.experts + 1, **i32),
                   torch.empty(R, **i32), torch.empty(T, **i32),
                   torch.empty(0 if fp8 or bs else R, spec.intermediate, **bf),
                   torch.empty(max_tokens * spec.top_k, spec.hidden, **bf), max_tokens, **extra)


class MoeLayer:
    """Kernels of one layer shape, loaded from the database for the current GPU."""

    def __init__(self, spec: LayerSpec, store: KernelStore | None = None, device=None,
                 variants: dict[int, LayerVariant] | None = None):
        self.spec = spec
        if isinstance(device, torch.device):
            self.device = device
        else:
            self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        standin = STANDINS.get(spec.target)
        if standin is not None and self.device.type == "cuda" and device_target(self.device) != standin.arch:
            raise KernelArgumentError(f"{spec.target} kernels are {standin.arch} builds of the {standin.model} layer, "
                                      f"for checks on {standin.arch} GPUs; this GPU is {device_target(self.device)}")
        if (standin is None and self.device.type == "cuda" and torch.cuda.is_available()
                and device_target(self.device) != spec.target):
            # an `a` arch's cubins load on that compute capability only (sm_100a's tcgen05 kernels
            # on a B200 / GB200, not on an H200 nor a B300): refused here, not by the driver
            cc = ".".join(map(str, TARGET_CAPABILITIES[spec.target]))
            raise KernelArgumentError(f"{spec.target} kernels run only on GPUs of compute capability {cc}; this GPU "
                                      f"is {device_target(self.device)}")
        self.store = store or KernelStore()
        # Per token bucket: the tuned pick for this GPU if the database has one, else the default.
        if variants is None:
            variants = self.store.picks(spec, torch.cuda.get_device_name(self.device))
        self.variants = variants
        self._default_stored: dict[int, bool] = {}  # bucket -> its default's kernels are in the database
        self._kvs: dict[LayerVariant, list] = {}  # variant -> its kernels (names rendered once)
        self._libs: dict[str, KernelLibrary] = {}
        self._workspace: Workspace | None = None
        # (tokens, variant, id(workspace)) -> (workspace, the four kernels' bound arguments) (keyed by
        # the variant value: equal variants have equal names, and hashing it needs no name); the
        # plan holds its workspace, so the id cannot be reused while the plan exists.
        self._plans: dict[tuple, tuple] = {}
        # (tokens, id(workspace), id(variants)) -> LayerPlan: what a repeated call needs, checked
        # and launched without recomputing the variant, its name or the workspace slices.
        self._fast: dict[tuple, LayerPlan] = {}
        # the bf16 plan used last, tried first (it holds its workspace and variants, so `is` on
        # both is exact; its own checks refuse another token count)
        self._last: LayerPlan | None = None
        self.first_call_ms: dict[str, float] = {}  # stages of the last first call at a size (cold start)
        self._sms: int | None = None  # the device's SMs (a decode kernel needs one per CTA)

    # -- kernel selection ----------------------------------------------------------------------
    def variant_for(self, tokens: int) -> LayerVariant:
        """The variant of the token count's nearest bucket: its tuned pick; without one, the
        bucket's default where the database holds its kernels (`build` compiles every bucket's
        default); else the pick of the nearest bucket that has one. Only buckets' variants: `build`
        and `compile` put exactly those in the database, so another token count must not ask for
        a variant of its own (300 tokens would want a 16-CTA routing cluster that the 256-token
        bucket's default does not have). Picks for some buckets only happen when a database's
        picks predate a change of the defaults (their records no longer say what they beat)."""
        bucket = bucket_for(tokens)
        pick = self.variants.get(bucket)
        if isinstance(pick, LayerVariant):
            return pick
        v = default_variant(self.spec, bucket)
        # a bucket whose pick is the decode kernel falls back to its default (compiled with it)
        four = {b: p for b, p in self.variants.items() if isinstance(p, LayerVariant)}
        if not four or pick is not None:
            return v
        if bucket not in self._default_stored:
            names = [kv.name for kv in self.kernel_variants(v)]
            self._default_stored[bucket] = self.store.has_kernels(names, self.spec.target)
        if self._default_stored[bucket]:
            return v
        return four[bucket_for(tokens, tuple(sorted(four)))]

    def decode_for(self, tokens: int) -> DecodeVariant | None:
        """The one-launch decode kernel that serves this token count, or None: the bucket's pick
        where that is a DecodeVariant, for token counts up to its max_tokens, on a GPU with at least
        as many SMs as its CTAs (all resident in its cooperative launch). Every other call at the
        bucket (more tokens, a smaller GPU) runs variant_for's four kernels."""
        v = self.variants.get(bucket_for(tokens))
        if not isinstance(v, DecodeVariant) or tokens > v.max_tokens:
            return None
        if self._sms is None:
            cuda = self.device.type == "cuda" and torch.cuda.is_available()
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 0
        return v if self._sms >= v.ctas else None

    def served(self, tokens: int) -> DecodeVariant | LayerVariant:
        """What forward runs at this token count: decode_for's kernel, else variant_for's four."""
        return self.decode_for(tokens) or self.variant_for(tokens)

    def _lib(self, kv) -> KernelLibrary:
        lib = self._libs.get(kv.name)
        if lib is None:
            lib = self.store.load(kv.name, self.spec.target, self.device.index)
            self._libs[kv.name] = lib
        return lib

    def kernels(self, tokens: int):
        """(variant, routing, GEMM1, GEMM2, combine) for this token count (fp8: the routing
        also quantizes x, and takes x, xq and xs after its own arguments)."""
        v, libs = self.role_kernels(tokens)
        return v, libs["routing"], libs["glu"], libs["down"], libs["combine"]

    def kernel_variants(self, v: LayerVariant) -> list:
        """v.kernels(spec), rendered once per variant (a first call at a size asks for them again
        after the load did)."""
        kvs = self._kvs.get(v)
        if kvs is None:
            # GEMM1 writes h's scales per h_block columns and GEMM2 reads them so: a variant whose
            # GEMM1 tiles cannot write its blocks has no kernels (its GEMM1 never compiles)
            ok, why = check_h_block(self.spec.precision, v.h_block, v.glu.tile_n)
            if not ok:
                raise KernelArgumentError(f"variant {v.name(self.spec)} cannot run: {why}")
            kvs = self._kvs[v] = v.kernels(self.spec)
        return kvs

    def role_kernels(self, tokens: int):
        """(variant, {role: library}) of every kernel of the layer at this token count."""
        v = self.variant_for(tokens)
        kvs = self.kernel_variants(v)
        missing = [kv.name for kv in kvs if kv.name not in self._libs]
        if missing:  # one database query for the bucket's kernels, not one per kernel
            self._libs.update(self.store.load_many(missing, self.spec.target, self.device.index))
        return v, {kv.role: self._libs[kv.name] for kv in kvs}

    def workspace(self, tokens: int) -> Workspace:
        ws = self._workspace
        if ws is None or ws.max_tokens < tokens:
            ws = Workspace.allocate(self.spec, max(tokens, 1), self.device)
            self._workspace = ws
            self._drop_plans()  # they point into the old workspace (and keep it alive)
        return ws

    def _drop_plans(self) -> None:
        """Forget the bound plans (each keeps the workspace it points into alive)."""
        self._plans.clear()
        self._fast.clear()
        self._last = None

    def release_workspace(self) -> int:
        """Drop this layer's workspace and the plans that point into it, so that its GPU memory
        can go back to the allocator (the next call allocates one again, for its own size).
        Returns the bytes the workspace's buffers held."""
        ws, self._workspace = self._workspace, None
        self._drop_plans()
        if ws is None:
            return 0
        bufs = [t for t in vars(ws).values() if isinstance(t, torch.Tensor)]
        bufs += [t for pair in (ws.decode or {}).values() for t in pair]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in bufs}.values())

    # -- checks --------------------------------------------------------------------------------
    def check_inputs(self, x, w13, w2, topk_weights, topk_ids, out, b13=None, b2=None) -> None:
        """Raise KernelArgumentError naming the first bad input (weights as forward takes them;
        a bias layer's biases either in its (weights, biases) pairs or as b13 / b2)."""
        s = self.spec
        own_bias = s.precision in W4 or s.precision in BLOCKSCALED  # the weights carry their biases
        if s.bias and b13 is None and b2 is None and not own_bias:
            w13, b13, w2, b2 = split_biases(s, w13, w2)
        M = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        if s.precision in FP8:
            weights = self._fp8_weight_checks(w13, w2)
        elif s.precision in BLOCKSCALED:
            weights = self._bs_weight_checks(w13, w2)
        elif s.precision in W4:
            weights = self._w4_weight_checks(w13, w2)
        else:
            weights = [("w13", w13, (s.experts, 2 * s.intermediate, s.hidden), torch.bfloat16),
                       ("w2", w2, (s.experts, s.hidden, s.intermediate), torch.bfloat16)]
        if s.bias and not own_bias:
            weights += [("b13", b13, (s.experts, 2 * s.intermediate), torch.bfloat16),
                        ("b2", b2, (s.experts, s.hidden), torch.bfloat16)]
        expect = [("x", x, (M, s.hidden), torch.bfloat16)] + weights + [
            ("topk_weights", topk_weights, (M, s.top_k), torch.float32),
            ("topk_ids", topk_ids, (M, s.top_k), torch.int32),
        ]
        if out is not None:
            expect.append(("out", out, (M, s.hidden), torch.bfloat16))
        for name, t, shape, dtype in expect:
            if not isinstance(t, torch.Tensor):
                raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != len(shape) or any(w is not None and a != w for a, w in zip(t.shape, shape)):
                want = tuple("M" if w is None else w for w in shape)
                raise KernelArgumentError(f"{name} must have shape {want} for {s.label()}, got {tuple(t.shape)}")
            if t.dtype != dtype:
                raise KernelArgumentError(f"{name} must be {dtype}, got {t.dtype}")
            if t.device != self.device:
                raise KernelArgumentError(f"{name} must be on {self.device}, got {t.device}")
            if not t.is_contiguous():
                raise KernelArgumentError(f"{name} must be contiguous (call .contiguous() first)")
            if t.data_ptr() % 16:
                raise KernelArgumentError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")

    def _fp8_weight_checks(self, w13, w2) -> list:
        """fp8 layers take each weight as a (e4m3 values, fp32 scales) pair (prepare_fp8_weights)."""
        s = self.spec
        for name, w in (("w13", w13), ("w2", w2)):
            if not (isinstance(w, (tuple, list)) and len(w) == 2):
                raise KernelArgumentError(f"{name} must be a (float8_e4m3fn weights, float32 scales) pair for "
                                          f"precision {s.precision} (prepare_fp8_weights), got {type(w).__name__}")
        if s.precision == "fp8":
            w13s_shape, w2s_shape = (s.experts, 2), (s.experts,)
        else:
            w13s_shape = (s.experts, 2 * s.intermediate // SCALE_BLOCK, s.hidden // SCALE_BLOCK)
            w2s_shape = (s.experts, s.hidden // SCALE_BLOCK, s.intermediate // SCALE_BLOCK)
        e4m3 = torch.float8_e4m3fn
        return [("w13", w13[0], (s.experts, 2 * s.intermediate, s.hidden), e4m3),
                ("w13 scales", w13[1], w13s_shape, torch.float32),
                ("w2", w2[0], (s.experts, s.hidden, s.intermediate), e4m3),
                ("w2 scales", w2[1], w2s_shape, torch.float32)]

    def _w4_weight_checks(self, w13, w2) -> list:
        """mxfp4-w layers take each weight as a W4Weight (blocks, scales, bias) triple
        (runtime/w4.py: from_gpt_oss, prepare_weights); the biases where the spec has them."""
        s = self.spec
        for name, w in (("w13", w13), ("w2", w2)):
            if not (isinstance(w, (tuple, list)) and len(w) == 3):
                raise KernelArgumentError(f"{name} must be a (uint8 blocks, uint8 scales, bf16 bias or None) triple "
                                          f"for precision {s.precision} (w4.from_gpt_oss or w4.prepare_weights), "
                                          f"got {type(w).__name__}")
            if (w[2] is not None) != s.bias:
                raise KernelArgumentError(f"{name}'s bias must be {'a tensor' if s.bias else 'None'}: the spec of "
                                          f"{s.label()} has {'' if s.bias else 'no '}expert biases")
        E, H, I, u8 = s.experts, s.hidden, s.intermediate, torch.uint8
        cn, ck = W4_CHUNK  # fragment-order chunks (runtime/w4.py)
        out = [("w13 blocks", w13[0], (E, 2 * I // cn, H // ck, cn * ck // 2), u8),
               ("w13 scales", w13[1], (E, 2 * I // cn, H // ck, cn * ck // W4_BLOCK), u8),
               ("w2 blocks", w2[0], (E, H // cn, I // ck, cn * ck // 2), u8),
               ("w2 scales", w2[1], (E, H // cn, I // ck, cn * ck // W4_BLOCK), u8)]
        if s.bias:
            out += [("b13", w13[2], (E, 2 * I), torch.bfloat16), ("b2", w2[2], (E, H), torch.bfloat16)]
        return out

    def _bs_weight_checks(self, w13, w2) -> list:
        """mxfp8 / nvfp4 / w4a8-mx layers take each weight as a BlockScaledWeight (runtime/blockscaled.py:
        prepare_w13, prepare_w2; w4a8-mx's values packed e2m1, e.g. from_gpt_oss); nvfp4's carry
        their global amaxes, and w2 the calibrated amax of h (with_input_amax), which GEMM1
        quantizes h against."""
        from .blockscaled import BlockScaledWeight

        s = self.spec
        nv = s.precision == "nvfp4"
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, BlockScaledWeight):
                raise KernelArgumentError(f"{name} must be a BlockScaledWeight for precision {s.precision} "
                                          f"(blockscaled.prepare_w13 / prepare_w2), got {type(w).__name__}")
            if w.scale_layout != bs_scale_layout(s.target):
                raise KernelArgumentError(f"{name}'s scales are in the {w.scale_layout!r} layout and {s.target}'s "
                                          f"kernels read {bs_scale_layout(s.target)!r} (blockscaled.for_target(w, "
                                          f"{s.target!r}), or prepare it with target={s.target!r})")
            if (w.global_amax is None) == nv:
                want = "an fp32 [experts] tensor" if nv else "None"
                raise KernelArgumentError(f"{name}'s global_amax must be {want} for precision {s.precision}")
            if not nv and w.input_amax is not None:
                raise KernelArgumentError(f"{name}'s input_amax must be None for precision {s.precision} "
                                          "(only nvfp4 has global scales)")
        if nv and w2.input_amax is None:
            raise KernelArgumentError("w2's input_amax (fp32 [1], the calibrated amax of h) is needed for precision "
                                      "nvfp4: GEMM1 quantizes h against it (blockscaled.with_input_amax)")
        for name, w in (("w13", w13), ("w2", w2)):
            if (w.bias is not None) != s.bias:
                raise KernelArgumentError(f"{name}'s bias must be {'a bf16 tensor' if s.bias else 'None'}: the spec of "
                                          f"{s.label()} has {'' if s.bias else 'no '}expert biases")
        E, H, I, u8, f32 = s.experts, s.hidden, s.intermediate, torch.uint8, torch.float32
        Hp, Ip = bs_stored_k(s.target, H), bs_stored_k(s.target, I)  # K padded to whole k-tiles
        wfmt = BS_FORMATS[s.precision][1]
        bits, vec = BS_ELEM_BITS[wfmt], BLOCKSCALE_BLOCK[wfmt]
        out = [("w13 values", w13.values, (E, 2 * I, Hp * bits // 8), u8),
               ("w13 scales", w13.scales, (E, 2 * I, Hp // vec), u8),
               ("w2 values", w2.values, (E, H, Ip * bits // 8), u8),
               ("w2 scales", w2.scales, (E, H, Ip // vec), u8)]
        if s.bias:
            out += [("b13", w13.bias, (E, 2 * I), torch.bfloat16), ("b2", w2.bias, (E, H), torch.bfloat16)]
        if nv:
            out += [("w13 global_amax", w13.global_amax, (E,), f32), ("w2 global_amax", w2.global_amax, (E,), f32),
                    ("w2 input_amax", w2.input_amax, (1,), f32)]
            if w13.input_amax is not None:
                out.append(("w13 input_amax", w13.input_amax, (1,), f32))
        return out

    # -- the layer -----------------------------------------------------------------------------
    def forward(self, x, w13, w2, topk_weights, topk_ids, out=None, workspace: Workspace | None = None):
        """out[m] = sum_k topk_weights[m,k] * FFN_{topk_ids[m,k]}(x[m]). Ids outside [0, experts)
        contribute nothing (documented, tested). Returns `out` (allocated if None). fp8 layers
        take w13 and w2 as (e4m3 weights, fp32 scales) pairs (prepare_fp8_weights); layers with
        expert biases (spec bias=True, gpt-oss) as (bf16 weights, bf16 biases) pairs: (w13, b13)
        with b13 [E, 2I] interleaved as w13's rows (prepare_biases), and (w2, b2) with b2 [E, H];
        mxfp4-w layers as W4Weights (runtime/w4.py); mxfp8 / nvfp4 / w4a8-mx layers as BlockScaledWeights
        (runtime/blockscaled.py; nvfp4's w2 with h's calibrated input_amax)."""
        if self.spec.precision in FP8:
            return self._forward_fp8(x, w13, w2, topk_weights, topk_ids, out, workspace)
        if self.spec.precision in W4:
            return self._forward_w4(x, w13, w2, topk_weights, topk_ids, out, workspace)
        if self.spec.precision in BLOCKSCALED:
            return self._forward_bs(x, w13, w2, topk_weights, topk_ids, out, workspace)
        b13 = b2 = None
        if self.spec.bias:
            w13, b13, w2, b2 = split_biases(self.spec, w13, w2)
        ws = workspace if workspace is not None else self._workspace
        last = self._last
        if last is not None and last.ws is ws and last.variants is self.variants:
            done = last.run(x, w13, w2, topk_weights, topk_ids, out, b13, b2)
            if done is not None:
                return done
        try:  # x.shape[0], not len(x): Tensor.__len__ is Python code, three times the cost
            fast = self._fast.get((x.shape[0], id(ws), id(self.variants)))
        except (AttributeError, IndexError, TypeError):  # not a tensor, or 0-d: the checks below say why
            fast = None
        if fast is not None and fast is not last:  # a repeated call: the same checks, then one launch call
            done = fast.run(x, w13, w2, topk_weights, topk_ids, out, b13, b2)
            if done is not None:
                self._last = fast
                return done
        t0 = time.perf_counter()
        self.check_inputs(x, w13, w2, topk_weights, topk_ids, out, b13, b2)
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.spec.hidden, dtype=torch.bfloat16, device=self.device)
        if M == 0:
            return out
        t1 = time.perf_counter()
        ws = workspace or self.workspace(M)
        if ws.max_tokens < M:
            raise KernelArgumentError(f"workspace holds {ws.max_tokens} tokens, x has {M}")
        t2 = time.perf_counter()
        d = self.decode_for(M)
        bias13, bias2 = ((b13,), (b2,)) if self.spec.bias else ((), ())
        if d is not None:  # the whole layer in one launch, with its h and barrier words from the workspace
            v, libs = d, (self._lib(d.kernels(self.spec)[0]),)
            dh, bar = ws.decode_buffers(self.spec, d)
            args = ((x, w13, w2, topk_weights, topk_ids, out, dh, bar) + bias13 + bias2,)
        else:
            v, route, glu, down, comb = self.kernels(M)
            T = max_tiles(M, self.spec.top_k, self.spec.experts, v.tile_m)
            R = T * v.tile_m
            # Slicing past the end would silently give shorter buffers and the kernels would run
            # off them: refuse instead.
            if ws.sorted_ids.numel() < R or ws.tile_expert.numel() < T or ws.h.shape[0] < R or \
                    ws.y.shape[0] < M * self.spec.top_k:
                raise KernelArgumentError(f"workspace too small for {M} tokens with tile_m {v.tile_m}; "
                                          "allocate it with Workspace.allocate(spec, max_tokens, device)")
            sorted_ids, tile_expert = ws.sorted_ids[:R], ws.tile_expert[:T]
            h, y = ws.h[:R], ws.y[: M * self.spec.top_k]
            libs = (route, glu, down, comb)
            args = ((topk_ids, ws.counts, ws.offsets, sorted_ids, tile_expert),
                    (x, w13, sorted_ids, tile_expert, h) + bias13,
                    (h, w2, sorted_ids, tile_expert, topk_weights, y) + bias2,
                    (y, topk_ids, out))
        key = (M, v, id(ws))
        plan = self._plans.get(key)
        if plan is None:
            # First call at this size: launch with full per-kernel contract checks, then keep the
            # filled argument structs; later calls only swap the caller's data pointers (every
            # other size and stride is fixed by M and the spec, and check_inputs re-checked them).
            t3 = time.perf_counter()
            # bind checks each kernel's contract and fills its argument structs once; launching
            # the bound kernels then checks nothing twice
            bound = tuple(lib.bind(*a) for lib, a in zip(libs, args))
            t4 = time.perf_counter()
            # the raw stream, as LayerPlan.run takes it: no torch.cuda.Stream object built
            index = self.device.index
            stream = current_stream(index) if index is not None else torch.cuda.current_stream(self.device).cuda_stream
            for launch in bound:
                launch(stream)
            t5 = time.perf_counter()
            if len(self._plans) >= 64:  # bounded: each plan keeps its workspace alive
                self._drop_plans()
            self._plans[key] = (ws,) + bound
            self._fast[(M, id(ws), id(self.variants))] = self._last = LayerPlan(
                ws, bound, self.spec, M, self.device, self.store.unpack_dir, self.variants)
            # where the first call at a size goes (tools/gpu_run.py --coldstart prints it)
            self.first_call_ms = {k: round(1e3 * (b - a), 4) for k, a, b in (
                ("check_inputs", t0, t1), ("workspace", t1, t2), ("kernels", t2, t3), ("bind", t3, t4),
                ("launch", t4, t5), ("plan", t5, time.perf_counter()))}
            return out
        bound = plan[1:]
        ptrs = (x, w13, w2, topk_weights, topk_ids, out, b13, b2)
        for i, k, a in feeds(bound):  # the caller's tensors into the kernels' arguments, by name
            bound[k].set_data(a, ptrs[i].data_ptr())
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for launch in bound:
            launch(stream)
        return out

    __call__ = forward

    # the caller's tensors in each fp8 kernel's arguments: (role, argument index, which);
    # everything else is the workspace's, fixed by the token count
    _FP8_CALLER_ARGS = (("routing", 0, "ids"), ("routing", 5, "x"), ("glu", 2, "w13"), ("glu", 3, "w13s"),
                        ("down", 2, "w2"), ("down", 3, "w2s"), ("down", 6, "tw"), ("combine", 1, "ids"),
                        ("combine", 2, "out"))
    # ... and in the fp8 one-launch decode kernel's (x, w13, w13s, w2, w2s, tw, ids, out, h, bar)
    _FP8_DECODE_CALLER_ARGS = tuple(("decode", i, k) for i, k in enumerate(("x", "w13", "w13s", "w2", "w2s", "tw",
                                                                          "ids", "out")))

    def _first_call_views(self, M: int, ws, inter):
        """The first call at a size of the quantized paths (fp8, mxfp4-w, block-scaled): the
        variant and its kernels at M tokens, the routing buffers sliced to its tiles, and R, the
        rows of its tiles; refuses a workspace whose routing buffers or intermediate ``inter``
        (h or hq) are too small for them."""
        v, libs = self.role_kernels(M)
        T = max_tiles(M, self.spec.top_k, self.spec.experts, v.tile_m)
        R = T * v.tile_m
        if ws.sorted_ids.numel() < R or ws.tile_expert.numel() < T or inter.shape[0] < R:
            raise KernelArgumentError(f"workspace too small for {M} tokens with tile_m {v.tile_m}; "
                                      "allocate it with Workspace.allocate(spec, max_tokens, device)")
        return v, libs, ws.sorted_ids[:R], ws.tile_expert[:T], R

    def _forward_fp8(self, x, w13, w2, topk_weights, topk_ids, out, workspace):
        """routing with x's quantization (one launch) -> GEMM1 (e4m3 h) -> GEMM2 -> combine. The first call at
        a size launches with the kernels' own contract checks and keeps the filled argument
        structs; later calls re-run check_inputs and swap the caller's data pointers, without
        choosing the variant or naming its kernels again."""
        self.check_inputs(x, w13, w2, topk_weights, topk_ids, out)
        M, K = x.shape[0], self.spec.top_k
        if out is None:
            out = torch.empty(M, self.spec.hidden, dtype=torch.bfloat16, device=self.device)
        if M == 0:
            return out
        ws = workspace or self.workspace(M)
        fast = self._fast.get((M, id(ws), id(self.variants)))
        if fast is not None:
            self._replay(fast[1], fast[2],
                         {"ids": topk_ids, "x": x, "w13": w13[0], "w13s": w13[1], "w2": w2[0], "w2s": w2[1],
                          "tw": topk_weights, "out": out})
            return out
        if ws.max_tokens < M or ws.xq is None:
            raise KernelArgumentError(f"workspace must be allocated for this fp8 layer and hold {M} tokens "
                                      f"(Workspace.allocate(spec, max_tokens, device))")
        d = self.decode_for(M)
        if d is not None:  # e4m3 weights with their scales, x and h unquantized: no routing, no combine
            dh, bar = ws.decode_buffers(self.spec, d)
            args = {"decode": (x, w13[0], w13[1], w2[0], w2[1], topk_weights, topk_ids, out, dh, bar)}
            self._launch_and_keep(M, d, ws, {"decode": self._lib(d.kernels(self.spec)[0])}, args,
                                  self._FP8_DECODE_CALLER_ARGS)
            return out
        v, libs, sorted_ids, tile_expert, R = self._first_call_views(M, ws, ws.hq)
        xq, xs, hq, hs, y = ws.xq[:M], ws.xs[:M], ws.hq[:R], ws.h_scales(R, v.h_block), ws.y[: M * K]
        args = {"routing": (topk_ids, ws.counts, ws.offsets, sorted_ids, tile_expert, x, xq, xs),
                "glu": (xq, xs, w13[0], w13[1], sorted_ids, tile_expert, hq, hs),
                "down": (hq, hs, w2[0], w2[1], sorted_ids, tile_expert, topk_weights, y),
                "combine": (y, topk_ids, out)}
        self._launch_and_keep(M, v, ws, libs, args, self._FP8_CALLER_ARGS)
        return out

    # the caller's tensors in each mxfp4-w kernel's arguments (role, argument index, which), as
    # _FP8_CALLER_ARGS; the biases only where the spec has them (the kernels' last tensors)
    _W4_CALLER_ARGS = (("routing", 0, "ids"), ("glu", 0, "x"), ("glu", 1, "w13q"), ("glu", 2, "w13s"),
                       ("down", 1, "w2q"), ("down", 2, "w2s"), ("down", 5, "tw"), ("combine", 1, "ids"),
                       ("combine", 2, "out"))
    _W4_BIAS_ARGS = (("glu", 6, "b13"), ("down", 7, "b2"))

    def _forward_w4(self, x, w13, w2, topk_weights, topk_ids, out, workspace):
        """routing -> GEMM1 + GLU -> GEMM2 -> combine with MXFP4 weights (W4Weight triples). As
        _forward_fp8: the first call at a size launches with the kernels' own contract checks
        and keeps the filled argument structs; later calls re-run check_inputs and swap the
        caller's data pointers."""
        self.check_inputs(x, w13, w2, topk_weights, topk_ids, out)
        M, K = x.shape[0], self.spec.top_k
        if out is None:
            out = torch.empty(M, self.spec.hidden, dtype=torch.bfloat16, device=self.device)
        if M == 0:
            return out
        ws = workspace or self.workspace(M)
        if ws.max_tokens < M:
            raise KernelArgumentError(f"workspace holds {ws.max_tokens} tokens, x has {M}")
        fast = self._fast.get((M, id(ws), id(self.variants)))
        if fast is not None:
            self._replay(fast[1], self._W4_CALLER_ARGS + (self._W4_BIAS_ARGS if self.spec.bias else ()),
                         {"ids": topk_ids, "x": x, "w13q": w13[0], "w13s": w13[1], "w2q": w2[0], "w2s": w2[1],
                          "tw": topk_weights, "out": out, "b13": w13[2], "b2": w2[2]})
            return out
        v, libs, sorted_ids, tile_expert, R = self._first_call_views(M, ws, ws.h)
        h, y = ws.h[:R], ws.y[: M * K]
        b13, b2 = ((w13[2],), (w2[2],)) if self.spec.bias else ((), ())
        args = {"routing": (topk_ids, ws.counts, ws.offsets, sorted_ids, tile_expert),
                "glu": (x, w13[0], w13[1], sorted_ids, tile_expert, h) + b13,
                "down": (h, w2[0], w2[1], sorted_ids, tile_expert, topk_weights, y) + b2,
                "combine": (y, topk_ids, out)}
        self._launch_and_keep(M, v, ws, libs, args)
        return out

    # the caller's tensors in each block-scaled kernel's arguments, as _FP8_CALLER_ARGS; nvfp4's
    # global amaxes after them (x's from the workspace unless w13 carries a calibrated one)
    _BS_CALLER_ARGS = (("routing", 0, "ids"), ("bsquant", 0, "x"), ("glu", 2, "w13q"), ("glu", 3, "w13s"),
                       ("down", 2, "w2q"), ("down", 3, "w2s"), ("down", 6, "tw"), ("combine", 1, "ids"),
                       ("combine", 2, "out"))
    _NV_CALLER_ARGS = (("glu", 9, "w13g"), ("glu", 10, "hg"), ("down", 8, "hg"), ("down", 9, "w2g"))
    _NV_X_AMAX_ARGS = (("bsquant", 3, "xg"), ("glu", 8, "xg"))

    def _forward_bs(self, x, w13, w2, topk_weights, topk_ids, out, workspace):
        """routing -> x quantized (bsquant) -> GEMM1 (h quantized in its epilogue) -> GEMM2 ->
        combine, with BlockScaledWeights (mxfp8, nvfp4, w4a8-mx). nvfp4: x's global amax is taken on the
        device into the workspace (one torch reduction on the current stream, no host sync) unless
        w13 carries a calibrated input_amax; h's is w2's input_amax. As _forward_fp8: the first
        call at a size launches with the kernels' own contract checks and keeps the filled
        argument structs; later calls re-run check_inputs and swap the caller's data pointers."""
        self.check_inputs(x, w13, w2, topk_weights, topk_ids, out)
        M, K = x.shape[0], self.spec.top_k
        nv = self.spec.precision == "nvfp4"
        if out is None:
            out = torch.empty(M, self.spec.hidden, dtype=torch.bfloat16, device=self.device)
        if M == 0:
            return out
        ws = workspace or self.workspace(M)
        if ws.max_tokens < M or ws.xq is None or ws.xq.dtype != torch.uint8 or (nv and ws.xg is None):
            raise KernelArgumentError(f"workspace must be allocated for this {self.spec.precision} layer and hold {M} "
                                      "tokens (Workspace.allocate(spec, max_tokens, device))")
        xg = w13.input_amax
        if nv and xg is None:  # x's amax on the device: max |x| in fp32, exact
            xg = ws.xg
            torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=xg.view(()))
        ptrs = {"ids": topk_ids, "x": x, "w13q": w13.values, "w13s": w13.scales, "w2q": w2.values,
                "w2s": w2.scales, "tw": topk_weights, "out": out, "w13g": w13.global_amax, "w2g": w2.global_amax,
                "hg": w2.input_amax, "xg": xg, "b13": w13.bias, "b2": w2.bias}
        fast = self._fast.get((M, id(ws), id(self.variants)))
        if fast is not None:
            args = self._BS_CALLER_ARGS + ((self._NV_CALLER_ARGS + self._NV_X_AMAX_ARGS) if nv else ())
            if self.spec.bias:  # the biases follow the global amaxes (none for the mx formats)
                args += (("glu", 11 if nv else 8, "b13"), ("down", 10 if nv else 8, "b2"))
            self._replay(fast[1], args, ptrs)
            return out
        v, libs, sorted_ids, tile_expert, R = self._first_call_views(M, ws, ws.hq)
        xq, xs, hq, hs, y = ws.xq[:M], ws.xs[:M], ws.hq[:R], ws.hs[:R], ws.y[: M * K]
        gx, g13, gh, g2 = ((xg,), (w13.global_amax,), (w2.input_amax,), (w2.global_amax,)) if nv else ((),) * 4
        b13, b2 = ((w13.bias,), (w2.bias,)) if self.spec.bias else ((), ())
        args = {"routing": (topk_ids, ws.counts, ws.offsets, sorted_ids, tile_expert),
                "bsquant": (x, xq, xs) + gx,
                "glu": (xq, xs, w13.values, w13.scales, sorted_ids, tile_expert, hq, hs) + gx + g13 + gh + b13,
                "down": (hq, hs, w2.values, w2.scales, sorted_ids, tile_expert, topk_weights, y) + gh + g2 + b2,
                "combine": (y, topk_ids, out)}
        self._launch_and_keep(M, v, ws, libs, args)
        return out

    def _replay(self, bound: dict, caller_args, ptrs: dict) -> None:
        """A repeated call of the fp8 and mxfp4-w paths: point the kept argument structs at the
        caller's tensors (``caller_args``: (role, argument index, key of ``ptrs``)), then launch
        them in the variant's role order on the current stream."""
        for role, index, which in caller_args:
            bound[role].set_data(index, ptrs[which].data_ptr())
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for launch in bound.values():
            launch(stream)

    def _launch_and_keep(self, M, v, ws, libs, args, caller_args=None) -> None:
        """The first call at a size of the quantized paths: launch each kernel (role order) with
        its full contract checks, then keep the bound argument structs that later calls only
        re-point at the caller's tensors (``caller_args``: which, for a path whose kernels at a
        size may differ, e.g. fp8's four or its one-launch decode kernel)."""
        for role, lib in libs.items():  # role_kernels gives them in launch order
            lib(*args[role])
        if len(self._plans) >= 64:  # bounded: each plan keeps its workspace alive
            self._plans.clear()
            self._fast.clear()
        bound = {role: lib.bind(*args[role]) for role, lib in libs.items()}
        self._plans[(M, v, id(ws))] = (ws,) + tuple(bound.values())  # for launchers()
        self._fast[(M, id(ws), id(self.variants))] = (ws, bound, caller_args)

    def training_kernel(self, tokens: int) -> KernelLibrary | None:
        """The GEMM1 of this token count's variant that also writes the pre-activations
        (variants.training_kernels, `moe-aot build --backward`), or None where its template has
        no such output or the database lacks it."""
        v = self.variant_for(tokens)
        kvs = training_kernels(self.spec, v)
        if not kvs:
            return None
        key = kvs[0].name
        if key not in self._libs:
            try:
                self._libs[key] = self.store.load(key, self.spec.target, self.device.index)
            except KernelMissingError:
                self._libs[key] = None
        return self._libs[key]

    def forward_train(self, x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, preact=None):
        """The forward of a training step: (out, preact), with preact [M * top_k + 1, 2I] bf16
        the GLU's input of every routed pair p = m * top_k + k (gate/up sums with b13, in w13's
        interleaved column order) in row p, written by GEMM1's epilogue, and its last row zeros
        (rows of pairs with an id outside [0, E) are not written). None where this token
        count's GEMM1 has no such twin in the database (the caller computes preact itself).
        Every kernel is launched with its full argument checks (no cached plan: a training
        step is GPU-bound), on the current stream, without host sync. ``preact``: the buffer to
        write (for tests), else a new one."""
        train = self.training_kernel(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        if train is None:
            return None
        self.check_inputs(x, w13, w2, topk_weights, topk_ids, None, b13, b2)
        M, K = x.shape[0], self.spec.top_k
        out = torch.empty(M, self.spec.hidden, dtype=torch.bfloat16, device=self.device)
        want = (M * K + 1, 2 * self.spec.intermediate)
        if preact is None:
            preact = torch.empty(want, dtype=torch.bfloat16, device=self.device)
        elif not (isinstance(preact, torch.Tensor) and tuple(preact.shape) == want and preact.dtype == torch.bfloat16
                  and preact.device == self.device and preact.is_contiguous()):
            raise KernelArgumentError(f"preact must be a contiguous bf16 tensor of shape {want} on {self.device}")
        preact[-1].zero_()
        if M == 0:
            return out, preact
        ws = self.workspace(M)
        v, route, _, down, comb = self.kernels(M)
        T = max_tiles(M, K, self.spec.experts, v.tile_m)
        R = T * v.tile_m
        sorted_ids, tile_expert = ws.sorted_ids[:R], ws.tile_expert[:T]
        h, y = ws.h[:R], ws.y[: M * K]
        bias13, bias2 = ((b13,), (b2,)) if self.spec.bias else ((), ())
        route(topk_ids, ws.counts, ws.offsets, sorted_ids, tile_expert)
        train(x, w13, sorted_ids, tile_expert, h, *bias13, preact)
        down(h, w2, sorted_ids, tile_expert, topk_weights, y, *bias2)
        comb(y, topk_ids, out)
        return out, preact

    def launchers(self, tokens: int, workspace: Workspace | None = None) -> dict:
        """The kernels of the last forward at `tokens` by role (the four, or the one-launch decode
        kernel's "decode"), bound to its arguments (each is called with a stream): for tools that
        time the kernels one by one."""
        ws = workspace or self.workspace(tokens)
        v = self.served(tokens)
        plan = self._plans.get((tokens, v, id(ws)))
        if plan is None:
            raise KeyError(f"no forward at {tokens} tokens with this workspace yet")
        kvs = v.kernels(self.spec) if isinstance(v, DecodeVariant) else self.kernel_variants(v)
        return dict(zip((kv.role for kv in kvs), plan[1:]))

    def route(self, topk_ids, tile_m: int | None = None):
        """Routing alone (for tests and tools): returns counts, offsets, sorted_ids, tile_expert."""
        M = topk_ids.shape[0]
        v = self.variant_for(M)
        if tile_m is not None and tile_m != v.tile_m:
            v = dataclasses.replace(v, tile_m=tile_m)
        route = self._lib(v.kernels(self.spec)[0])
        T = max_tiles(M, self.spec.top_k, self.spec.experts, v.tile_m)
        dev = dict(dtype=torch.int32, device=self.device)
        bufs = (torch.empty(self.spec.experts, **dev), torch.empty(self.spec.experts + 1, **dev),
                torch.empty(T * v.tile_m, **dev), torch.empty(T, **dev))
        route(topk_ids, *bufs, *self._quant_scratch(M))
        return bufs

    def _quant_scratch(self, M: int) -> tuple:
        """fp8 layers, whose routing launch also quantizes x: a zero x [M, H] and room for its
        quantization, for a caller that wants the routing alone; () otherwise."""
        if self.spec.precision not in QUANT_IN_ROUTING:
            return ()
        from . import fp8

        H, blk = self.spec.hidden, fp8.x_block(self.spec.precision)
        return (torch.zeros(M, H, dtype=torch.bfloat16, device=self.device),
                torch.empty(M, H, dtype=fp8.E4M3, device=self.device),
                torch.empty((M,) if blk is None else (M, H // blk), dtype=torch.float32, device=self.device))


_LAYERS: dict[tuple, MoeLayer] = {}


def moe_forward(x, w13_prepared, w2, topk_weights, topk_ids, out=None, workspace=None,
                activation: str = "swiglu", store: KernelStore | None = None, target: str | None = None):
    """One call for the whole fused layer; the layer shape is read off the tensors. bf16:
    w13_prepared from prepare_weights(), w2 a tensor; fp8: both (e4m3 weights, fp32 scales) pairs
    from prepare_fp8_weights() or fp8.from_block128_checkpoint(), the precision read off the
    scales' shape (w13 scales [E, 2]: "fp8", [E, 2I/128, H/128]: "fp8-block128"). Expert biases
    (gpt-oss, activation="swigluoai"): both as (bf16 weights, bf16 biases) pairs, (w13, b13 from
    prepare_biases()) and (w2, b2 [E, H]). mxfp4-w (gpt-oss's MXFP4 experts): both as W4Weight
    (blocks, scales, bias) triples from w4.from_gpt_oss() or w4.prepare_weights(). mxfp8 / nvfp4
    (the DGX Spark's block-scaled layers): both as BlockScaledWeights from blockscaled.prepare_w13()
    and prepare_w2(), the precision read off them (nvfp4's carry global amaxes; w2 the calibrated
    amax of h: blockscaled.with_input_amax; packed e2m1 values with ue8m0 scales: w4a8-mx, from
    blockscaled.from_gpt_oss() or prepare_w13/w2(..., "w4a8-mx")). `target`: the kernels' target (default: this GPU's;
    e.g. "sm_121a-standin" runs the Spark layer's sm_90a stand-ins on an H100/H200)."""
    precision, bias = "bf16", False
    w13 = w13_prepared
    shape = None  # (E, 2I, H) where w13 is not a plain [E, 2I, H] tensor
    from .blockscaled import BlockScaledWeight

    if isinstance(w13_prepared, BlockScaledWeight):
        if isinstance(w13_prepared.scales, torch.Tensor) and w13_prepared.scales.dim() == 3:
            precision = "mxfp8" if w13_prepared.global_amax is None else "nvfp4"
            bias = w13_prepared.bias is not None
            E, I2, ks = w13_prepared.scales.shape
            kp = ks * BLOCKSCALE_BLOCK[precision]  # the stored K (padded to whole k-tiles)
            # hidden is x's width: the weights' K may be padded past it (gemm_limits.bs_padded_k)
            hd = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] <= kp else kp
            shape = (E, I2, hd)
            vals = w13_prepared.values
            if precision == "mxfp8" and isinstance(vals, torch.Tensor) and vals.dim() == 3 and \
                    vals.shape[2] * 2 == kp:
                precision = "w4a8-mx"  # packed e2m1 values (half a byte each) with ue8m0 scales
    if shape is not None:
        pass
    elif isinstance(w13_prepared, (tuple, list)) and len(w13_prepared) == 3 and \
            isinstance(w13_prepared[0], torch.Tensor) and w13_prepared[0].dtype == torch.uint8:
        # mxfp4-w: blocks in fragment order [E, 2I / 16, H / 64, 512] (runtime/w4.py)
        w13, precision, bias = w13_prepared[0], "mxfp4-w", w13_prepared[2] is not None
        if w13.dim() != 4:
            raise KernelArgumentError(f"mxfp4-w w13 blocks must be [experts, 2*intermediate/16, hidden/64, 512] "
                                      f"uint8 from w4.from_gpt_oss() or w4.prepare_weights(), got {tuple(w13.shape)}")
        rows, cols = W4_CHUNK
        shape = (w13.shape[0], w13.shape[1] * rows, w13.shape[2] * cols)
    elif isinstance(w13_prepared, (tuple, list)) and len(w13_prepared) == 2 and \
            all(isinstance(t, torch.Tensor) for t in w13_prepared):
        w13, second = w13_prepared
        if w13.dtype == torch.bfloat16:
            bias = True
        else:
            precision = "fp8" if second.dim() == 2 else "fp8-block128"
    if shape is None and (not isinstance(w13, torch.Tensor) or w13.dim() != 3):
        raise KernelArgumentError("w13_prepared must be a [experts, 2*intermediate, hidden] tensor "
                                  "from prepare_weights(), an fp8 (weights, scales) pair from "
                                  "prepare_fp8_weights(), or a BlockScaledWeight from blockscaled.prepare_w13()")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise KernelArgumentError("topk_ids must be a [tokens, top_k] int32 tensor")
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        raise KernelArgumentError("x must be a CUDA tensor [tokens, hidden] (bf16)")
    E, I2, H = shape or w13.shape
    layer = _layer_for(E, topk_ids.shape[1], H, I2 // 2, activation, precision, bias, x.device, store, target)
    return layer.forward(x, w13_prepared, w2, topk_weights, topk_ids, out, workspace)


def release_workspaces() -> int:
    """Drop the workspaces of every layer the process has cached (moe_forward, the torch op, the
    autograd function): at 16384 tokens each holds GB of buffers sized for the largest call so
    far, which stay allocated between calls. Call torch.cuda.empty_cache() after it to hand the
    memory back to the driver. Returns the bytes released; the layers and their loaded kernels
    stay, and the next call at a size allocates that size's workspace again."""
    return sum(layer.release_workspace() for layer in _LAYERS.values())


def _layer_for(experts, top_k, hidden, intermediate, activation, precision, bias, device, store,
               target: str | None = None) -> MoeLayer:
    """The process's MoeLayer of this shape on this CUDA device (for `target`, default the
    device's), made at first use."""
    key = (experts, top_k, hidden, intermediate, activation, precision, bias, device.index, target)
    layer = _LAYERS.get(key)
    if layer is None:
        spec = make_spec(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                         activation=activation, precision=precision, bias=bias,
                         target=target or device_target(device))
        layer = _LAYERS[key] = MoeLayer(spec, store=store, device=device.index)
    return layer


def moe_forward_train(x, w13, w2, topk_weights, topk_ids, activation: str = "swiglu", b13=None, b2=None,
                      store: KernelStore | None = None):
    """MoeLayer.forward_train of the bf16 layer these tensors describe (biases as b13 / b2), or
    None where the database has no GEMM1 that keeps the pre-activations for this token count."""
    E, I2, H = w13.shape
    layer = _layer_for(E, topk_ids.shape[1], H, I2 // 2, activation, "bf16", b13 is not None, x.device, store)
    return layer.forward_train(x, w13, w2, topk_weights, topk_ids, b13, b2)


_BACKWARD: dict[tuple, object] = {}


def _backward_store(spec: LayerSpec, key: tuple, device: torch.device, store: KernelStore | None) -> KernelStore:
    """The store the forward's layer of this shape loaded from (else a default one)."""
    layer = _LAYERS.get((*key[:5], "bf16", spec.bias, device.index, None))
    return store or (layer.store if layer is not None else KernelStore())


def glu_backward_kernel(experts: int, top_k: int, hidden: int, intermediate: int, activation: str, bias: bool,
                        device: torch.device, store: KernelStore | None = None):
    """The compiled GLU backward of this layer shape for `device` (`moe-aot build --backward`), or
    None when the database has none (the caller then computes it in torch ops); looked up once per
    shape and device."""
    key = (experts, top_k, hidden, intermediate, activation, bias, device.index)
    if key not in _BACKWARD:
        spec = make_spec(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                         activation=activation, bias=bias, target=device_target(device))
        store = _backward_store(spec, key, device, store)
        try:
            kv = next(kv for kv in backward_kernels(spec) if kv.role == "glu_bwd")
            _BACKWARD[key] = store.load(kv.name, spec.target, device.index)
        except KernelMissingError:
            _BACKWARD[key] = None
    return _BACKWARD[key]


@dataclasses.dataclass(frozen=True)
class BackwardGemms:
    """The backward's fused data path of one layer shape (variants.backward_gemm_kernels): the
    routing of tile_m-row tiles, dH with the GLU's backward, dX and the combine, loaded."""
    tile_m: int
    dh_tile_n: int
    routing: KernelLibrary
    dh: KernelLibrary
    dx: KernelLibrary
    combine: KernelLibrary


def backward_gemms(experts: int, top_k: int, hidden: int, intermediate: int, activation: str, bias: bool,
                   device: torch.device, store: KernelStore | None = None, tiles=None,
                   tile_m: int = BWD_TILE_M) -> BackwardGemms | None:
    """The backward's fused data GEMMs of this layer shape for `device` (`moe-aot build --backward`
    on sm_90a) with the routing in tile_m-row tiles, or None when the target has none or the
    database lacks any of them (the backward then multiplies with torch's grouped GEMMs); looked up
    once per shape, height and device. ``tiles``: (dH, dX) GemmTiles other than the defaults at
    that height (a BackwardVariant's, tools/check_backward.py)."""
    from ..variants import backward_gemm_kernels, backward_gemm_tiles

    key = (experts, top_k, hidden, intermediate, activation, bias, device.index, "gemms", tiles, tile_m)
    if key not in _BACKWARD:
        spec = make_spec(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                         activation=activation, bias=bias, target=device_target(device))
        tiles = tiles or backward_gemm_tiles(spec, tile_m)
        _BACKWARD[key] = None
        if tiles is not None:
            kvs = backward_gemm_kernels(spec, *tiles, tile_m)
            try:
                libs = _backward_store(spec, key, device, store).load_many([kv.name for kv in kvs], spec.target,
                                                                           device.index)
            except KernelMissingError:
                libs = None
            if libs is not None:
                _BACKWARD[key] = BackwardGemms(tile_m, tiles[0].tile_n, *(libs[kv.name] for kv in kvs))
    return _BACKWARD[key]


def backward_plan(experts: int, top_k: int, hidden: int, intermediate: int, activation: str, bias: bool,
                  device: torch.device, tokens: int, store: KernelStore | None = None, variant=None):
    """(BackwardVariant, BackwardGemms, weight-gradient kernels or None) of the fused backward at
    this token count on `device`: the tuned pick of its bucket for this GPU (`moe-aot tune
    --backward`, deployed by `build --backward`), else the bucket's default (variants.default_backward),
    else that default with torch's weight gradients; the first whose kernels the database has.
    None where none of them is there or the target has no fused backward (the backward then
    multiplies with torch's grouped GEMMs). A pick (or ``variant``) of torch's data GEMMs
    (variants.TORCH_DATA) is served as (variant, None, None): the backward multiplies with torch's
    grouped GEMMs by choice, its GLU part compiled where the database has it (glu_backward_kernel).
    ``variant``: that BackwardVariant only (the tuner)."""
    from ..variants import default_backward
    from .wgrad import wgrad_kernels_for

    shape = (experts, top_k, hidden, intermediate, activation, bias, device.index)
    key = (*shape, "plan", tokens, variant)
    if key in _BACKWARD:
        return _BACKWARD[key]
    spec = make_spec(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                     activation=activation, bias=bias, target=device_target(device))
    store = _backward_store(spec, shape, device, store)
    if variant is not None:
        tries = [variant]
    else:
        if (*shape, "picks") not in _BACKWARD:
            _BACKWARD[(*shape, "picks")] = store.picks(spec, torch.cuda.get_device_name(device), backward=True)
        dflt = default_backward(spec, tokens)
        tries = [_BACKWARD[(*shape, "picks")].get(bucket_for(tokens)), dflt,
                 dflt and dataclasses.replace(dflt, wgrad=None)]
    _BACKWARD[key] = None
    for v in tries:
        if v is None:
            continue
        if v.torch_data:
            _BACKWARD[key] = (v, None, None)
            break
        gemms = backward_gemms(experts, top_k, hidden, intermediate, activation, bias, device, store, (v.dh, v.dx),
                               v.tile_m)
        wk = None if v.wgrad is None else wgrad_kernels_for(experts, top_k, hidden, intermediate, device, store,
                                                             v.wgrad)
        if gemms is not None and (v.wgrad is None or wk is not None):
            _BACKWARD[key] = (v, gemms, wk)
            break
    return _BACKWARD[key]


def prepare_fp8_weights(w_gate, w_up, w2, precision: str = "fp8-block128"):
    """bf16 (or fp32) gate, up [E, I, H] and down [E, H, I] weights -> the fp8 layer's
    ((w13, w13 scales), (w2, w2 scales)), quantized once at weight-load time (w13 gate/up
    interleaved as prepare_weights does, its scales with it). Prequantized DeepSeek-V3 experts:
    fp8.from_block128_checkpoint."""
    from . import fp8

    w13 = fp8.prepare_w13(w_gate, w_up, precision, INTERLEAVE)
    return w13, fp8.prepare_w2(w2, precision)


# the compute capability each target's cubins load on (an `a` arch's run on that one only)
TARGET_CAPABILITIES = {"sm_90a": (9, 0), "sm_100a": (10, 0), "sm_121a": (12, 1)}


def device_target(device) -> str:
    """The kernel target for a CUDA device; fails closed on GPUs we build nothing for."""
    if not torch.cuda.is_available():
        raise KernelArgumentError("moe-aot kernels need a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability(device)
    targets = {cc: t for t, cc in TARGET_CAPABILITIES.items()}
    if (major, minor) not in targets:
        raise KernelArgumentError(f"GPU compute capability {major}.{minor} has no moe-aot target "
                                  f"(built for {', '.join(f'{a}.{b}' for a, b in targets)})")
    return targets[(major, minor)]
