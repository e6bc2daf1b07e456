"""Variants: every compile-time choice of a layer's kernels as a frozen value with one name.

A layer runs four kernels: routing (pads each expert's rows to tile_m), GEMM1 + GLU, GEMM2 with
the routing weight, and the top-k combine. tile_m is shared by the routing and both GEMMs; each
GEMM has its own tiles. A kernel's canonical name spells out every argument its template is
built with (target, precision, layer shape, tiles, ...), so the name is its database key (with
the toolchain fingerprint beside it); `can_implement` is the one place that knows each target's
limits, used both to prune the tuner's search and to explain refusals to users.

Pure Python: the runtime imports this module, so it must not import cutlass or the templates.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import field

from . import gemm_limits as limits
from .spec import BENCH_TOKENS, LayerSpec, value_class

# Which MMA families each target offers the tuner (what each can be built with, shared memory
# included: gemm_limits.py, the templates' own rules). "hopws"
# (sm_90a: templates/hopper_gemm.py, persistent warp-specialized CTAs on the DSL's TMA pipeline)
# is the large-token default since its H200 checks of 2026-12-01 (tools/results/NOTES.md);
# "hoppp" is its ping-pong form (two consumer warpgroups on alternate 64-row tiles). "umma"
# (sm_100a: templates/blackwell_gemm.py, persistent CTAs on tcgen05 with TMEM accumulators) is
# compiled only: no Blackwell GPU was available to run or measure it.
TARGET_LIMITS = {
    "sm_90a": {"mma": ("warp", "hopws", "hoppp"), "sms": 132, "clusters": (1, 2, 4, 8, 16)},
    "sm_100a": {"mma": ("warp", "umma"), "sms": 148, "clusters": (1, 2, 4, 8, 16)},
    "sm_121a": {"mma": ("warp",), "sms": 48, "clusters": (1,)},
}
TARGET_LIMITS = limits.with_standins(TARGET_LIMITS)  # a stand-in is sized as its model (GB10's 48 SMs)
INTERLEAVE = 16  # gate/up rows alternate in blocks of this many rows in the prepared w13
# The precision registry: the kernel roles of a layer in launch order, and which MMA families a
# target offers that precision (the templates' rules for it: gemm_limits.check_fp8). fp8's routing
# launch also quantizes x for GEMM1 (QUANT_IN_ROUTING: templates/routing.py MoeRoutingQuant).
PRECISION_ROLES = {"bf16": ("routing", "glu", "down", "combine"),
                   "fp8": ("routing", "glu", "down", "combine"),
                   "fp8-block128": ("routing", "glu", "down", "combine"),
                   "mxfp4-w": ("routing", "glu", "down", "combine"),
                   # block-scaled: x quantized by templates/blockscale_quant.py ("bsquant"), h by GEMM1
                   "mxfp8": ("routing", "bsquant", "glu", "down", "combine"),
                   "nvfp4": ("routing", "bsquant", "glu", "down", "combine"),
                   "w4a8-mx": ("routing", "bsquant", "glu", "down", "combine")}  # x to mxfp8, weights mxfp4
QUANT_IN_ROUTING = limits.FP8
PRECISION_MMAS = {"bf16": None, "fp8": limits.FP8_MMAS, "fp8-block128": limits.FP8_MMAS,  # None: all
                  "mxfp4-w": limits.W4_MMAS, "mxfp8": limits.BS_MMAS, "nvfp4": limits.BS_MMAS,
                  "w4a8-mx": limits.BS_MMAS}


def arch_tag(target: str) -> str:
    """The target in kernel names (C identifiers): "sm90a"; a stand-in "sm121a_standin"."""
    return target.replace("_", "").replace("-", "_")


@value_class(order=True)
class GemmTiles:
    """Tunables of one grouped GEMM (tile_m lives in the LayerVariant: routing shares it)."""
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 3
    mma: str = "warp"
    # CTAs per cluster along M. hopws: 2 multicasts each weight tile to two 128-row M tiles of one
    # expert; umma: 2 is a 2-CTA tcgen05 pair on one 256-row tile (the layer's tile_m 256). Named
    # only when > 1, so every cluster-1 name (and database key) is unchanged.
    cluster: int = 1
    # hopws / hoppp in single CTAs (gemm_limits.raster_applies): raster groups cut at expert
    # boundaries (templates/hopper_gemm.py), so that no short expert's weight tiles are read by two
    # groups. Named ("xe") only when set, so every older name (and database key) is unchanged.
    raster_experts: bool = False
    # k-tiles whose partial sums the tensor cores add up before one promotion (gemm_limits.
    # PROMOTE_EVERY, check_promote_every): > 1 only for "fp8" GEMM1 tiles promoted in column parts
    # (templates/hopper_fp8.py _mainloop_grouped). Named ("p2") only when > 1, so every older name
    # (and database key) is unchanged.
    promote: int = 1
    # GEMM1: the activation's sigmoid reciprocal as rcp.approx (templates/grouped_gemm.py glu_act,
    # gemm_limits.check_fast_act). Named ("fa") only when set, so every older name (and database
    # key) is unchanged, and so are the binaries the committed picks were measured with.
    fast_act: bool = False

    def __init__(self, tile_n: int = 128, tile_k: int = 64, stages: int = 3, mma: str = "warp", cluster: int = 1,
                 raster_experts: bool = False, promote: int = 1, fast_act: bool = False):
        vars(self).update(tile_n=tile_n, tile_k=tile_k, stages=stages, mma=mma, cluster=cluster,
                          raster_experts=raster_experts, promote=promote, fast_act=fast_act)

    @property
    def tag(self) -> str:
        return _render(self, GEMM_NAME)

    @property
    def cluster_tag(self) -> str:
        return f"c{self.cluster}" if self.cluster > 1 else ""

    def params(self, precision: str = "bf16") -> tuple:
        """The template constructor arguments these tunables set (cluster_m only when > 1,
        raster_experts only when set, the precision only when not bf16, so every bf16 kernel is
        built exactly as before)."""
        return ((("tile_n", self.tile_n), ("tile_k", self.tile_k), ("stages", self.stages), ("mma", self.mma))
                + ((("cluster_m", self.cluster),) if self.cluster > 1 else ())
                + ((("raster_experts", True),) if self.raster_experts else ())
                + ((("promote_every", self.promote),) if self.promote > 1 else ())
                + ((("fast_act", True),) if self.fast_act else ())
                + ((("precision", precision),) if precision != "bf16" else ()))


@value_class
class KernelVariant:
    """One kernel to compile: its role, canonical name and the template's constructor arguments."""
    role: str  # "routing" | "glu" | "down" | "combine"
    name: str
    params: tuple = field(compare=False)  # ((key, value), ...) in constructor order

    def __init__(self, role: str, name: str, params: tuple):
        vars(self).update(role=role, name=name, params=params)

    def kwargs(self) -> dict:
        return dict(self.params)


_DEFAULT_TILES = GemmTiles()


@value_class
class LayerVariant:
    """Every compile-time choice of a layer's kernels; its name is its database key."""
    tile_m: int = 64
    glu: GemmTiles = _DEFAULT_TILES
    down: GemmTiles = _DEFAULT_TILES
    route_cluster: int = 1  # CTAs of the routing kernel's cluster: 1 for few tokens, 8-16 for many
    # Programmatic dependent launch: GEMM1, GEMM2 and the combine launch while their predecessor
    # still runs and wait on the chip (griddepcontrol); GEMM2 fetches its first weight k-tiles
    # before that wait. Off in the defaults until measured on the GPU.
    pdl: bool = False
    # fp8: columns of h per scale, written by GEMM1 and read by GEMM2 (gemm_limits.check_h_block):
    # a property of the pair, as tile_m is of the routing and both GEMMs. Named only when not 64,
    # so every older name (and database key) is unchanged.
    h_block: int = limits.H_SCALE_BLOCK

    def __init__(self, tile_m: int = 64, glu: GemmTiles = _DEFAULT_TILES, down: GemmTiles = _DEFAULT_TILES,
                 route_cluster: int = 1, pdl: bool = False, h_block: int = limits.H_SCALE_BLOCK):
        vars(self).update(tile_m=tile_m, glu=glu, down=down, route_cluster=route_cluster, pdl=pdl, h_block=h_block)

    def name(self, spec: LayerSpec) -> str:
        return (f"moe_layer_{arch_tag(spec.target)}_{spec.precision_tag}_{spec.shape_tag}_{spec.activation}"
                + _render(self, LAYER_NAME))

    @property
    def _pdl_tag(self) -> str:
        return "_pdl" if self.pdl else ""

    def pdl_twin(self) -> "LayerVariant":
        """The same kernels with programmatic dependent launch flipped (measured side by side)."""
        return dataclasses.replace(self, pdl=not self.pdl)

    def h_block_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """The same kernels with h scaled per 128 columns (GEMM2 promoting once per k-tile) where
        GEMM1's tiles write whole 128-column blocks; None otherwise (or if it already is)."""
        if self.h_block == 128:
            return None
        twin = dataclasses.replace(self, h_block=128)
        return twin if can_implement(spec, twin)[0] else None

    def cluster_twins(self) -> list["LayerVariant"]:
        """hopws GEMMs at cluster 1 -> the same with GEMM2, then both GEMMs, in 2-CTA clusters
        (weight tiles multicast); umma GEMMs at tile_m 128 -> both as 2-CTA pairs on 256-row tiles
        (the routing's too: tile_m is shared). Measured side by side by the tuner's seeds; []
        otherwise."""
        if self.glu.mma in limits.UMMA and self.down.mma in limits.UMMA and self.tile_m == limits.UMMA_CTA_M:
            return [dataclasses.replace(self, tile_m=limits.UMMA_PAIR_TILE_M,
                                        glu=dataclasses.replace(self.glu, cluster=2),
                                        down=dataclasses.replace(self.down, cluster=2))]
        if not limits.cluster_applies(self.down.mma, self.tile_m) or self.down.cluster != 1:
            return []
        down = dataclasses.replace(self, down=dataclasses.replace(self.down, cluster=2))
        out = [down]
        if limits.cluster_applies(self.glu.mma, self.tile_m) and self.glu.cluster == 1:
            out.append(dataclasses.replace(down, glu=dataclasses.replace(self.glu, cluster=2)))
        return out

    def raster_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """The same layer with each GEMM that can (gemm_limits.raster_applies: hopws / hoppp in
        single CTAs) cutting its raster groups at expert boundaries; None where neither GEMM can
        or both already do (measured side by side by the tuner's seeds)."""
        glu, down = (dataclasses.replace(t, raster_experts=True)
                     if limits.raster_applies(t.mma, t.cluster, spec.precision) else t for t in (self.glu, self.down))
        twin = dataclasses.replace(self, glu=glu, down=down)
        return twin if twin != self and can_implement(spec, twin)[0] else None

    def promote_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """The same layer with GEMM1 promoted once per 2 k-tiles ("fp8" GEMM1 in column parts,
        gemm_limits.check_promote_every); None where GEMM1 cannot or already does (measured side
        by side by the tuner's seeds)."""
        if self.glu.promote != 1:
            return None
        twin = dataclasses.replace(self, glu=dataclasses.replace(self.glu, promote=2))
        return twin if can_implement(spec, twin)[0] else None

    def fast_act_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """The same layer with GEMM1's activation on rcp.approx (GemmTiles.fast_act); None where
        GEMM1 cannot or already does (measured side by side by the tuner's seeds)."""
        if self.glu.fast_act:
            return None
        twin = dataclasses.replace(self, glu=dataclasses.replace(self.glu, fast_act=True))
        return twin if can_implement(spec, twin)[0] else None

    def shallow_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """The same layer with GEMM1's ring SHALLOW_STAGES deep where GEMM1 is a 128-row
        cooperative tile (hopws) with a deeper ring that promotes every k-tile; None otherwise.
        Measured side by side by the tuner's seeds: on an H100 the shallow ring made GEMM1 faster
        at long k-loops (bf16 / fp8-block128 DeepSeek-V3, 3-6% of the layer) and fp8 GEMM1 promoting
        once per 2 k-tiles slower (tools/results/NOTES.md, forty-sixth session)."""
        t = self.glu
        if t.mma != "hopws" or self.tile_m < 128 or t.stages <= SHALLOW_STAGES or t.promote != 1:
            return None
        twin = dataclasses.replace(self, glu=dataclasses.replace(t, stages=SHALLOW_STAGES))
        return twin if can_implement(spec, twin)[0] else None

    def pingpong_twin(self, spec: LayerSpec) -> "LayerVariant | None":
        """This layer on 64-row ping-pong tiles (mma "hoppp") in both GEMMs, routing and PDL as
        here: each GEMM keeps its tile_n where it is a wgmma tile and valid, else takes the widest
        of 256, 192, 128 that is, with the deepest pipeline shared memory allows (measured side by side by the
        tuner's seeds). None where the target has no hoppp or no such variant is valid."""
        if "hoppp" not in TARGET_LIMITS[spec.target]["mma"]:
            return None
        tiles = []
        for t, n_dim, k_dim in ((self.glu, 2 * spec.intermediate, spec.hidden),
                                (self.down, spec.hidden, spec.intermediate)):
            own = (t.tile_n,) if t.mma in WGMMA_MMAS else ()  # mma.sync tiles are narrow
            fits = [GemmTiles(n, 64, st, "hoppp") for n in dict.fromkeys(own + (256, 192, 128))
                    for st in sorted(STAGES, reverse=True)]
            fits = [f for f in fits if gemm_can_implement(n_dim, k_dim, 64, f, spec.target)[0]]
            if not fits:
                return None
            tiles.append(fits[0])
        twin = dataclasses.replace(self, tile_m=64, glu=tiles[0], down=tiles[1])
        return twin if can_implement(spec, twin)[0] else None

    def kernels(self, spec: LayerSpec) -> list[KernelVariant]:
        """The layer's kernels in launch order: routing (fp8: with x's quantization), GEMM1,
        GEMM2, combine (PRECISION_ROLES)."""
        a, p, s = arch_tag(spec.target), spec.precision_tag, spec.shape_tag
        e, k, h, i = spec.experts, spec.top_k, spec.hidden, spec.intermediate
        g, d, m, x = self.glu, self.down, self.tile_m, self._pdl_tag
        pdl = (("pdl", True),) if self.pdl else ()
        # both fp8 GEMMs take the layer's h scale block (named and passed only when not the default)
        hb, hbp = ((f"_h{self.h_block}", (("h_block", self.h_block),)) if self.h_block != limits.H_SCALE_BLOCK
                   else ("", ()))
        bias = (("bias", True),) if spec.bias else ()  # the GEMMs take b13 / b2 (shape_tag ends in "b")
        # a stand-in target's block-scaled GEMMs emulate the MMA its arch lacks (its name is in a)
        standin = (("standin", True),) if spec.target in limits.STANDINS and spec.precision in limits.BLOCKSCALED \
            else ()
        # fp8: the routing launch quantizes x too (named by what it quantizes to)
        q, qp = ((f"_q{p}h{h}", (("quant", (h, spec.precision)),)) if spec.precision in QUANT_IN_ROUTING
                 else ("", ()))
        out = [
            KernelVariant("routing", f"moe_route_{a}_e{e}k{k}_m{m}_c{self.route_cluster}{q}{x}",
                          (("num_experts", e), ("top_k", k), ("tile_m", m)) + qp
                          + (("cluster_size", self.route_cluster),) + pdl),
            KernelVariant(
                "glu", f"moe_glu_{a}_{p}_{s}_{spec.activation}_t{m}x{g.tile_n}x{g.tile_k}_s{g.stages}_{g.mma}"
                       f"{_c(g)}_g{INTERLEAVE}{hb}{x}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i),
                 ("activation", spec.activation), ("tile_m", m)) + g.params(spec.precision)
                + (("interleave", INTERLEAVE),) + pdl + bias + standin + hbp),
            KernelVariant(
                "down", f"moe_down_{a}_{p}_{s}_t{m}x{d.tile_n}x{d.tile_k}_s{d.stages}_{d.mma}{_c(d)}{hb}{x}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i), ("tile_m", m))
                + d.params(spec.precision) + pdl + bias + standin + hbp),
            KernelVariant("combine", f"moe_combine_{a}_{p}_e{e}k{k}h{h}{x}",
                          (("num_experts", e), ("hidden", h), ("top_k", k)) + pdl),
        ]
        if "bsquant" in PRECISION_ROLES[spec.precision]:
            # x's rows K-padded as GEMM1 reads them (sm_120 family; tcgen05 reads K unpadded)
            hp = limits.bs_stored_k(spec.target, h)
            out.insert(1, blockscale_kernel(BlockScaleShape(limits.BS_FORMATS[spec.precision][0], h, spec.target,
                                                            hp if hp != h else 0)))
        return out

    @classmethod
    def parse(cls, name: str) -> "LayerVariant":
        """Inverse of the tunable part of name(): ..._m64r1_glun128k64s3warp_downn128k64s3warp[_pdl],
        read with the same layout tables name() writes with."""
        import re

        m = re.search(_layer_pattern(), name)
        if not m:
            raise ValueError(f"{name!r} is not a layer variant name")
        return _build(cls, LAYER_NAME, iter(m.groups()))


# The whole layer in one cooperative launch for a few tokens (templates/decode.py, MoeDecode, role
# "decode"): a candidate of the 1-token bucket (DECODE_BUCKETS) that the tuner measures beside
# the four-kernel variants; the runtime serves it where it is the bucket's pick, for token counts up
# to its max_tokens on GPUs with at least its ctas SMs, and the bucket's default four kernels
# otherwise. Its candidates (producer, sync, consumer warps, bytes per row segment): the bulk-copy
# producer behind the grid barrier, 16 warps on 2 KB segments, 8 on 4 KB, 16 on 4 KB. On the H200
# (2026-12-05, tools/check_decode.py, 1 token, against 8 warps on 2 KB) 16 warps ran bf16 3-9%
# faster at four of five presets (gpt-oss +2%) and 4 KB segments 7-16% faster at four (Qwen3-30B
# +5%); cp.async was 1-5% slower than bulk, the group counters 5-29% slower than the grid
# barrier (NOTES, 2026-12-05). Measured by the tuner once x was conflict-free in shared memory
# (NOTES, twenty-fourth session), each of the three is some layer's 1-token pick: 16 warps on 2 KB
# at Qwen3-30B and most fp8 layers, 8 on 4 KB at gpt-oss, DeepSeek-V3 and Mixtral (bf16), 16 on
# 4 KB at Qwen3-235B (bf16) and Mixtral (fp8).
DECODE_BUCKETS = (1,)
DECODE_CANDIDATES = (("bulk", "grid", 16, 2048), ("bulk", "grid", 8, 4096), ("bulk", "grid", 16, 4096))


@value_class
class DecodeVariant:
    """Every compile-time choice of the one-launch decode kernel; its name is both the layer's
    variant key (records, picks) and its one kernel's. ``stages`` is the ring depth the candidate
    was built with (gemm_limits.decode_layout's fit, spelled out so the name says it)."""
    max_tokens: int = 1
    warps: int = 8
    stages: int = 0
    seg_bytes: int = 2048
    producer: str = "bulk"
    sync: str = "grid"
    ctas: int = 132

    def __init__(self, max_tokens: int = 1, warps: int = 8, stages: int = 0, seg_bytes: int = 2048,
                 producer: str = "bulk", sync: str = "grid", ctas: int = 132):
        vars(self).update(max_tokens=max_tokens, warps=warps, stages=stages, seg_bytes=seg_bytes,
                          producer=producer, sync=sync, ctas=ctas)

    def name(self, spec: LayerSpec) -> str:
        return (f"moe_decode_{arch_tag(spec.target)}_{spec.precision_tag}_{spec.shape_tag}_{spec.activation}"
                + _render(self, DECODE_NAME))

    def bar_words(self, spec: LayerSpec) -> int:
        """int32 words of its barrier workspace: the grid barrier's 64-bit count, zeroed when
        allocated and never reset (it grows by the kernel's CTAs per launch)."""
        return limits.DECODE_BAR_WORDS

    def kernels(self, spec: LayerSpec) -> list[KernelVariant]:
        params = (("num_experts", spec.experts), ("hidden", spec.hidden), ("intermediate", spec.intermediate),
                  ("top_k", spec.top_k), ("activation", spec.activation), ("interleave", INTERLEAVE),
                  ("max_tokens", self.max_tokens), ("warps", self.warps), ("stages", self.stages),
                  ("seg_bytes", self.seg_bytes), ("ctas", self.ctas), ("bias", spec.bias),
                  ("producer", self.producer), ("precision", spec.precision), ("sync", self.sync))
        return [KernelVariant("decode", self.name(spec), params)]

    @classmethod
    def parse(cls, name: str) -> "DecodeVariant":
        """Inverse of the tunable part of name(): ..._t1w8s7b2048_bulk_grid_c132."""
        import re

        m = re.search(_pattern(DECODE_NAME, cls) + "$", name) if name.startswith("moe_decode_") else None
        if not m:
            raise ValueError(f"{name!r} is not a decode variant name")
        return _build(cls, DECODE_NAME, iter(m.groups()))


def can_implement_decode(spec: LayerSpec, v: DecodeVariant) -> tuple[bool, str]:
    """(ok, reason) of the one-launch decode kernel for this layer (gemm_limits.check_decode), on
    a target that has it and with no more CTAs than the target's SMs (they must all be resident)."""
    if spec.target != limits.DECODE_ARCH:
        return False, f"the one-launch decode kernel is built for {limits.DECODE_ARCH}, not {spec.target}"
    sms = TARGET_LIMITS[spec.target]["sms"]
    if v.ctas > sms:
        return False, f"ctas {v.ctas} exceeds {spec.target}'s {sms} SMs (every CTA of the launch must be resident)"
    ok, why = limits.check_decode(spec.experts, spec.hidden, spec.intermediate, spec.top_k, spec.activation,
                                  INTERLEAVE, v.max_tokens, v.warps, v.stages, v.seg_bytes, v.ctas,
                                  precision=spec.precision, producer=v.producer, sync=v.sync)
    if ok and v.stages < 1:
        ok, why = False, f"stages {v.stages} must be at least 1 (name the ring depth it is built with)"
    return (True, "ok") if ok else (False, why)


def decode_candidates(spec: LayerSpec, tokens: int) -> list[DecodeVariant]:
    """The decode kernels the tuner measures at this bucket beside the four-kernel variants:
    DECODE_CANDIDATES at the deepest ring shared memory holds, one CTA per SM of the target, for
    the bucket's token count; [] at other buckets or where the layer cannot take one."""
    if tokens not in DECODE_BUCKETS or spec.target != limits.DECODE_ARCH:
        return []
    out = []
    for producer, sync, warps, seg_bytes in DECODE_CANDIDATES:
        stages = limits.decode_layout(spec.hidden, spec.intermediate, tokens, warps, 0, seg_bytes, spec.precision)[2]
        v = DecodeVariant(max_tokens=tokens, warps=warps, stages=stages, seg_bytes=seg_bytes, producer=producer,
                          sync=sync, ctas=TARGET_LIMITS[spec.target]["sms"])
        if can_implement_decode(spec, v)[0]:  # gemm_limits.check_decode with the ring depth that fits
            out.append(v)
    return out

# The backward's data GEMMs (templates/hopper_bwd.py, sm_90a): dH writes da in the padded row order
# of a routing with tile_m-row tiles, which dX then reads by TMA, so both share it (a BackwardVariant's
# tile_m: BWD_TILE_M by default, or 64, gemm_limits.BWD_TILE_MS); the routing runs in a cluster of
# BWD_ROUTE_CLUSTER CTAs (training batches have thousands of tokens).
BWD_TILE_M = 128
BWD_ROUTE_CLUSTER = 16
# The data GEMMs' default tiles, the first valid of each list (tile_n must divide N and be a multiple
# of the N-major atom, 64). Measured on the H200 at 4096 tokens (tools/check_backward.py, NOTES,
# twelfth session): dH fastest on the 128x128 ping-pong core at every preset (its epilogue runs
# beside the other warpgroup's mainloop; 0.79-0.94x of the 128x128 cooperative time), dX on the
# 256-wide cooperative tiles (0.81-0.94x of 128-wide, except DeepSeek-V3: 1.08x).
# Second in both lists (a tuning candidate, not a default): the 256-wide cooperative tile at three
# stages, the fastest 128-row dH and dX at DeepSeek-V3 and Mixtral 16384 on the H100 (forty-fifth
# session, tools/check_backward.py: dH 8.5 ms against 12.1 at the default and 13.2 at four stages;
# dX 13.0 against 14.3, reading 25 GB from DRAM where deeper rings read 41-62). The H100's tuner took
# it for dX at DeepSeek-V3, Qwen3-235B and Mixtral 16384.
BWD_DH_TILES = (GemmTiles(128, 64, 5, "hoppp"), GemmTiles(256, 64, 3, "hopws"), GemmTiles(256, 64, 4, "hopws"),
                GemmTiles(192, 64, 4, "hopws"), GemmTiles(128, 64, 4, "hopws"), GemmTiles(64, 64, 4, "hopws"))
BWD_DX_TILES = (GemmTiles(256, 64, 4, "hopws"), GemmTiles(256, 64, 3, "hopws"), GemmTiles(192, 64, 4, "hopws"),
                GemmTiles(128, 64, 4, "hopws"), GemmTiles(64, 64, 4, "hopws"))


def backward_gemm_tiles(spec: LayerSpec, tile_m: int = BWD_TILE_M) -> tuple[GemmTiles, GemmTiles] | None:
    """(dH, dX) tiles of the backward's data GEMMs at this routing tile height: the first valid of
    BWD_DH_TILES for dH (N = I, K = H) and of BWD_DX_TILES for dX (N = H, K = 2I); None where the
    target has no persistent Hopper core (the backward then multiplies with torch's grouped GEMMs),
    the layer is not bf16, or no tile of a list is valid."""
    if spec.precision != "bf16" or "hopws" not in TARGET_LIMITS[spec.target]["mma"]:
        return None
    dh, dx = _bwd_fits(spec, "dh", tile_m), _bwd_fits(spec, "dx", tile_m)
    return (dh[0], dx[0]) if dh and dx else None


def _bwd_fits(spec: LayerSpec, part: str, tile_m: int = BWD_TILE_M) -> list[GemmTiles]:
    """The tiles of BWD_DH_TILES (part "dh": N = I, K = H) or BWD_DX_TILES ("dx": N = H, K = 2I)
    that check_backward_gemm accepts for this layer at this routing tile height, in the list's
    order of preference."""
    prefs, n, k = ((BWD_DH_TILES, spec.intermediate, spec.hidden) if part == "dh"
                   else (BWD_DX_TILES, spec.hidden, 2 * spec.intermediate))
    arch = limits.gpu_arch(spec.target)
    return [t for t in prefs if limits.check_backward_gemm(n, k, tile_m, t.tile_n, t.tile_k, t.stages, t.mma,
                                                           arch)[0]]


def backward_gemm_kernels(spec: LayerSpec, dh: GemmTiles, dx: GemmTiles, tile_m: int = BWD_TILE_M,
                          route_cluster: int = BWD_ROUTE_CLUSTER) -> list[KernelVariant]:
    """The backward's fused data path in launch order: the routing of tile_m-row tiles, dH with the
    GLU's backward in its epilogue, dX, and the forward's combine (summing each token's dX rows)."""
    a, p, s = arch_tag(spec.target), spec.precision_tag, spec.shape_tag
    e, k, h, i, m = spec.experts, spec.top_k, spec.hidden, spec.intermediate, tile_m
    shape = (("num_experts", e), ("hidden", h), ("intermediate", i), ("top_k", k))
    return [
        KernelVariant("routing", f"moe_route_{a}_e{e}k{k}_m{m}_c{route_cluster}",
                      (("num_experts", e), ("top_k", k), ("tile_m", m), ("cluster_size", route_cluster))),
        KernelVariant("dh", f"moe_dh_{a}_{p}_{s}_{spec.activation}_t{m}x{dh.tile_n}x{dh.tile_k}_s{dh.stages}_"
                            f"{dh.mma}_g{INTERLEAVE}",
                      shape + (("activation", spec.activation), ("interleave", INTERLEAVE), ("tile_m", m),
                               ("tile_n", dh.tile_n), ("tile_k", dh.tile_k), ("stages", dh.stages),
                               ("mma", dh.mma))),
        KernelVariant("dx", f"moe_dx_{a}_{p}_{s}_t{m}x{dx.tile_n}x{dx.tile_k}_s{dx.stages}_{dx.mma}",
                      shape + (("tile_m", m), ("tile_n", dx.tile_n), ("tile_k", dx.tile_k), ("stages", dx.stages),
                               ("mma", dx.mma))),
        KernelVariant("combine", f"moe_combine_{a}_{p}_e{e}k{k}h{h}",
                      (("num_experts", e), ("hidden", h), ("top_k", k))),
    ]


def backward_kernels(spec: LayerSpec) -> list[KernelVariant]:
    """The kernels of the fused op's backward (moe_aot/integrations/autograd.py), named like the
    forward's: the GLU backward (bf16 layers; the path that multiplies with torch's grouped GEMMs),
    and where the target has the persistent Hopper core, the fused data path
    (backward_gemm_kernels). They depend on the layer's shape only, not on a variant's tiles."""
    if spec.precision != "bf16":
        return []
    a, i = arch_tag(spec.target), spec.intermediate
    out = [KernelVariant("glu_bwd", f"moe_glubwd_{a}_{spec.precision_tag}_i{i}_{spec.activation}_g{INTERLEAVE}",
                         (("intermediate", i), ("activation", spec.activation), ("interleave", INTERLEAVE)))]
    tiles = backward_gemm_tiles(spec)
    if tiles is not None:
        out += backward_gemm_kernels(spec, *tiles)
    return out


def wgrad_kernels(spec: LayerSpec, tiles: dict | None = None) -> list[KernelVariant]:
    """The backward's weight-gradient GEMMs (templates/hopper_wgrad.py, role "wgrad"): dW13 =
    da^T x (x gathered by token) and dW2 = dO^T (w h) (dO gathered), in that order, each at its
    default tiles (gemm_limits.wgrad_default_tiles: the gathered operand on the narrow side), or
    at ``tiles[gather]`` = (tile_m, tile_n, stages, pingpong[, tma_store]) where given (tools/check_wgrad.py's
    alternatives); bf16 layers on the targets with wgmma, else []."""
    if spec.precision != "bf16" or spec.target not in limits.WGRAD_TARGETS:
        return []
    a, e, k, h, i = arch_tag(spec.target), spec.experts, spec.top_k, spec.hidden, spec.intermediate
    out = []
    for rows, cols, gather in ((2 * i, h, "b"), (h, i, "a")):
        if tiles and gather in tiles:
            tm, tn, st, pp, ts = (tuple(tiles[gather]) + (False,))[:5]
            ok, why = limits.check_wgrad(rows, cols, gather, tm, tn, limits.WGRAD_TILE_K, st, spec.target, pp, ts)
            if not ok:
                raise ValueError(f"{spec.label()}: weight-gradient tiles {tm}x{tn} s{st}: {why}")
        else:
            found = limits.wgrad_default_tiles(rows, cols, gather, spec.target)
            if found is None:
                return []
            tm, tn, st, pp, ts = found
        tk = limits.WGRAD_TILE_K
        params = (("num_experts", e), ("out_rows", rows), ("out_cols", cols), ("top_k", k), ("gather", gather),
                  ("tile_m", tm), ("tile_n", tn), ("tile_k", tk), ("stages", st))
        out.append(KernelVariant(
            "wgrad", f"moe_wgrad_{a}_{spec.precision_tag}_e{e}k{k}_r{rows}c{cols}_g{gather}_t{tm}x{tn}x{tk}_s{st}"
                     + ("pp" if pp else "") + ("ts" if ts else ""),
            params + ((("pingpong", True),) if pp else ()) + ((("tma_store", True),) if ts else ())))
    return out


# The compiled weight gradients against torch's grouped GEMMs plus their gathers, in the training
# step's backward on the H200 (NOTES, thirteenth session, calls 4-5): the backward 0-21% faster where
# dW13 runs in the 256-row tiles and experts get few rows (Qwen3-30B, Qwen3-235B and DeepSeek-V3 at
# 4096 tokens: 128-256 rows each); 6-9% slower at gpt-oss (dW13 in 128x192 tiles) and Mixtral 4096
# (1024 rows per expert); level or slower at 16384 tokens except Qwen3-30B (-7%, left out).
WGRAD_MAX_ROWS_PER_EXPERT = 256


def wgrad_preferred(spec: LayerSpec, tokens: int) -> bool:
    """Whether the backward should use the compiled weight-gradient GEMMs (wgrad_kernels) rather
    than torch's at this many tokens: dW13 in 256-row tiles and at most WGRAD_MAX_ROWS_PER_EXPERT
    routed rows per expert on average."""
    kvs = wgrad_kernels(spec)
    if not kvs or kvs[0].kwargs()["tile_m"] != 256:
        return False
    return tokens * spec.top_k <= WGRAD_MAX_ROWS_PER_EXPERT * spec.experts


# -- the backward as a tunable unit (issue 11): one value per backward, tuned and picked per bucket
# like the forward's LayerVariant, under its own workload key (backward_workload) -------------------

@dataclasses.dataclass(frozen=True)
class WgradTiles:
    """Tiles of one weight-gradient GEMM (templates/hopper_wgrad.py; tile_k is WGRAD_TILE_K)."""
    tile_m: int
    tile_n: int
    stages: int
    pingpong: bool = False
    tma_store: bool = False

    @property
    def tag(self) -> str:
        return f"{self.tile_m}x{self.tile_n}s{self.stages}" + ("pp" if self.pingpong else "") + \
            ("ts" if self.tma_store else "")

    def astuple(self) -> tuple:
        return (self.tile_m, self.tile_n, self.stages, self.pingpong, self.tma_store)


@dataclasses.dataclass(frozen=True)
class BackwardVariant:
    """Every compile-time choice of the fused op's backward (integrations/autograd.py,
    moe_backward_fused) on the targets with the persistent Hopper core: the routing's tile height
    tile_m (shared by dH and dX), the dH and dX tiles, and the weight gradients, either torch's
    grouped GEMMs (None) or the compiled variable-K GEMMs with (dW13, dW2) tiles. Its name is its
    key in the records and picks (workload backward_workload(spec)); tile_m appears in it as
    "_m64" only when not BWD_TILE_M, so every 128-row name (and database key) is unchanged. Its
    kernels are named by component, so any combination of compiled components is compiled.

    dh and dx both None (TORCH_DATA, named "..._dtorch_wtorch") is the backward whose GEMMs are all
    torch's grouped GEMMs around the compiled GLU backward (autograd.moe_backward_torch): a choice
    the tuner measures beside the compiled data paths, since torch's grouped GEMMs win at some
    shapes (DeepSeek-V3 at 16384 tokens on an H100, tools/results/NOTES.md, forty-first session)."""
    dh: GemmTiles | None
    dx: GemmTiles | None
    wgrad: tuple[WgradTiles, WgradTiles] | None = None
    tile_m: int = BWD_TILE_M

    @property
    def torch_data(self) -> bool:
        """Whether the data GEMMs (dH, dX) are torch's rather than compiled ones."""
        return self.dh is None

    def name(self, spec: LayerSpec) -> str:
        w = "torch" if self.wgrad is None else f"b{self.wgrad[0].tag}a{self.wgrad[1].tag}"
        m = "" if self.tile_m == BWD_TILE_M else f"_m{self.tile_m}"
        d = "_dtorch" if self.torch_data else f"_dh{self.dh.tag}_dx{self.dx.tag}"
        return (f"moe_bwd_{arch_tag(spec.target)}_{spec.precision_tag}_{spec.shape_tag}_{spec.activation}"
                f"{m}{d}_w{w}")

    def kernels(self, spec: LayerSpec) -> list[KernelVariant]:
        """In launch order: routing, dH, dX, combine, then dW13 and dW2 when compiled; with torch's
        data GEMMs the GLU backward alone (what that path runs of ours)."""
        if self.torch_data:
            out = [kv for kv in backward_kernels(spec) if kv.role == "glu_bwd"]
        else:
            out = backward_gemm_kernels(spec, self.dh, self.dx, self.tile_m)
        if self.wgrad is not None:
            out += wgrad_kernels(spec, wgrad_tile_map(self.wgrad))
        return out

    @classmethod
    def parse(cls, name: str) -> "BackwardVariant":
        """Inverse of the tunable part of name():
        ...[_m64]_dhn128k64s5hoppp_dxn256k64s4hopws_w(torch|b...a...), or ..._dtorch_wtorch. A name
        spelling out the default tile_m ("_m128") is not canonical and refused."""
        import re

        g = r"n(\d+)k(\d+)s(\d+)([a-z]+)"
        w = r"(\d+)x(\d+)s(\d+)(pp)?(ts)?"
        m = re.search(rf"^moe_bwd_.*?(?:_m(\d+))?_(?:dh{g}_dx{g}|(dtorch))_w(?:(torch)|b{w}a{w})$", name)
        if not m or m[1] == str(BWD_TILE_M):
            raise ValueError(f"{name!r} is not a backward variant name")
        v = m.groups()[1:]
        gemm = lambda t: None if v[8] else GemmTiles(int(t[0]), int(t[1]), int(t[2]), t[3])  # noqa: E731
        wt = lambda t: WgradTiles(int(t[0]), int(t[1]), int(t[2]), bool(t[3]), bool(t[4]))  # noqa: E731
        return cls(gemm(v[0:4]), gemm(v[4:8]), None if v[9] else (wt(v[10:15]), wt(v[15:20])),
                   int(m[1]) if m[1] else BWD_TILE_M)


TORCH_DATA = BackwardVariant(None, None)  # torch's grouped GEMMs around the compiled GLU backward


def wgrad_tile_map(pair: tuple[WgradTiles, WgradTiles]) -> dict:
    """(dW13, dW2) tiles as wgrad_kernels takes them: by gathered operand, "b" (dW13) and "a" (dW2)."""
    return {"b": pair[0].astuple(), "a": pair[1].astuple()}


def backward_workload(spec: LayerSpec) -> str:
    """The database key of the layer's backward (records, picks): the forward's key + "_bwd"."""
    return spec.workload_key + BACKWARD_SUFFIX


def workload_for(spec: LayerSpec, backward: bool = False) -> str:
    """The records' and picks' key of the layer (or, with ``backward``, of its backward)."""
    return backward_workload(spec) if backward else spec.workload_key


BACKWARD_SUFFIX = "_bwd"


def can_implement_backward(spec: LayerSpec, v: BackwardVariant) -> tuple[bool, str]:
    """(ok, reason) of a backward variant for this layer: bf16 on a target with the persistent
    Hopper core, a routing tile height of gemm_limits.BWD_TILE_MS, each data GEMM's tiles valid
    for its sizes at that height, each weight-gradient GEMM's tiles valid for its sizes; or
    TORCH_DATA exactly (torch's data GEMMs only with torch's weight gradients: the compiled ones
    read the routing kernel's padded tiles, which that path does not run)."""
    if spec.precision != "bf16" or "hopws" not in TARGET_LIMITS[spec.target]["mma"]:
        return False, (f"the fused backward is built for bf16 layers on targets with the persistent Hopper core, "
                       f"not {spec.precision} on {spec.target}")
    if v.torch_data or v.dx is None:
        if v != TORCH_DATA:
            return False, ("torch's data GEMMs go with torch's weight gradients at the default routing tile "
                           f"height {BWD_TILE_M} only (dH and dX both torch's, or both compiled)")
        return True, ""
    ok, why = limits.check_backward_tile_m(v.tile_m)
    if not ok:
        return False, why
    arch = limits.gpu_arch(spec.target)
    for what, t, (n, k) in (("dH", v.dh, (spec.intermediate, spec.hidden)),
                            ("dX", v.dx, (spec.hidden, 2 * spec.intermediate))):
        ok, why = limits.check_backward_gemm(n, k, v.tile_m, t.tile_n, t.tile_k, t.stages, t.mma, arch)
        if not ok:
            return False, f"{what} tiles {t.tag} at tile_m {v.tile_m}: {why}"
    if v.wgrad is not None:
        for what, t, (rows, cols, gather) in (("dW13", v.wgrad[0], (2 * spec.intermediate, spec.hidden, "b")),
                                              ("dW2", v.wgrad[1], (spec.hidden, spec.intermediate, "a"))):
            ok, why = limits.check_wgrad(rows, cols, gather, t.tile_m, t.tile_n, limits.WGRAD_TILE_K, t.stages,
                                         spec.target, t.pingpong, t.tma_store)
            if not ok:
                return False, f"{what} tiles {t.tag}: {why}"
    return True, ""


def _wgrad_default_pair(spec: LayerSpec) -> tuple[WgradTiles, WgradTiles] | None:
    """The (dW13, dW2) tiles wgrad_kernels builds by default (gemm_limits.wgrad_default_tiles),
    None where it builds none."""
    if spec.precision != "bf16" or spec.target not in limits.WGRAD_TARGETS:
        return None
    h, i = spec.hidden, spec.intermediate
    pair = [limits.wgrad_default_tiles(rows, cols, gather, spec.target)
            for rows, cols, gather in ((2 * i, h, "b"), (h, i, "a"))]
    return None if None in pair else (WgradTiles(*pair[0]), WgradTiles(*pair[1]))


def default_backward(spec: LayerSpec, tokens: int) -> BackwardVariant | None:
    """The backward of a bucket without a tuned pick: backward_gemm_tiles' dH and dX tiles, the
    compiled weight gradients where wgrad_preferred says they measured faster; None where the layer
    has no fused backward (it then multiplies with torch's grouped GEMMs)."""
    tiles = backward_gemm_tiles(spec)
    if tiles is None:
        return None
    return BackwardVariant(*tiles, _wgrad_default_pair(spec) if wgrad_preferred(spec, tokens) else None)


def parse_variant(name: str):
    """A LayerVariant or, for a name starting moe_bwd_, a BackwardVariant, for one starting
    moe_decode_, a DecodeVariant."""
    if name.startswith("moe_bwd_"):
        return BackwardVariant.parse(name)
    return DecodeVariant.parse(name) if name.startswith("moe_decode_") else LayerVariant.parse(name)


BWD_ALTERNATIVES = 4  # per data GEMM, the first this many valid tiles of its list are candidates


def backward_candidates(spec: LayerSpec, tokens: int) -> list[BackwardVariant]:
    """What `moe-aot tune --backward` measures at a bucket: the default first, then the variants
    that differ from it in one part (coordinate search; the parts are separate kernels, so the
    tuner's combination of the best parts needs no compile of its own): dH and dX each in the
    first BWD_ALTERNATIVES valid tiles of BWD_DH_TILES / BWD_DX_TILES, the data path at the other
    routing tile height (_row_twins), the weight gradients by torch, in the default compiled tiles,
    and those with the TMA-store epilogue; last, TORCH_DATA (every GEMM torch's)."""
    base = default_backward(spec, tokens)
    if base is None:
        return []
    out = [base]
    for part in ("dh", "dx"):
        out += [dataclasses.replace(base, **{part: t}) for t in _bwd_fits(spec, part)[:BWD_ALTERNATIVES]]
    out += [v for m in limits.BWD_TILE_MS if m != base.tile_m for v in _row_twins(spec, base, m)]
    pair = _wgrad_default_pair(spec)
    if pair is not None:
        ts = tuple(dataclasses.replace(t, tma_store=True) for t in pair)
        out += [dataclasses.replace(base, wgrad=w) for w in (None, pair, ts)]
    out.append(TORCH_DATA)
    out = [v for v in dict.fromkeys(out) if can_implement_backward(spec, v)[0]]
    return out


def _row_twins(spec: LayerSpec, base: BackwardVariant, tile_m: int) -> list[BackwardVariant]:
    """`base` with the routing's tiles tile_m rows high: its dH and dX tiles where they are valid at
    that height, else the first valid there; at 64 rows also those tiles on the ping-pong core
    (a cooperative 64-row tile has one consumer warpgroup, whose tensor cores idle in its epilogue;
    ping-pong runs two on alternate tiles). [] where a data GEMM has no valid tile at that height;
    the caller drops what is invalid or repeated."""
    chosen = {}
    for part in ("dh", "dx"):
        fits = _bwd_fits(spec, part, tile_m)
        if not fits:
            return []
        chosen[part] = getattr(base, part) if getattr(base, part) in fits else fits[0]
    twin = dataclasses.replace(base, tile_m=tile_m, **chosen)
    if tile_m != 64:
        return [twin]
    pp = {part: dataclasses.replace(t, mma="hoppp") for part, t in chosen.items()}
    return [twin, dataclasses.replace(twin, **pp)]


def _changed_parts(base: BackwardVariant, v: BackwardVariant) -> dict[str, dict]:
    """The parts `v` changed from `base`, each as the fields it sets: dH and dX each, or, at another
    tile_m, the data path as one part "rows" (its dH and dX kernels are built at its own height, so
    neither goes with another height's); and the weight gradients. TORCH_DATA is none of these
    (its whole path is another one): {}, so that no combination takes a part of it."""
    if v.torch_data or base.torch_data:
        return {}
    if v.tile_m != base.tile_m:
        out = {"rows": {"tile_m": v.tile_m, "dh": v.dh, "dx": v.dx}}
    else:
        out = {part: {part: getattr(v, part)} for part in ("dh", "dx") if getattr(v, part) != getattr(base, part)}
    if v.wgrad != base.wgrad:
        out["wgrad"] = {"wgrad": v.wgrad}
    return out


def combine_backward(base: BackwardVariant, best_parts: list[BackwardVariant]) -> BackwardVariant:
    """The variant taking, per part (_changed_parts), the value of the fastest variant that changed
    that part from `base` (best_parts: candidates that each differ from base in at most one part,
    fastest first); "rows" (another tile_m) and a dH or dX tile exclude each other, the faster one
    taken."""
    chosen: dict[str, dict] = {}
    for v in best_parts:
        for part, fields in _changed_parts(base, v).items():
            clash = {"rows"} if part in ("dh", "dx") else {"dh", "dx"} if part == "rows" else set()
            if part not in chosen and not clash & chosen.keys():
                chosen[part] = fields
    return dataclasses.replace(base, **{k: f for fields in chosen.values() for k, f in fields.items()})


def training_kernels(spec: LayerSpec, variant: LayerVariant) -> list[KernelVariant]:
    """The kernels a training forward uses beside the variant's own (moe_aot.integrations.autograd,
    fused_moe_train): the variant's GEMM1 built to also write its pre-activations (role
    "glu_train", the GLU's input kept for the backward instead of recomputing GEMM1), where its
    template has that output (gemm_limits.check_save_preact); [] otherwise (the forward then
    computes them in torch ops; a DecodeVariant's one launch has no GEMM1 to keep them)."""
    if isinstance(variant, DecodeVariant) or not limits.check_save_preact(variant.glu.mma, spec.precision)[0]:
        return []
    glu = next(kv for kv in variant.kernels(spec) if kv.role == "glu")
    return [KernelVariant("glu_train", glu.name + "_preact", glu.params + (("save_preact", True),))]


@dataclasses.dataclass(frozen=True)
class BlockScaleShape:
    """A block-scaled quantization of [rows, k] bf16 into `fmt` (moe_aot/blockscale.py) for
    `target`: a workload of its own, outside any layer (the quantizers later GEMM epilogues
    share; templates/blockscale_quant.py). ``k_out`` > k: the rows written k_out wide, the
    columns past k quantized zeros (a block-scaled layer's x, K padded to whole k-tiles:
    gemm_limits.bs_padded_k); 0: k."""
    fmt: str
    k: int
    target: str
    k_out: int = 0

    def __post_init__(self):
        if self.fmt not in limits.BLOCKSCALE_FORMATS:
            raise ValueError(f"format {self.fmt!r} must be one of {', '.join(limits.BLOCKSCALE_FORMATS)}")
        block = limits.BLOCKSCALE_BLOCK[self.fmt]
        if not isinstance(self.k, int) or self.k <= 0 or self.k % block:
            raise ValueError(f"K={self.k} must be a positive multiple of {self.fmt}'s block of {block}")
        if self.target not in TARGET_LIMITS:
            raise ValueError(f"target {self.target!r} must be one of {', '.join(TARGET_LIMITS)}")
        if self.k_out and (not isinstance(self.k_out, int) or self.k_out <= self.k or self.k_out % block):
            raise ValueError(f"k_out={self.k_out} must be 0 or a multiple of {self.fmt}'s block of {block} "
                             f"above K={self.k}")

    @property
    def pad_tag(self) -> str:
        return f"_p{self.k_out}" if self.k_out else ""

    @property
    def workload_key(self) -> str:
        return f"bsquant_{self.fmt}_k{self.k}{self.pad_tag}"

    def workload_dict(self) -> dict:
        d = {"kind": "blockscale_quant", "format": self.fmt, "k": self.k}
        if self.k_out:
            d["k_out"] = self.k_out
        return d


def blockscale_kernel(shape: BlockScaleShape) -> KernelVariant:
    """The quantization kernel of `shape`; e2m1 by PTX cvt where the target has it
    (gemm_limits.E2M1_CVT_TARGETS), else in software. The name spells every argument."""
    e2m1 = "hw" if shape.target in limits.E2M1_CVT_TARGETS else "sw"
    name = f"moe_bsquant_{arch_tag(shape.target)}_{shape.fmt}_k{shape.k}{shape.pad_tag}_{e2m1}"
    return KernelVariant("bsquant", name,
                         (("fmt", shape.fmt), ("k", shape.k), ("e2m1", e2m1))
                         + ((("k_out", shape.k_out),) if shape.k_out else ()))


# How a variant's fields appear in its name, in order: (field, prefix). An int is the prefix and
# its digits, a str (the MMA) itself, a bool the prefix alone when true, a GemmTiles the prefix
# and its own layout; a field of OMIT_AT_DEFAULT is left out at its default, so adding one kept
# every older name (and database key). name() and parse() both read these tables, and a test
# checks that they name every field.
GEMM_NAME = (("tile_n", "n"), ("tile_k", "k"), ("stages", "s"), ("mma", ""), ("cluster", "c"), ("raster_experts", "xe"),
             ("promote", "p"), ("fast_act", "fa"))
LAYER_NAME = (("tile_m", "_m"), ("route_cluster", "r"), ("glu", "_glu"), ("down", "_down"), ("h_block", "_h"),
              ("pdl", "_pdl"))
DECODE_NAME = (("max_tokens", "_t"), ("warps", "w"), ("stages", "s"), ("seg_bytes", "b"), ("producer", "_"),
               ("sync", "_"), ("ctas", "_c"))
OMIT_AT_DEFAULT = {"cluster", "raster_experts", "promote", "fast_act", "pdl", "h_block"}
_LAYOUTS = {"GemmTiles": GEMM_NAME, "LayerVariant": LAYER_NAME, "DecodeVariant": DECODE_NAME}


def _field_types(cls) -> dict:
    return {f.name: type(f.default) for f in dataclasses.fields(cls)}


def _render(obj, layout) -> str:
    out, defaults = [], {f.name: f.default for f in dataclasses.fields(obj)}
    for name, prefix in layout:
        value = getattr(obj, name)
        if name in OMIT_AT_DEFAULT and value == defaults[name]:
            continue
        if dataclasses.is_dataclass(value):
            out.append(prefix + _render(value, _LAYOUTS[type(value).__name__]))
        elif isinstance(value, bool):
            out.append(prefix)
        else:
            out.append(f"{prefix}{value}")
    return "".join(out)


@functools.cache
def _layer_pattern() -> str:
    """The regex of a layer variant's name tail, built once from LAYER_NAME."""
    return _pattern(LAYER_NAME, LayerVariant) + "$"


def _pattern(layout, cls) -> str:
    import re

    parts, types = [], _field_types(cls)
    for name, prefix in layout:
        kind = types[name]
        if kind is bool:
            parts.append(f"({re.escape(prefix)})?")
            continue
        if dataclasses.is_dataclass(kind):
            body = re.escape(prefix) + _pattern(_LAYOUTS[kind.__name__], kind)
        else:
            body = re.escape(prefix) + (r"(\d+)" if kind is int else r"([a-z]+?)")
        parts.append(f"(?:{body})?" if name in OMIT_AT_DEFAULT else body)
    return "".join(parts)


def _build(cls, layout, groups):
    kw, types = {}, _field_types(cls)
    for name, _ in layout:
        kind = types[name]
        if dataclasses.is_dataclass(kind):
            kw[name] = _build(kind, _LAYOUTS[kind.__name__], groups)
            continue
        g = next(groups)
        if g is not None:
            kw[name] = kind(g) if kind is not bool else True
    return cls(**kw)


def _c(t: GemmTiles) -> str:
    """A GEMM kernel name's options after its MMA: the cluster ("_c2"), raster groups cut at
    experts ("_xe"), k-tiles per promotion ("_p2"), the approximate activation ("_fa"); empty at
    the defaults."""
    return ((f"_{t.cluster_tag}" if t.cluster > 1 else "") + ("_xe" if t.raster_experts else "")
            + (f"_p{t.promote}" if t.promote > 1 else "") + ("_fa" if t.fast_act else ""))


WGMMA_MMAS = limits.WGMMA  # wgmma tiles (hopws/hoppp: TMA, a producer warpgroup, persistent)


def gemm_can_implement(n: int, k: int, tile_m: int, t: GemmTiles, target: str, precision: str = "bf16",
                       role: str = "down") -> tuple[bool, str]:
    """Whether the grouped-GEMM template builds these tiles for an [N, K] weight matrix on
    `target` in `precision`: the MMA must be one the target offers here (for that precision),
    then the template's own rules (gemm_limits.check_gemm / check_fp8, the one copy both use)."""
    if t.mma not in TARGET_LIMITS[target]["mma"]:
        return False, f"{t.mma} MMA is not available on {target} (has {', '.join(TARGET_LIMITS[target]['mma'])})"
    ok, why = limits.check_fp8(role, precision, n, k, tile_m, t.tile_n, t.mma, t.tile_k)
    if not ok:
        return False, why
    ok, why = limits.check_raster(t.mma, t.cluster, precision, t.raster_experts)
    if not ok:
        return False, why
    ok, why = limits.check_promote_every(role, precision, limits.promote_parts(t.mma, tile_m, t.tile_n),
                                         k // t.tile_k, t.stages, t.promote)
    if not ok:
        return False, why
    ok, why = limits.check_fast_act(role, precision, t.fast_act)
    if not ok:
        return False, why
    ok, why = limits.check_blockscaled(role, precision, n, k, tile_m, t.tile_n, t.tile_k, t.stages, t.mma, arch=target)
    if not ok:
        return False, why
    ok, why = limits.check_gemm(n, k, tile_m, t.tile_n, t.tile_k, t.stages, t.mma, arch=target,
                                cluster_m=t.cluster, precision=precision)
    return (True, "ok") if ok else (False, why)


def can_implement(spec: LayerSpec, variant: LayerVariant | DecodeVariant) -> tuple[bool, str]:
    """(ok, reason): whether `variant` can serve `spec` on `spec.target`. Pure and cheap."""
    if isinstance(variant, DecodeVariant):
        return can_implement_decode(spec, variant)
    lim = TARGET_LIMITS[spec.target]
    if variant.tile_m not in tile_ms(spec):
        return False, f"tile_m {variant.tile_m} not in {tile_ms(spec)} on {spec.target} for {spec.precision}"
    ok, why = limits.check_layer_tile_m(variant.tile_m, variant.glu.mma, variant.glu.cluster,
                                        variant.down.mma, variant.down.cluster)
    if not ok:
        return False, why
    if variant.route_cluster not in lim["clusters"]:
        return False, (f"routing cluster of {variant.route_cluster} CTAs not available on {spec.target} "
                       f"(allowed: {', '.join(map(str, lim['clusters']))})")
    for role, t, n_dim, k_dim in (("glu", variant.glu, 2 * spec.intermediate, spec.hidden),
                                  ("down", variant.down, spec.hidden, spec.intermediate)):
        if role == "glu":
            ok, why = glu_tiles_fit(spec, t)
            if not ok:
                return False, f"glu: {why}"
        ok, why = gemm_can_implement(n_dim, k_dim, variant.tile_m, t, spec.target, spec.precision, role)
        if not ok:
            return False, f"{role}: {why}"
    ok, why = limits.check_h_block(spec.precision, variant.h_block, variant.glu.tile_n)
    return (True, "ok") if ok else (False, why)


# the activations whose GEMM1 epilogue takes a sigmoid's reciprocal, which fast_act puts on
# rcp.approx (templates/grouped_gemm.py glu_act); geglu's tanh GELU takes none
FAST_ACT_ACTIVATIONS = ("swiglu", "swigluoai")


def glu_tiles_fit(spec: LayerSpec, t: GemmTiles) -> tuple[bool, str]:
    """(ok, reason) of GEMM1 tiles for the layer's GLU beyond the GEMM's own limits: the gate/up
    interleave against tile_n (gemm_limits.check_glu_shape), and fast_act only where the activation
    has a reciprocal to approximate (a geglu layer's fast_act binary would be its default's kernel
    under another name)."""
    ok, why = limits.check_glu_shape(spec.intermediate, t.tile_n, INTERLEAVE, spec.activation)
    if ok and t.fast_act and spec.activation not in FAST_ACT_ACTIVATIONS:
        ok, why = False, (f"fast_act approximates the sigmoid's reciprocal of {' and '.join(FAST_ACT_ACTIVATIONS)}; "
                          f"{spec.activation}'s tanh GELU has none")
    return ok, why


TILE_M = (16, 32, 64, 128)


def tile_ms(spec: LayerSpec) -> tuple[int, ...]:
    """The routing tile heights a layer of `spec` may use: TILE_M, and where the target builds
    umma for the precision, the 2-CTA pairs' 256 (gemm_limits.UMMA_PAIR_TILE_M). The runtime sizes
    its workspace for the largest padding of these."""
    if "umma" in TARGET_LIMITS[spec.target]["mma"] and spec.precision in limits.UMMA_PRECISIONS:
        return TILE_M + (limits.UMMA_PAIR_TILE_M,)
    return TILE_M
GEMM_CLUSTERS = limits.CLUSTERS_M  # CTAs per cluster along M of a grouped GEMM (hopws: B multicast; umma: 2-CTA pairs)
TILE_N = (32, 64, 128, 192, 256)
TILE_K = (32, 64, 128)


def tile_ks(precision: str) -> tuple[int, ...]:
    """The k-tiles the tuner tries for `precision` (block-scaled: gemm_limits.BS_TILE_K; fp8 also
    GEMM1's 256-wide ones, gemm_limits.FP8_TILE_KS)."""
    if precision in limits.FP8:
        return TILE_K + limits.FP8_TILE_KS[1:]
    return limits.BS_TILE_K if precision in limits.BLOCKSCALED else TILE_K

STAGES = (2, 3, 4, 5, 6, 8)
SHALLOW_STAGES = 3  # LayerVariant.shallow_twin's GEMM1 ring


def candidate_space(spec: LayerSpec) -> list[LayerVariant]:
    """Every variant the tuner may try for `spec`, already pruned by can_implement."""
    lim = TARGET_LIMITS[spec.target]
    clusters = sorted({1, max(lim["clusters"])})
    out = []
    for m in tile_ms(spec):
        tiles = {}
        for role, n_dim, k_dim in (("glu", 2 * spec.intermediate, spec.hidden),
                                   ("down", spec.hidden, spec.intermediate)):
            tiles[role] = [t for t in (GemmTiles(*args) for args in
                                       itertools.product(TILE_N, tile_ks(spec.precision), STAGES, lim["mma"],
                                                         GEMM_CLUSTERS, (False, True), limits.PROMOTE_EVERY,
                                                         (False, True)))
                           if gemm_can_implement(n_dim, k_dim, m, t, spec.target, spec.precision, role)[0]
                           and (role == "down" or glu_tiles_fit(spec, t)[0])]
        for g, d, c, pdl in itertools.product(tiles["glu"], tiles["down"], clusters, (False, True)):
            if not limits.check_layer_tile_m(m, g.mma, g.cluster, d.mma, d.cluster)[0]:
                continue
            out.append(LayerVariant(m, g, d, c, pdl))
            for hb in limits.H_SCALE_BLOCKS[1:]:  # fp8 GEMM1 tiles that write whole blocks of more columns
                if limits.check_h_block(spec.precision, hb, g.tile_n)[0]:
                    out.append(LayerVariant(m, g, d, c, pdl, hb))
    return out


# Targets whose defaults come from the performance model (moe_aot/perfmodel.py) instead of
# measurements: no DGX Spark was available to measure on. On the H200 the model's pick per bucket
# came within a geomean 4-5% of the best measured variant (tools/results/perfmodel_h200.md).
MODELED_DEFAULTS = limits.with_standins(("sm_121a",))


@functools.cache
def modeled_default(spec: LayerSpec, tokens: int) -> LayerVariant:
    """The variant the performance model predicts fastest at `tokens` on `spec.target`'s device,
    among every valid one (routing cluster 1, no PDL). The layer's time is routing + GEMM1 + GEMM2
    + combine, so per tile_m each GEMM's tiles are chosen alone."""
    from .perfmodel import DEVICES, gemm_seconds, predict

    dev, lim = DEVICES[limits.modeled_target(spec.target)], TARGET_LIMITS[spec.target]
    E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
    best = None
    for m in TILE_M:
        chosen = []
        for role, n, k, out, read_a in (("glu", 2 * I, H, I, False), ("down", H, I, H, True)):
            cands = [t for t in (GemmTiles(tn, tk, st, mma) for tn in TILE_N for tk in TILE_K for st in STAGES
                                 for mma in lim["mma"])
                     if gemm_can_implement(n, k, m, t, spec.target, spec.precision, role)[0]
                     and (role == "down" or limits.check_glu_shape(I, t.tile_n, INTERLEAVE, spec.activation)[0])]
            if not cands:
                break
            chosen.append(min(cands, key=lambda t: _model_key(gemm_seconds(dev, n, k, out, tokens, K, E, m, t,
                                                                           read_a, False)["seconds"], t)))
        if len(chosen) < 2:
            continue
        v = LayerVariant(m, chosen[0], chosen[1], 1)
        if can_implement(spec, v)[0]:
            t = predict(spec, v, tokens, dev)["seconds"]
            if best is None or t < best[0]:
                best = (t, v)
    if best is None:
        raise ValueError(f"no variant can implement {spec.workload_key} on {spec.target}")
    return best[1]


def _model_key(seconds: float, t: GemmTiles) -> tuple:
    """Order of GEMM tiles by predicted time; within 1% of each other (the model's resolution: a
    weight-streaming GEMM takes the same time over most tiles), the deepest weight pipeline per
    CTA first (the most robust to memory latency), then the widest tile (fewer CTAs)."""
    import math

    return (math.floor(math.log(seconds) / math.log(1.01)), -(t.stages - 1) * t.tile_n * t.tile_k, -t.tile_n, t)


FP8_DECODE_ROWS = 16  # routed rows per expert up to which fp8's default takes its decode tiles
# routed rows per expert from which sm_100a's bf16 default takes the tcgen05 kernels (128-row
# tiles; fewer rows would mostly multiply padding). A guess, not a measurement: no Blackwell GPU
# was available; below it the mma.sync kernels, as on every target.
UMMA_MIN_ROWS = 64


def default_variant(spec: LayerSpec, tokens: int) -> LayerVariant:
    """The documented untuned choice per token-count bucket: the first valid of a short list.
    From the H200 kernel measurements (tools/results/gemm_check_h200_2026-11-29.txt): few routed
    rows per expert (decode) stream weights best with 16-row tiles and deep pipelines; many rows
    per expert need wgmma 128-row tiles (the persistent TMA core "hopws" where the target has it,
    from 33 rows per expert: at 64 rows per expert it beat 64-row mma.sync tiles by 14-23% in the
    kernel check of 2026-12-01, tools/results/NOTES.md); in between, 64-row mma.sync tiles. On
    sm_100a the tcgen05 kernels ("umma", 128-row tiles) from UMMA_MIN_ROWS rows per expert: compiled,
    never measured (no Blackwell GPU was available)."""
    if spec.target in MODELED_DEFAULTS and PRECISION_MMAS[spec.precision] is None:
        return modeled_default(spec, tokens)
    cluster = 1 if tokens <= 256 else max(TARGET_LIMITS[spec.target]["clusters"])
    rows_per_expert = tokens * spec.top_k / spec.experts
    W, P = "warp", "hopws"
    if spec.precision in limits.W4:
        return _default_w4(spec, rows_per_expert, cluster)
    if spec.precision in limits.BLOCKSCALED:
        return _default_blockscaled(spec, rows_per_expert)
    if PRECISION_MMAS[spec.precision] is not None:
        # fp8 on sm_90a: the cooperative core, 128x128 tiles with 128-wide k-tiles, 64-row tiles up
        # to FP8_DECODE_ROWS routed rows per expert (as fast as or 1.0-1.4x faster than 128-row ones
        # at 1-256 tokens, and than 16-row mma.sync ones at 1-16: tools/check_fp8_kernels.py on the
        # H200, 2026-12-02), 128-row above; 6 stages were faster than 4 at 1-1024 tokens
        # (2026-12-01). Above FP8_DECODE_ROWS, 128x256 tiles promoted in two 128-column parts
        # first (4 stages: what shared memory holds), GEMM2 too where its weight blocks allow
        # (fp8-block128's GEMM2 tiles divide 128): 1.13-1.34x GEMM1 and 1.1-1.2x GEMM2 over
        # 128x128 at 4096-16384 tokens on the H200, 1.0-1.1x at 256 (tools/check_fp8_kernels.py
        # --only f8c,f8n256,f8n256b, 2026-12-02). Targets without wgmma: the mma.sync kernels
        # (templates/warp_fp8.py), 16-row tiles for decode, 64-row above. Fewer stages where K has
        # too few k-tiles for 6 (a stage more than the k-tiles is never filled) or shared memory
        # too little (DGX Spark).
        why = ""
        decode = rows_per_expert <= FP8_DECODE_ROWS
        hopper = P in TARGET_LIMITS[spec.target]["mma"]
        if hopper and not decode:
            # h's scales per 128 columns first (GEMM2 promotes once per k-tile and part: GEMM2
            # 1.13-1.43x at 4096 tokens, GEMM1 0.92-1.07x; check_fp8_kernels, H200, twelfth session)
            for hb in (128, limits.H_SCALE_BLOCK):
                for d in (GemmTiles(256, 128, 4, P), GemmTiles(128, 128, 6, P)):
                    v = LayerVariant(128, GemmTiles(256, 128, 4, P), d, cluster, h_block=hb)
                    if can_implement(spec, v)[0]:
                        return v
        for stages in (6, 5, 4, 3):
            if hopper:
                m, g, d = 64 if decode else 128, GemmTiles(128, 128, stages, P), GemmTiles(128, 128, stages, P)
            else:
                g = GemmTiles(128, 128, stages, W)
                m, d = (16, GemmTiles(32, 128, stages, W)) if decode else (64, GemmTiles(64, 128, stages, W))
            v = LayerVariant(m, g, d, cluster)
            ok, why = can_implement(spec, v)
            if ok:
                return v
        raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}: {why}")
    if rows_per_expert <= 2:
        prefs = [(16, GemmTiles(32, 64, 8, W), GemmTiles(32, 64, 8, W)),
                 (16, GemmTiles(64, 128, 2, W), GemmTiles(64, 128, 2, W))]
    elif "umma" in TARGET_LIMITS[spec.target]["mma"] and rows_per_expert >= UMMA_MIN_ROWS:
        # the widest weight tile N allows (fewer re-reads of the gathered rows), 4 stages fit
        prefs = [(128, GemmTiles(n, 64, st, "umma"), GemmTiles(n2, 64, st, "umma")) for st in (4, 3)
                 for n in (256, 192, 128, 64) for n2 in (256, 192, 128, 64)]
    elif rows_per_expert <= 32 or "hopws" not in TARGET_LIMITS[spec.target]["mma"]:
        prefs = [(64, GemmTiles(128, 64, 4, W), GemmTiles(128, 64, 4, W))]
    else:
        prefs = [(128, GemmTiles(n, 64, 4, P), GemmTiles(n2, 64, 4, P))
                 for n in (256, 192, 128) for n2 in (256, 192, 128)]
        prefs += [(128, GemmTiles(128, 64, 3, W), GemmTiles(128, 64, 3, W))]
    prefs += [(64, GemmTiles(128, 64, 4, W), GemmTiles(128, 64, 4, W)),
              (64, GemmTiles(64, 64, 3, W), GemmTiles(64, 64, 3, W)),
              (64, GemmTiles(64, 32, 3, W), GemmTiles(64, 32, 3, W))]
    for m, g, d in prefs:
        v = LayerVariant(m, g, d, cluster)
        if can_implement(spec, v)[0]:
            return v
    raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}")


def _default_w4(spec: LayerSpec, rows_per_expert: float, cluster: int) -> LayerVariant:
    """mxfp4-w's untuned choice (mma.sync only; the register-conversion kernels not yet measured on
    a GPU): few rows per expert stream the packed weights with 16-row tiles, 128-wide N tiles where
    N allows (else 64: 4 warps of one 16-row chunk each) and a deep pipeline; more rows per expert
    take 32- or 64-row tiles, whose every warp multiplies all rows by the weights it converted once
    (gemm_limits.w4_warps), so a converted weight feeds more rows. tile_k 64: one fragment chunk
    per k-tile and warp column (K = 2880 has no 128-wide k-tiles). The first valid of each list."""
    m = 16 if rows_per_expert <= 4 else 32 if rows_per_expert <= 16 else 64
    why = ""
    for tile_m, (n, k), n2, st in itertools.product(dict.fromkeys((m, 16)), ((128, 64), (64, 64), (32, 64)),
                                                    (128, 64, 32), (6, 4, 3)):
        v = LayerVariant(tile_m, GemmTiles(n, k, st, "warp"), GemmTiles(min(n, n2), k, st, "warp"), cluster)
        ok, why = can_implement(spec, v)
        if ok:
            return v
    raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}: {why}")


def _default_blockscaled(spec: LayerSpec, rows_per_expert: float) -> LayerVariant:
    """mxfp8 / nvfp4 / w4a8-mx's untuned choice on the sm_120 family (compiled, never measured: no Spark was
    available): decode (few rows per expert) streams the weights with 16-row tiles, 64 weight rows
    and 256-wide k-tiles per CTA (256 weight bytes per row per k-tile for mxfp8, 128 for nvfp4) in a
    3-4 deep cp.async pipeline within GB10's 99 KB; more rows per expert take 64-row tiles with
    128 weight rows, so a weight tile feeds more rows. The first valid of each list.
    sm_100a has no block-scaled mma.sync: its tcgen05 kernels (mma "umma", 128-row tiles) at every
    token count, 128-wide weight tiles (two TMEM accumulators, so GEMM1's quantizing epilogue runs
    beside the next tile's MMAs) and the deepest pipeline shared memory holds; a guess, never
    measured (no Blackwell GPU was available)."""
    if "umma" in TARGET_LIMITS[spec.target]["mma"] and spec.precision in limits.BS_UMMA_PRECISIONS:
        k = limits.bs_umma_tile_k(spec.precision)
        why = ""
        for n, st in itertools.product((128, 256), (6, 5, 4, 3)):
            v = LayerVariant(128, GemmTiles(n, k, st, "umma"), GemmTiles(n, k, st, "umma"), 1)
            ok, why = can_implement(spec, v)
            if ok:
                return v
        raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}: {why}")
    if rows_per_expert <= 16:
        prefs = [(16, n, k, st) for n in (64, 32) for k, st in ((256, 4), (256, 3), (128, 6), (128, 4))]
    else:
        prefs = [(64, n, k, st) for n in (128, 64) for k, st in ((128, 4), (128, 3), (256, 2))]
    prefs += [(m, n, k, st) for m in (16, 32, 64) for n in (64, 32, 128) for k in limits.BS_TILE_K
              for st in (4, 3, 2)]
    why = ""
    for m, n, k, st in prefs:
        v = LayerVariant(m, GemmTiles(n, k, st, "warp"), GemmTiles(n, k, st, "warp"), 1)
        ok, why = can_implement(spec, v)
        if ok:
            return v
    raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}: {why}")


def token_buckets() -> tuple[int, ...]:
    return BENCH_TOKENS


def bucket_for(tokens: int, buckets=BENCH_TOKENS) -> int:
    """Nearest bucket on a log scale (ties go to the larger one)."""
    import math

    return min(buckets, key=lambda b: (abs(math.log(max(tokens, 1)) - math.log(b)), -b))
