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
import itertools
from dataclasses import dataclass, field

from .spec import BENCH_TOKENS, LayerSpec

# Per-block shared memory a kernel may opt into, and which MMA instructions exist. "hopws"
# (sm_90a: templates/hopper_gemm.py, persistent warp-specialized CTAs on the DSL's TMA pipeline)
# is the large-token default since its H200 checks of 2026-12-01 (tools/results/NOTES.md);
# "hoppp" is its ping-pong form (two consumer warpgroups on alternate 64-row tiles).
TARGET_LIMITS = {
    "sm_90a": {"smem": 232448, "mma": ("warp", "wgmma", "hopws", "hoppp"), "sms": 132, "clusters": (1, 2, 4, 8, 16)},
    "sm_100a": {"smem": 232448, "mma": ("warp",), "sms": 148, "clusters": (1, 2, 4, 8, 16)},
    "sm_121a": {"smem": 101376, "mma": ("warp",), "sms": 48, "clusters": (1,)},
}
INTERLEAVE = 16  # gate/up rows alternate in blocks of this many rows in the prepared w13


def arch_tag(target: str) -> str:
    return target.replace("_", "")


@dataclass(frozen=True, order=True)
class GemmTiles:
    """Tunables of one grouped GEMM (tile_m lives in the LayerVariant: routing shares it)."""
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 3
    mma: str = "warp"
    # CTAs per cluster along M (hopws only): 2 multicasts each weight tile to two M tiles of one
    # expert. Named only when > 1, so every cluster-1 name (and database key) is unchanged.
    cluster: int = 1

    @property
    def tag(self) -> str:
        return f"n{self.tile_n}k{self.tile_k}s{self.stages}{self.mma}{self.cluster_tag}"

    @property
    def cluster_tag(self) -> str:
        return f"c{self.cluster}" if self.cluster > 1 else ""

    def params(self) -> tuple:
        """The template constructor arguments these tunables set (cluster_m only when > 1)."""
        return ((("tile_n", self.tile_n), ("tile_k", self.tile_k), ("stages", self.stages), ("mma", self.mma))
                + ((("cluster_m", self.cluster),) if self.cluster > 1 else ()))


@dataclass(frozen=True)
class KernelVariant:
    """One kernel to compile: its role, canonical name and the template's constructor arguments."""
    role: str  # "routing" | "glu" | "down" | "combine"
    name: str
    params: tuple = field(compare=False)  # ((key, value), ...) in constructor order

    def kwargs(self) -> dict:
        return dict(self.params)


@dataclass(frozen=True)
class LayerVariant:
    tile_m: int = 64
    glu: GemmTiles = GemmTiles()
    down: GemmTiles = GemmTiles()
    route_cluster: int = 1  # CTAs of the routing kernel's cluster: 1 for few tokens, 8-16 for many
    # Programmatic dependent launch: GEMM1, GEMM2 and the combine launch while their predecessor
    # still runs and wait on the chip (griddepcontrol); GEMM2 fetches its first weight k-tiles
    # before that wait. Off in the defaults until measured on the GPU.
    pdl: bool = False

    def name(self, spec: LayerSpec) -> str:
        return (f"moe_layer_{arch_tag(spec.target)}_{spec.precision}_{spec.shape_tag}_{spec.activation}"
                f"_m{self.tile_m}r{self.route_cluster}_glu{self.glu.tag}_down{self.down.tag}{self._pdl_tag}")

    @property
    def _pdl_tag(self) -> str:
        return "_pdl" if self.pdl else ""

    def pdl_twin(self) -> "LayerVariant":
        """The same kernels with programmatic dependent launch flipped (measured side by side)."""
        return dataclasses.replace(self, pdl=not self.pdl)

    def cluster_twins(self) -> list["LayerVariant"]:
        """hopws GEMMs at cluster 1 -> the same with GEMM2, then both GEMMs, in 2-CTA clusters
        (weight tiles multicast; measured side by side by the tuner's seeds). [] otherwise."""
        if self.down.mma not in CLUSTER_MMAS or self.down.cluster != 1 or self.tile_m != 128:
            return []
        down = dataclasses.replace(self, down=dataclasses.replace(self.down, cluster=2))
        out = [down]
        if self.glu.mma in CLUSTER_MMAS and self.glu.cluster == 1:
            out.append(dataclasses.replace(down, glu=dataclasses.replace(self.glu, cluster=2)))
        return out

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
        a, p, s = arch_tag(spec.target), spec.precision, spec.shape_tag
        e, k, h, i = spec.experts, spec.top_k, spec.hidden, spec.intermediate
        g, d, m, x = self.glu, self.down, self.tile_m, self._pdl_tag
        pdl = (("pdl", True),) if self.pdl else ()
        return [
            KernelVariant("routing", f"moe_route_{a}_e{e}k{k}_m{m}_c{self.route_cluster}{x}",
                          (("num_experts", e), ("top_k", k), ("tile_m", m), ("cluster_size", self.route_cluster))
                          + pdl),
            KernelVariant(
                "glu", f"moe_glu_{a}_{p}_{s}_{spec.activation}_t{m}x{g.tile_n}x{g.tile_k}_s{g.stages}_{g.mma}"
                       f"{_c(g)}_g{INTERLEAVE}{x}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i),
                 ("activation", spec.activation), ("tile_m", m)) + g.params() + (("interleave", INTERLEAVE),)
                + pdl),
            KernelVariant(
                "down", f"moe_down_{a}_{p}_{s}_t{m}x{d.tile_n}x{d.tile_k}_s{d.stages}_{d.mma}{_c(d)}{x}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i), ("tile_m", m))
                + d.params() + pdl),
            KernelVariant("combine", f"moe_combine_{a}_{p}_e{e}k{k}h{h}{x}",
                          (("num_experts", e), ("hidden", h), ("top_k", k)) + pdl),
        ]

    @classmethod
    def parse(cls, name: str) -> "LayerVariant":
        """Inverse of the tunable part of name(): ..._m64r1_glun128k64s3warp_downn128k64s3warp[_pdl]."""
        import re

        t = r"n(\d+)k(\d+)s(\d+)([a-z]+?)(?:c(\d+))?"
        m = re.search(rf"_m(\d+)r(\d+)_glu{t}_down{t}(_pdl)?$", name)
        if not m:
            raise ValueError(f"{name!r} is not a layer variant name")

        def tiles(i):
            return GemmTiles(int(m[i]), int(m[i + 1]), int(m[i + 2]), m[i + 3], int(m[i + 4] or 1))
        return cls(int(m[1]), tiles(3), tiles(8), int(m[2]), m[13] is not None)


def _c(t: GemmTiles) -> str:
    return f"_{t.cluster_tag}" if t.cluster > 1 else ""


SMEM_CAPACITY = {"sm_90a": 227 * 1024, "sm_100a": 227 * 1024, "sm_121a": 99 * 1024}


WGMMA_MMAS = ("wgmma", "hopws", "hoppp")  # hopws/hoppp: TMA, a producer warpgroup (+128
# threads), persistent, epilogue from registers (no fp32 staging)
WARP_SPECIALIZED = ("hopws", "hoppp")
PERSISTENT = ("hopws", "hoppp")
PINGPONG = ("hoppp",)  # two consumer warpgroups, each on its own tile (64 rows, or 128 up to 128 wide)
CLUSTER_MMAS = ("hopws",)  # GEMMs that may run in 2-CTA clusters (128-row tiles)


def gemm_warps(tile_m: int, tile_n: int, mma: str) -> tuple[int, int]:
    """The template's warp grid of accumulator-holding warps: wgmma and hopws, one warpgroup per 64
    rows; hoppp, two warpgroups (each a whole tile); mma.sync, 2 warps along M (1 for tile_m 16)
    and 4 warps below 128x128 tiles, 8 from there."""
    if mma in PINGPONG:
        return 8, 1
    if mma in WGMMA_MMAS:
        return max(tile_m // 16, 1), 1
    warps_m = 2 if tile_m >= 32 else 1
    warps = 4 if tile_m * tile_n < 128 * 128 else 8
    return warps_m, max(1, min(tile_n // 16, warps // warps_m))


def gemm_can_implement(n: int, k: int, tile_m: int, t: GemmTiles, target: str) -> tuple[bool, str]:
    """Mirror of the grouped-GEMM template's checks (tests compare the two on the whole space)."""
    if t.mma not in TARGET_LIMITS[target]["mma"]:
        return False, f"{t.mma} MMA is not available on {target} (has {', '.join(TARGET_LIMITS[target]['mma'])})"
    if t.cluster not in GEMM_CLUSTERS:
        return False, f"cluster {t.cluster} not in {GEMM_CLUSTERS}"
    if t.cluster > 1 and (t.mma not in CLUSTER_MMAS or tile_m != 128):
        return False, f"cluster {t.cluster} needs mma hopws with tile_m 128, got {t.mma} with tile_m {tile_m}"
    wm, wn = gemm_warps(tile_m, t.tile_n, t.mma)
    threads = wm * wn * 32
    acc_threads = 128 if t.mma in PINGPONG else threads  # a ping-pong warpgroup holds a whole tile
    if t.mma in WGMMA_MMAS:
        if tile_m not in (64, 128):
            return False, f"{t.mma} needs tile_m 64 or 128, got {tile_m}"
        if t.tile_n % 32 or not 32 <= t.tile_n <= 256:
            return False, f"{t.mma} needs tile_n a multiple of 32 in 32..256, got {t.tile_n}"
        if t.tile_k != 64:
            return False, f"{t.mma} needs tile_k 64 (one 128-byte swizzle atom), got {t.tile_k}"
        if t.stages < 3:
            return False, f"{t.mma} needs at least 3 stages, got {t.stages}"
    if threads > 256:
        return False, f"{threads} threads: at most 8 warps"
    if t.tile_k not in (32, 64, 128):
        return False, f"tile_k {t.tile_k} not in 32, 64, 128"
    if k % t.tile_k:
        return False, f"K={k} is not a multiple of tile_k {t.tile_k}"
    if n % t.tile_n:
        return False, f"N={n} is not a multiple of tile_n {t.tile_n}"
    if t.mma == "warp" and (tile_m % (16 * wm) or tile_m > 256 or t.tile_n % (16 * wn) or t.tile_n > 256):
        return False, f"tile {tile_m}x{t.tile_n} does not fit the {wm}x{wn} warp grid of m16n8k16 MMAs"
    rows = (128 if t.mma in WARP_SPECIALIZED else threads) // (t.tile_k // 8)  # threads issuing A's cp.async
    if tile_m % rows or t.tile_n % rows:
        return False, f"tile {tile_m}x{t.tile_n} is not a multiple of the {rows} rows one cp.async pass covers"
    if tile_m * t.tile_n // acc_threads > 128:
        return False, f"tile {tile_m}x{t.tile_n} needs more than 128 accumulator registers per thread"
    if not 2 <= t.stages <= 8:
        return False, f"stages {t.stages} outside 2..8"
    if k // t.tile_k < t.stages - 1:
        return False, f"K={k} has {k // t.tile_k} k-tiles of {t.tile_k}, fewer than stages-1={t.stages - 1}"
    staging = 0 if t.mma in PERSISTENT else tile_m * (t.tile_n + 8) * 4  # fp32 accumulator tile
    smem = max(t.stages * (tile_m + t.tile_n) * t.tile_k * 2, staging) + 1024
    if t.mma in WARP_SPECIALIZED:
        # a full and an empty mbarrier per stage; the two-slot tile schedule (pairs, weights)
        smem += 16 * t.stages + 64 + 16 * tile_m
    if smem > SMEM_CAPACITY[target]:
        return False, f"needs {smem} B of shared memory, {target} allows {SMEM_CAPACITY[target]}"
    return True, "ok"


def can_implement(spec: LayerSpec, variant: LayerVariant) -> tuple[bool, str]:
    """(ok, reason): whether `variant` can serve `spec` on `spec.target`. Pure and cheap."""
    lim = TARGET_LIMITS[spec.target]
    if variant.tile_m not in TILE_M:
        return False, f"tile_m {variant.tile_m} not in {TILE_M}"
    if variant.route_cluster not in lim["clusters"]:
        return False, (f"routing cluster of {variant.route_cluster} CTAs not available on {spec.target} "
                       f"(allowed: {', '.join(map(str, lim['clusters']))})")
    for role, t, n_dim, k_dim in (("glu", variant.glu, 2 * spec.intermediate, spec.hidden),
                                  ("down", variant.down, spec.hidden, spec.intermediate)):
        if role == "glu" and t.tile_n % (2 * INTERLEAVE):
            return False, f"glu: tile_n {t.tile_n} must hold whole gate/up blocks (multiple of {2 * INTERLEAVE})"
        ok, why = gemm_can_implement(n_dim, k_dim, variant.tile_m, t, spec.target)
        if not ok:
            return False, f"{role}: {why}"
    return True, "ok"


TILE_M = (16, 32, 64, 128)
GEMM_CLUSTERS = (1, 2)  # CTAs per cluster along M of a grouped GEMM (hopws: B multicast)
TILE_N = (32, 64, 128, 192, 256)
TILE_K = (32, 64, 128)
STAGES = (2, 3, 4, 5, 6, 8)


def candidate_space(spec: LayerSpec) -> list[LayerVariant]:
    """Every variant the tuner may try for `spec`, already pruned by can_implement."""
    lim = TARGET_LIMITS[spec.target]
    clusters = sorted({1, max(lim["clusters"])})
    out = []
    for m in TILE_M:
        tiles = {}
        for role, n_dim, k_dim in (("glu", 2 * spec.intermediate, spec.hidden),
                                   ("down", spec.hidden, spec.intermediate)):
            tiles[role] = [t for t in (GemmTiles(n, k, st, mma, c) for n, k, st, mma, c in
                                       itertools.product(TILE_N, TILE_K, STAGES, lim["mma"], GEMM_CLUSTERS))
                           if gemm_can_implement(n_dim, k_dim, m, t, spec.target)[0]
                           and (role == "down" or t.tile_n % (2 * INTERLEAVE) == 0)]
        for g, d, c, pdl in itertools.product(tiles["glu"], tiles["down"], clusters, (False, True)):
            out.append(LayerVariant(m, g, d, c, pdl))
    return out


def default_variant(spec: LayerSpec, tokens: int) -> LayerVariant:
    """The documented untuned choice per token-count bucket: the first valid of a short list.
    From the H200 kernel measurements (tools/results/gemm_check_h200_2026-11-29.txt): few routed
    rows per expert (decode) stream weights best with 16-row tiles and deep pipelines; many rows
    per expert need wgmma 128-row tiles (the persistent TMA core "hopws" where the target has it,
    from 33 rows per expert: at 64 rows per expert it beat 64-row mma.sync tiles by 14-23% in the
    kernel check of 2026-12-01, tools/results/NOTES.md); in between, 64-row mma.sync tiles."""
    cluster = 1 if tokens <= 256 else max(TARGET_LIMITS[spec.target]["clusters"])
    rows_per_expert = tokens * spec.top_k / spec.experts
    W, G, P = "warp", "wgmma", "hopws"
    if rows_per_expert <= 2:
        prefs = [(16, GemmTiles(32, 64, 8, W), GemmTiles(32, 64, 8, W)),
                 (16, GemmTiles(64, 128, 2, W), GemmTiles(64, 128, 2, W))]
    elif rows_per_expert <= 32 or "hopws" not in TARGET_LIMITS[spec.target]["mma"]:
        prefs = [(64, GemmTiles(128, 64, 4, W), GemmTiles(128, 64, 4, W))]
    else:
        prefs = [(128, GemmTiles(n, 64, 4, mma), GemmTiles(n2, 64, 4, mma)) for mma in (P, G)
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


def token_buckets() -> tuple[int, ...]:
    return BENCH_TOKENS


def bucket_for(tokens: int, buckets=BENCH_TOKENS) -> int:
    """Nearest bucket on a log scale (ties go to the larger one)."""
    import math

    return min(buckets, key=lambda b: (abs(math.log(max(tokens, 1)) - math.log(b)), -b))
