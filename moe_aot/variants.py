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

import itertools
from dataclasses import dataclass, field

from .spec import BENCH_TOKENS, LayerSpec

# Per-block shared memory a kernel may opt into, and which MMA instructions exist.
TARGET_LIMITS = {
    "sm_90a": {"smem": 232448, "mma": ("warp", "wgmma"), "sms": 132, "clusters": (1, 2, 4, 8, 16)},
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

    @property
    def tag(self) -> str:
        return f"n{self.tile_n}k{self.tile_k}s{self.stages}{self.mma}"


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

    def name(self, spec: LayerSpec) -> str:
        return (f"moe_layer_{arch_tag(spec.target)}_{spec.precision}_{spec.shape_tag}_{spec.activation}"
                f"_m{self.tile_m}r{self.route_cluster}_glu{self.glu.tag}_down{self.down.tag}")

    def kernels(self, spec: LayerSpec) -> list[KernelVariant]:
        a, p, s = arch_tag(spec.target), spec.precision, spec.shape_tag
        e, k, h, i = spec.experts, spec.top_k, spec.hidden, spec.intermediate
        g, d, m = self.glu, self.down, self.tile_m
        return [
            KernelVariant("routing", f"moe_route_{a}_e{e}k{k}_m{m}_c{self.route_cluster}",
                          (("num_experts", e), ("top_k", k), ("tile_m", m), ("cluster_size", self.route_cluster))),
            KernelVariant(
                "glu", f"moe_glu_{a}_{p}_{s}_{spec.activation}_t{m}x{g.tile_n}x{g.tile_k}_s{g.stages}_{g.mma}"
                       f"_g{INTERLEAVE}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i),
                 ("activation", spec.activation), ("tile_m", m), ("tile_n", g.tile_n), ("tile_k", g.tile_k),
                 ("stages", g.stages), ("mma", g.mma), ("interleave", INTERLEAVE))),
            KernelVariant(
                "down", f"moe_down_{a}_{p}_{s}_t{m}x{d.tile_n}x{d.tile_k}_s{d.stages}_{d.mma}",
                (("num_experts", e), ("top_k", k), ("hidden", h), ("intermediate", i), ("tile_m", m),
                 ("tile_n", d.tile_n), ("tile_k", d.tile_k), ("stages", d.stages), ("mma", d.mma))),
            KernelVariant("combine", f"moe_combine_{a}_{p}_e{e}k{k}h{h}",
                          (("num_experts", e), ("hidden", h), ("top_k", k))),
        ]

    @classmethod
    def parse(cls, name: str) -> "LayerVariant":
        """Inverse of the tunable part of name(): ..._m64r1_glun128k64s3warp_downn128k64s3warp."""
        import re

        m = re.search(r"_m(\d+)r(\d+)_glu(n(\d+)k(\d+)s(\d+)([a-z]+))_down(n(\d+)k(\d+)s(\d+)([a-z]+))$", name)
        if not m:
            raise ValueError(f"{name!r} is not a layer variant name")
        return cls(int(m[1]), GemmTiles(int(m[4]), int(m[5]), int(m[6]), m[7]),
                   GemmTiles(int(m[9]), int(m[10]), int(m[11]), m[12]), int(m[2]))


def _gemm_smem(tile_m: int, t: GemmTiles) -> int:
    mainloop = t.stages * (tile_m + t.tile_n) * t.tile_k * 2
    epilogue = tile_m * t.tile_n * 4  # fp32 accumulator staged through shared memory
    return max(mainloop, epilogue) + 1024


def can_implement(spec: LayerSpec, variant: LayerVariant) -> tuple[bool, str]:
    """(ok, reason): whether `variant` can serve `spec` on `spec.target`. Pure and cheap."""
    lim = TARGET_LIMITS[spec.target]
    if variant.tile_m not in (64, 128):
        return False, f"tile_m {variant.tile_m} not in (64, 128)"
    if variant.route_cluster not in lim["clusters"]:
        return False, (f"routing cluster of {variant.route_cluster} CTAs not available on {spec.target} "
                       f"(allowed: {', '.join(map(str, lim['clusters']))})")
    for role, t, n_dim, k_dim in (("glu", variant.glu, 2 * spec.intermediate, spec.hidden),
                                  ("down", variant.down, spec.hidden, spec.intermediate)):
        if t.mma not in lim["mma"]:
            return False, f"{role}: {t.mma} MMA is not available on {spec.target} (has {', '.join(lim['mma'])})"
        if t.tile_n not in (32, 64, 128, 256) or t.tile_k not in (32, 64, 128):
            return False, f"{role}: tile {t.tile_n}x{t.tile_k} not supported (n in 32..256, k in 32..128)"
        if not 3 <= t.stages <= 8:
            return False, f"{role}: stages {t.stages} outside 3..8"
        if n_dim % t.tile_n:
            return False, f"{role}: N={n_dim} is not a multiple of tile_n {t.tile_n}"
        if k_dim % t.tile_k:
            return False, f"{role}: K={k_dim} is not a multiple of tile_k {t.tile_k}"
        if k_dim // t.tile_k < t.stages - 1:
            return False, f"{role}: K={k_dim} has {k_dim // t.tile_k} k-tiles of {t.tile_k}, fewer than stages-1={t.stages - 1}"
        if role == "glu" and t.tile_n % (2 * INTERLEAVE):
            return False, f"glu: tile_n {t.tile_n} must hold whole gate/up blocks (multiple of {2 * INTERLEAVE})"
        smem = _gemm_smem(variant.tile_m, t)
        if smem > lim["smem"]:
            return False, f"{role}: needs {smem} B of shared memory, {spec.target} allows {lim['smem']}"
    return True, "ok"


def candidate_space(spec: LayerSpec) -> list[LayerVariant]:
    """Every variant the tuner may try for `spec`, already pruned by can_implement."""
    lim = TARGET_LIMITS[spec.target]
    tiles = [GemmTiles(n, k, s, mma) for n, k, s, mma in
             itertools.product((64, 128, 256), (32, 64), (3, 4, 5), lim["mma"])]
    out = []
    for m, g, d, c in itertools.product((64, 128), tiles, tiles, sorted({1, max(lim["clusters"])})):
        v = LayerVariant(m, g, d, c)
        if can_implement(spec, v)[0]:
            out.append(v)
    return out


def default_variant(spec: LayerSpec, tokens: int) -> LayerVariant:
    """The documented untuned choice per token-count bucket; the first valid of a short list."""
    # One routing CTA is fastest up to ~256 tokens; past that a cluster spreads the scan
    # (measured on the H200: 152 -> 19 us at 16384 tokens, E=128, top_k=8).
    cluster = 1 if tokens <= 256 else max(TARGET_LIMITS[spec.target]["clusters"])
    prefs = ([LayerVariant(64, GemmTiles(64, 64, 4), GemmTiles(64, 64, 4), cluster)] if tokens * spec.top_k <= 2048 else
             [LayerVariant(128, GemmTiles(128, 64, 3), GemmTiles(128, 64, 3), cluster)])
    prefs += [LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(64, 64, 3), cluster),
              LayerVariant(64, GemmTiles(32, 64, 3), GemmTiles(64, 64, 3), cluster),
              LayerVariant(64, GemmTiles(64, 32, 3), GemmTiles(64, 32, 3), cluster)]
    for v in prefs:
        ok, _ = can_implement(spec, v)
        if ok:
            return v
    raise ValueError(f"no default variant can implement {spec.workload_key} on {spec.target}")


def token_buckets() -> tuple[int, ...]:
    return BENCH_TOKENS


def bucket_for(tokens: int, buckets=BENCH_TOKENS) -> int:
    """Nearest bucket on a log scale (ties go to the larger one)."""
    import math

    return min(buckets, key=lambda b: (abs(math.log(max(tokens, 1)) - math.log(b)), -b))
