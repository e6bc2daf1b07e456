"""What a grouped-GEMM kernel can be built with: the one copy of the templates' validity rules.

The templates (templates/grouped_gemm.py, hopper_gemm.py, blackwell_gemm.py, ...) refuse their constructor
arguments with these functions, and variants.py prunes the tuner's space and explains refusals
with the same ones, so a rule lives here once. Pure Python: the runtime imports it through
variants.py, so it must not import cutlass or the templates. Its source is part of the
templates' hash (compiler.templates_hash), as the templates' own.
"""
from __future__ import annotations

from typing import NamedTuple


# Stand-in targets, declared here once: a target's layer (its variants, limits, tile rules and
# defaults) compiled for another GPU's arch so that it runs there: DGX Spark's (sm_121a) kernels
# as sm_90a builds on an H100/H200, where the block-scaled MMA the Spark has is emulated
# (templates/blockscaled_warp.py standin=True) and e2m1 is rounded in software. Every table keyed
# by target gives a stand-in its model's entry (with_standins), except what the machine code
# depends on: the --gpu-arch (`arch`), the host CPU beside that GPU (hosts.py) and the e2m1
# instruction. The stand-in's own name is in its kernels' names (variants.arch_tag) and its
# toolchain keys, so a stand-in is never loaded as a real sm_121a kernel, nor as an sm_90a one.
class Standin(NamedTuple):
    model: str  # the target whose layer it is
    arch: str  # the arch its machine code is built for (and the GPUs it runs on)


STANDINS = {"sm_121a-standin": Standin("sm_121a", "sm_90a")}


def modeled_target(target: str) -> str:
    """The target whose limits and rules apply: a stand-in's model, else the target itself."""
    s = STANDINS.get(target)
    return s.model if s is not None else target


def gpu_arch(target: str) -> str:
    """The arch a target's machine code is built for (--gpu-arch): a stand-in's, else the target."""
    s = STANDINS.get(target)
    return s.arch if s is not None else target


def with_standins(table):
    """A table keyed by target (dict, or tuple of targets) with each stand-in given its model's entry."""
    if isinstance(table, dict):
        return {**table, **{t: table[s.model] for t, s in STANDINS.items() if s.model in table}}
    return tuple(table) + tuple(t for t, s in STANDINS.items() if s.model in table)


# Opt-in shared memory per block, by target (bytes)
SMEM_CAPACITY = with_standins({"sm_80": 163 * 1024, "sm_90a": 227 * 1024, "sm_100a": 227 * 1024,
                               "sm_121a": 99 * 1024})
# (the one-CTA-per-tile wgmma mainloop "wgmma" was removed in the twenty-third session: the tuner
# measured it 187 times from 2026-11-29 to 12-03 and none of the 226 committed H200 picks uses it;
# tools/results/NOTES.md keeps its numbers)
MMAS = ("warp", "hopws", "hoppp", "umma")
WGMMA = ("hopws", "hoppp")  # the wgmma families, sm_90a only
# persistent warp-specialized CTAs walking the tiles, epilogue from registers
# (templates/hopper_gemm.py): "hopws" two consumer warpgroups on one tile (cooperative),
# "hoppp" each on its own tile (ping-pong)
WARP_SPECIALIZED = ("hopws", "hoppp")
PERSISTENT = ("hopws", "hoppp")
PINGPONG = ("hoppp",)
CLUSTER_MMAS = ("hopws", "umma")  # may run in 2-CTA clusters along M (cluster_tile_m: their tile height)
CLUSTERS_M = (1, 2)
# 2-CTA clusters pair M tiles of one expert (templates/hopper_gemm.py, _pair_units): a list of the
# units (two tiles each) in shared memory for up to PAIR_LIST_TILES tiles, and the place of every
# other leftover tile (one per expert at most, PAIR_LIST_EXPERTS experts); past that many tiles the
# kernel pairs tiles 2j and 2j + 1
PAIR_LIST_TILES = 2048
PAIR_LIST_EXPERTS = 512
PAIR_LIST_WORDS = PAIR_LIST_TILES + PAIR_LIST_EXPERTS // 2
LOAD_THREADS = 128  # the producer warpgroup of the warp-specialized kernels
COPY_ELEMS = 8  # bf16 elements in one 16-byte cp.async / store
MAX_ACC_REGS = 128  # fp32 accumulators per thread

# GLU activations of GEMM1: h = act(gate) * up, except "swigluoai" (gpt-oss's clamped SwiGLU):
# gate clamped to <= SWIGLUOAI_LIMIT, up to +-SWIGLUOAI_LIMIT, h = (up + 1) * gate * sigmoid(ALPHA * gate)
ACTIVATIONS = ("swiglu", "geglu", "swigluoai")
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
# expert biases (gpt-oss: b13 [E, 2I] added to GEMM1's gate/up columns before the activation,
# b2 [E, H] to GEMM2's output before the routing weight) are built for these precisions (the
# block-scaled ones on the sm_120 family's mma.sync kernels only: spec.py refuses them on tcgen05)
BIAS_PRECISIONS = ("bf16", "mxfp4-w", "mxfp8", "nvfp4", "w4a8-mx")

# Precisions of the grouped GEMMs' operands. fp8 (e4m3 A and B, fp32 accumulation) runs on the
# cooperative wgmma core (templates/hopper_fp8.py) and on mma.sync (templates/warp_fp8.py, the
# decode regime's weight streaming), with 128-element (128-byte) k-tiles:
#   "fp8"           weights: one fp32 scale per expert and matrix (w13: gate and up each);
#                   x: one fp32 scale per token
#   "fp8-block128"  weights: fp32 scales per 128x128 block (DeepSeek-V3's weight_scale_inv);
#                   x: fp32 scales per 1x128 block along K
# Both write GEMM1's output (the GLU intermediate) as e4m3 with one fp32 scale per row and
# h_block columns, which GEMM2 applies by promoting its partial sums per such block (check_h_block).
# "mxfp4-w" (weight-only MXFP4, gpt-oss's checkpoints): the weights are e2m1 codes, two per byte,
# with one ue8m0 scale byte per 32 along K (moe_aot/blockscale.py), dequantized to bf16 in shared
# memory; x, h, y and the MMA are bf16 as in "bf16" (templates/grouped_w4.py). Its entry here is
# the MMA operand's size, bf16's.
ELEM_BYTES = {"bf16": 2, "fp8": 1, "fp8-block128": 1, "mxfp4-w": 2}
FP8 = ("fp8", "fp8-block128")
FP8_TILE_K = 128
# fp8 k-tiles: one 128-byte swizzle atom (and scale block) per row, or two for GEMM1 on the
# cooperative core (two promotions per k-tile; 256 weight bytes per row per stage, for the decode
# buckets' weight stream: check_fp8)
FP8_TILE_KS = (128, 256)
SCALE_BLOCK = 128  # fp8-block128: weight blocks (128x128) and x blocks (1x128)
# GEMM1's fp8 output h: one fp32 scale per row and h_block columns. Both GEMMs of a layer and its
# hs buffer [R, I / h_block] must agree on it, so it is one field of the layer variant
# (variants.LayerVariant.h_block), not of either GEMM's tiles: H_SCALE_BLOCK (the default, every
# GEMM1 tile holds whole 64-column blocks of h) or 128, for GEMM1 tiles that hold whole 128-column
# blocks (tile_n 256): GEMM2 then promotes once per 128-deep k-tile instead of twice.
H_SCALE_BLOCK = 64
H_SCALE_BLOCKS = (64, 128)
FP8_MAX = 448.0  # largest finite e4m3 value
# promoting consumers keep two more accumulators, the partial sums of two K blocks in flight
MAX_PROMOTE_ACC = 64
# ... or, for cooperative 128-row tiles wider than that allows (tile_n 256), one partial-sum
# accumulator of PROMOTE_PART_N columns: the tile's columns are multiplied and promoted part by
# part, the other consumer warpgroup's wgmmas running while one promotes (templates/hopper_fp8.py)
PROMOTE_PART_N = 128


def promote_parts(mma, tile_m, tile_n) -> int:
    """How many column parts a promoting wgmma GEMM multiplies its tile in: 1 (two partial sums
    of the whole tile, pipelined), or tile_n / PROMOTE_PART_N for cooperative tiles wider than
    PROMOTE_PART_N (one partial sum of one part at a time): 128-row tiles, and 64-row ones (one
    warpgroup with the same 64 x tile_n accumulators, for decode, where the weight stream and not
    the tensor cores sets the pace: twice the bytes per stage of a 128-wide tile)."""
    if mma == "hopws" and tile_m in (64, 128) and tile_n > PROMOTE_PART_N:
        return tile_n // PROMOTE_PART_N
    return 1


def check_fast_act(role, precision, fast_act) -> tuple[bool, str]:
    """(ok, reason) of a GEMM1 whose activation takes its sigmoid's reciprocal as rcp.approx
    (templates/grouped_gemm.py glu_act): GEMM1 only (the GLU is its epilogue), on every template
    derived from GroupedGluGemm, i.e. not the block-scaled ones."""
    if not fast_act:
        return True, ""
    if role != "glu" or precision in BLOCKSCALED:
        return False, (f"fast_act is GEMM1's activation (not built for {role} in {precision}); "
                       f"it needs role 'glu' and a precision other than {', '.join(BLOCKSCALED)}")
    return True, ""


# k-tiles whose partial sums a promoting GEMM adds up on the tensor cores before one promotion:
# 1 (every K block of 128), or more where the scales are the same for every K block and the tile
# is promoted in column parts: "fp8" GEMM1 (x per token, w13 per expert). GEMM2's A (h) has a
# scale per h_block columns and fp8-block128 one per 128x128 weight block, so both stay at 1.
PROMOTE_EVERY = (1, 2, 4)


def check_promote_every(role, precision, parts, k_tiles, stages, every) -> tuple[bool, str]:
    """(ok, reason) of ``every`` k-tiles per promotion (see PROMOTE_EVERY): the consumers hold
    ``every`` stages at once, so it must divide the k-tiles and leave the producer a stage."""
    if every == 1:
        return True, ""
    if every not in PROMOTE_EVERY:
        return False, f"promote_every {every} must be one of {PROMOTE_EVERY}"
    if role != "glu" or precision != "fp8" or parts < 2:
        return False, (f"promote_every {every}: only 'fp8' GEMM1 tiles promoted in column parts have the "
                       f"same scales for every K block (this is {precision!r} {role}, {parts} part(s))")
    if k_tiles % every or every >= stages:
        return False, (f"promote_every {every} must divide the {k_tiles} k-tiles and be below the "
                       f"{stages} stages")
    return True, ""
# the cores fp8 is built on: the cooperative one and mma.sync's e4m3 m16n8k32 (sm_89+). The
# ping-pong one crashed under timing on 2026-12-01; the cause was a parity wait passing a phase
# early (fixed 2026-12-06: hopper_gemm._make_order), and since then it is correct, but no faster
# than the cooperative 64-row tiles at 16-1024 tokens (H100: time 1.00x GEMM1, 1.02x GEMM2 as a
# geomean, 0.88-1.14x; tools/results/NOTES.md), so the tuner is not offered it.
FP8_MMAS = ("hopws", "warp")


# tcgen05 (templates/blackwell_gemm.py, mma "umma", sm_100a only; compiled, never run: no
# Blackwell GPU was available): persistent warp-specialized CTAs, TMA for the weights (and GEMM2's
# A), GEMM1's gathered A rows by cp.async from four loader warps, 1-CTA tcgen05.mma (M 128) into
# UMMA_ACC_STAGES TMEM accumulators, epilogue warps reading TMEM. bf16 only for now.
# Cluster 2: a CTA pair runs one 2-CTA tcgen05.mma (cta_group::2, M 256) per k-block, each CTA
# holding 128 rows of A, half of the weight tile's rows and its 128 rows of the accumulators. Both
# CTAs multiply by one expert's weights, so the pair's 256 rows are one routing tile: the layer's
# tile_m is 256 (the routing pads every expert to 256 rows).
UMMA = ("umma",)
UMMA_TARGETS = ("sm_100a",)
UMMA_TILE_M = (128,)  # one 1-CTA MMA's M: the TMEM lane of each row is its epilogue thread
UMMA_CTA_M = 128  # rows of a tile per CTA (TMEM lanes), with or without a pair
UMMA_PAIR_TILE_M = 2 * UMMA_CTA_M  # a 2-CTA pair's tile (cluster 2): one routing tile
UMMA_TILE_K = 64  # one 128-byte swizzle atom of bf16 per k-tile
UMMA_MIN_STAGES = 3
UMMA_ACC_STAGES = 2  # TMEM accumulators: a tile's epilogue beside the next tile's MMAs
TMEM_COLUMNS = 512  # 32-bit columns of an SM's tensor memory (128 lanes each)
UMMA_EPI_MAX_COLS = 128  # columns of one tcgen05.ld.32x32b (x128): GEMM1 loads 2 * interleave at once
UMMA_PRECISIONS = ("bf16",)


def umma_tmem_columns(tile_n) -> int:
    """TMEM columns a umma CTA allocates: UMMA_ACC_STAGES fp32 accumulators of tile_n columns,
    rounded up to a power of two of at least 32 (tcgen05.alloc's rule)."""
    cols = 32
    while cols < UMMA_ACC_STAGES * tile_n:
        cols *= 2
    return cols


def umma_smem_bytes(tile_m, tile_n, tile_k, stages, cluster_m=1) -> int:
    """Dynamic shared memory of a umma CTA: the A/B stages (bf16, 1024-byte aligned for the
    swizzle; a CTA of a 2-CTA pair holds 1/2 of the tile's rows of A and of B) after the first
    KB, which holds the mbarriers (a full and an empty one per stage and per TMEM accumulator,
    a pair's TMEM release barrier: at most 168 B) and the TMEM address slot. Exactly what the
    kernel's launcher asks for (tests/test_blackwell_gemm.py)."""
    return stages * (tile_m + tile_n) // cluster_m * tile_k * 2 + 1024


def check_umma(n, k, tile_m, tile_n, tile_k, stages, precision="bf16", cluster_m=1) -> tuple[bool, str]:
    """(ok, reason) of the tcgen05 tile rules for an [N, K] weight matrix (target rules: check_gemm;
    cluster_m 2: a 2-CTA pair, tile_m 256, see check_cluster)."""
    if precision not in UMMA_PRECISIONS:
        return False, f"umma: built for {', '.join(UMMA_PRECISIONS)} only, not {precision}"
    if tile_m != UMMA_CTA_M * cluster_m:
        ok, reason = check_umma_pair(tile_m, cluster_m)
        return False, reason if not ok else (f"umma: tile_m {tile_m} must be one of {UMMA_TILE_M} (one 1-CTA "
                                             f"tcgen05.mma M, a TMEM lane per row) or {UMMA_PAIR_TILE_M} "
                                             f"in a 2-CTA pair")
    if tile_n % 32 or not 32 <= tile_n <= 256:
        return False, f"umma: tile_n {tile_n} must be a multiple of 32 in 32..256"
    if tile_k != UMMA_TILE_K:
        return False, f"umma: tile_k {tile_k} must be {UMMA_TILE_K} (one 128-byte swizzle atom)"
    if not UMMA_MIN_STAGES <= stages <= 8:
        return False, f"umma: stages {stages} must be in {UMMA_MIN_STAGES}..8"
    if k % tile_k:
        return False, f"K={k} not divisible by tile_k={tile_k}"
    if n % tile_n:
        return False, f"N={n} not divisible by tile_n={tile_n}"
    if umma_tmem_columns(tile_n) > TMEM_COLUMNS:
        return False, (f"umma: {UMMA_ACC_STAGES} accumulators of tile_n {tile_n} need {umma_tmem_columns(tile_n)} "
                       f"TMEM columns, an SM has {TMEM_COLUMNS}")
    return True, ""


def default_warps(tile_m, tile_n, warps_m=None, warps_n=None, mma="warp") -> tuple[int, int]:
    """Warp grid of the accumulator-holding warps. mma.sync: 2 warps along M (1 for tile_m 16);
    4 warps for tiles smaller than 128x128, 8 from there (a 128x128 tile on 4 warps spills on
    sm_121a), so a warp owns at most 64x64 accumulators up to 128x256. hopws: one consumer
    warpgroup (4 warps along M) per 64 rows of the tile, and a producer warpgroup;
    hoppp: two consumer warpgroups, each holding a whole tile (64 rows, or 128 as two 64-row
    blocks)."""
    if mma in PINGPONG:
        return 8, 1
    if mma in WGMMA:
        return max(tile_m // 16, 1), 1
    if warps_m is None:
        warps_m = 2 if tile_m >= 32 else 1
    if warps_n is None:
        warps = 4 if tile_m * tile_n < 128 * 128 else 8
        warps_n = max(1, min(tile_n // 16, warps // warps_m))
    return warps_m, warps_n


def smem_bytes(tile_m, tile_n, tile_k, stages, mma="warp", precision="bf16", cluster_m=1) -> int:
    """Dynamic shared memory of one CTA: the A/B pipeline, reused for the fp32 staging of the
    accumulator tile (persistent kernels: no staging, their epilogue stores from registers; a
    full and an empty mbarrier per stage, and the two-slot tile schedule: 4 mbarriers, 2 tile
    indices, and per slot each row's pair and routing weight, 64 + 16 * tile_m bytes with
    alignment; ping-pong: the two mbarriers of the mainloops' turns; 2-CTA clusters: the list of
    paired tiles, 4 bytes per entry) + the allocator's alignment slack."""
    if mma in UMMA:
        return umma_smem_bytes(tile_m, tile_n, tile_k, stages, cluster_m)
    ab = stages * (tile_m + tile_n) * tile_k * ELEM_BYTES[precision]
    if precision in W4:
        ab = w4_pipeline_bytes(tile_m, tile_n, tile_k, stages)
    c = 0 if mma in PERSISTENT else tile_m * (tile_n + 8) * 4
    bars = 16 * stages + 64 + 16 * tile_m if mma in WARP_SPECIALIZED else 0
    if mma in PINGPONG:
        bars += 16  # hopper_gemm._make_order
    if cluster_m > 1:
        bars += 4 * PAIR_LIST_WORDS
    return max(ab, c) + 1024 + bars


def check_tiles(n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n,
                precision="bf16", cluster_m=1) -> tuple[bool, str]:
    """(ok, reason) of the tile rules for an [N, K] weight matrix, with the warp grid given
    (cluster_m: umma's 2-CTA pairs, whose tile_m is the pair's)."""
    if precision not in ELEM_BYTES:
        return False, f"precision {precision!r} must be one of {tuple(ELEM_BYTES)}"
    if mma not in MMAS:
        return False, (f"mma {mma!r} must be 'warp' (mma.sync), 'hopws' or 'hoppp' (those two sm_90a only) "
                       f"or 'umma' (tcgen05, sm_100a only)")
    if mma in UMMA:
        return check_umma(n, k, tile_m, tile_n, tile_k, stages, precision, cluster_m)
    threads = warps_m * warps_n * 32
    acc_threads = 128 if mma in PINGPONG else threads  # threads sharing one tile's accumulators
    if mma in WGMMA:
        if tile_m not in (64, 128):
            return False, f"{mma}: tile_m {tile_m} must be 64 or 128 (one warpgroup per 64 rows)"
        if tile_n % 32 or not 32 <= tile_n <= 256:
            return False, f"{mma}: tile_n {tile_n} must be a multiple of 32 in 32..256"
        want_k = 128 // ELEM_BYTES[precision]
        if tile_k != want_k and not (precision in FP8 and tile_k in FP8_TILE_KS):
            return False, (f"{mma}: tile_k {tile_k} must be {want_k} for {precision} "
                           f"(one 128-byte swizzle atom)")
        if stages < 3:
            return False, f"{mma}: stages {stages} must be >= 3"
        warps_m, warps_n = tile_m // 16, 1  # for the mma.sync-only checks below
    if warps_m < 1 or warps_n < 1 or threads > 256:
        return False, f"warps {warps_m}x{warps_n}: need 1..8 warps"
    if precision in FP8 and mma not in FP8_MMAS:
        return False, f"{precision} runs on mma in {FP8_MMAS}, not {mma!r}"
    if precision in FP8 and tile_k not in FP8_TILE_KS:
        return False, (f"{precision}: tile_k {tile_k} must be one of {FP8_TILE_KS} (one or two 128-byte rows "
                       f"and scale blocks per k-tile)")
    if precision not in FP8 and tile_k not in (32, 64, 128):
        return False, f"tile_k {tile_k} must be 32, 64 or 128"
    if k % tile_k:
        return False, f"K={k} not divisible by tile_k={tile_k}"
    if n % tile_n:
        return False, f"N={n} not divisible by tile_n={tile_n}"
    if mma == "warp" and (tile_m % (16 * warps_m) or tile_m > 256):
        return False, f"tile_m {tile_m} must be a multiple of 16*warps_m={16 * warps_m} and <= 256"
    if mma == "warp" and (tile_n % (16 * warps_n) or tile_n > 256):
        return False, f"tile_n {tile_n} must be a multiple of 16*warps_n={16 * warps_n} and <= 256"
    load_threads = LOAD_THREADS if mma in WARP_SPECIALIZED else threads
    rows_per_pass = load_threads // (tile_k * ELEM_BYTES[precision] // 16)
    if tile_m % rows_per_pass or tile_n % rows_per_pass:
        return False, (f"tile_m {tile_m} and tile_n {tile_n} must be multiples of the "
                       f"{rows_per_pass} rows one cp.async pass of {load_threads} threads covers")
    if tile_m * tile_n // acc_threads > MAX_ACC_REGS:
        return False, (f"{tile_m}x{tile_n} tile on {acc_threads} threads needs "
                       f"{tile_m * tile_n // acc_threads} fp32 accumulator registers per thread "
                       f"(max {MAX_ACC_REGS})")
    if not 2 <= stages <= 8:
        return False, f"stages {stages} must be in 2..8"
    if k // tile_k < stages - 1:
        return False, f"K={k} has {k // tile_k} k-tiles, fewer than stages-1={stages - 1}"
    return True, ""


# The backward's weight gradients (templates/hopper_wgrad.py, sm_90a): dW[e] = A_e^T B_e over each
# expert's rows of the routing layout, both operands MN-major (K is their row dimension), one of
# them gathered by token (gather "a": dW2 = dO^T (w h); "b": dW13 = da^T x), 128 producer threads,
# consumer warpgroups of 64-row blocks (at most two). k-tiles of 64 rows: the routing's segments
# (tile_m 64 or 128) are whole k-tiles.
WGRAD_GATHER = ("a", "b")
WGRAD_TILE_M = (64, 128, 256)
WGRAD_TILE_K = 64
WGRAD_TARGETS = ("sm_90a",)


WGRAD_EPI_TILE = (128, 32)  # tma_store: the epilogue's subtile (rows, columns) in shared memory
WGRAD_EPI_STAGES = 2  # tma_store: subtile buffers in flight


def wgrad_smem_bytes(tile_m, tile_n, tile_k, stages, tma_store=False) -> int:
    """Dynamic shared memory of one weight-gradient CTA: the A/B stages, a full and an empty
    mbarrier per stage, the gathered rows' tokens of each stage (int32 per k row), the epilogue's
    subtile buffers (tma_store), and the allocator's alignment slack."""
    epi = WGRAD_EPI_STAGES * WGRAD_EPI_TILE[0] * WGRAD_EPI_TILE[1] * 2 + 1024 if tma_store else 0
    return stages * (tile_m + tile_n) * tile_k * 2 + 16 * stages + 4 * tile_k * stages + 1024 + epi


WGRAD_PP_ACC = 64 * 256  # ping-pong: one warpgroup's tile (128 fp32 accumulators per thread) at most


def check_wgrad(rows, cols, gather, tile_m, tile_n, tile_k=WGRAD_TILE_K, stages=4, arch="sm_90a",
                pingpong=False, tma_store=False) -> tuple[bool, str]:
    """(ok, reason) of a weight-gradient GEMM writing [rows, cols] per expert (dW13: 2I x H,
    gather "b"; dW2: H x I, gather "a") with these tiles on `arch`; ``pingpong``: each of the two
    consumer warpgroups multiplies and stores a whole tile of its own; ``tma_store``: the tile
    leaves through shared memory by TMA."""
    if arch not in WGRAD_TARGETS:
        return False, f"the weight-gradient GEMM is built on wgmma for {', '.join(WGRAD_TARGETS)} only, not {arch}"
    if gather not in WGRAD_GATHER:
        return False, f"gather {gather!r} must be 'a' (dW2: dO gathered by token) or 'b' (dW13: x gathered by token)"
    if tile_m not in WGRAD_TILE_M:
        return False, f"tile_m {tile_m} must be 64, 128 or 256 (one or two consumer warpgroups of 64-row blocks)"
    if tile_n % 64 or not 64 <= tile_n <= 256:
        return False, f"tile_n {tile_n} must be a multiple of 64 in 64..256 (whole 128-byte swizzle atoms)"
    if tile_k != WGRAD_TILE_K:
        return False, f"tile_k {tile_k} must be {WGRAD_TILE_K} (the routing's segments are whole 64-row k-tiles)"
    if rows % tile_m:
        return False, f"the gradient's {rows} rows are not divisible by tile_m {tile_m}"
    if cols % tile_n:
        return False, f"the gradient's {cols} columns are not divisible by tile_n {tile_n}"
    if not 2 <= stages <= 8:
        return False, f"stages {stages} must be in 2..8"
    if tile_m == 256 and (pingpong or tile_n > 128):
        return False, (f"a 256-row tile is two warpgroups' of 128 rows each: cooperative and at most 128 wide, "
                       f"not {tile_n}{' ping-pong' if pingpong else ''}")
    if tma_store and (pingpong or tile_m < WGRAD_EPI_TILE[0] or tile_n % WGRAD_EPI_TILE[1]):
        return False, (f"the TMA-store epilogue needs cooperative tiles of >= {WGRAD_EPI_TILE[0]} rows and a "
                       f"multiple of {WGRAD_EPI_TILE[1]} columns, not {tile_m}x{tile_n}"
                       f"{' ping-pong' if pingpong else ''}")
    if pingpong and tile_m * tile_n > WGRAD_PP_ACC:
        return False, (f"a ping-pong tile of {tile_m}x{tile_n} is one warpgroup's: at most {WGRAD_PP_ACC} "
                       "elements (64x256 or 128x128), 128 fp32 accumulators per thread")
    need, cap = wgrad_smem_bytes(tile_m, tile_n, tile_k, stages, tma_store), SMEM_CAPACITY[arch]
    if need > cap:
        return False, (f"{stages} stages of {tile_m}x{tile_n}x{tile_k} tiles need {need} B of shared memory, "
                       f"{arch} allows {cap}")
    return True, ""


def wgrad_default_tiles(rows, cols, gather="b", arch="sm_90a") -> tuple[int, int, int, bool, bool] | None:
    """(tile_m, tile_n, stages, pingpong, tma_store) of a weight-gradient GEMM of this size: cooperative, with
    the gathered operand on the tile's narrow side where the sizes allow (gathered bytes cost the
    producer more than TMA'd ones: dW13, x gathered on the N side, in 256x128 tiles; dW2, dO
    gathered on the M side, in 128x256), else the tallest, widest tile that divides it; the deepest
    pipeline that fits; None where none does."""
    shapes = [(tm, tn) for tm in (128, 64) for tn in (256, 192, 128, 64)]
    if gather == "b":
        shapes.insert(0, (256, 128))
    for tile_m, tile_n in shapes:
        for stages in range(8, 1, -1):
            if check_wgrad(rows, cols, gather, tile_m, tile_n, WGRAD_TILE_K, stages, arch)[0]:
                return tile_m, tile_n, stages, False, False
    return None


def check_save_preact(mma, precision) -> tuple[bool, str]:
    """(ok, reason) of a GEMM1 that also writes its pre-activations (the GLU's input, kept for
    the backward): built into the persistent cores' register epilogue, bf16 only."""
    if mma not in PERSISTENT or precision != "bf16":
        return False, (f"the pre-activation output is built for bf16 GEMM1s with mma in {', '.join(PERSISTENT)}, "
                       f"not {precision} with mma {mma}")
    return True, ""


# The backward's data GEMMs (templates/hopper_bwd.py: dH with the GLU's backward in its epilogue,
# dX) read the weights N-major: one 128-byte swizzle atom of B is 64 bf16 columns of N.
BWD_MN_ATOM = 64
# The row heights of the backward's routing tiles, which dH and dX share (dX reads dH's padded rows)
# and the weight gradients read as whole WGRAD_TILE_K-row k-tiles.
BWD_TILE_MS = (64, 128)


def check_backward_tile_m(tile_m) -> tuple[bool, str]:
    """(ok, reason) of the backward's routing tile height."""
    if tile_m not in BWD_TILE_MS:
        return False, (f"the backward's tile_m {tile_m} must be 64 or 128: dH and dX multiply one 64-row "
                       f"warpgroup block per 64 rows of a tile, and the weight gradients read each expert's "
                       f"rows in whole {WGRAD_TILE_K}-row k-tiles")
    return True, ""


def check_backward_gemm(n, k, tile_m, tile_n, tile_k, stages, mma, arch=None) -> tuple[bool, str]:
    """(ok, reason) of a backward data GEMM (dH: N = I, K = H; dX: N = H, K = 2I): the persistent
    cores with the weights read N-major, bf16, no clusters, tile_m 64 or 128, and the cores' own
    tile rules."""
    ok, why = check_backward_tile_m(tile_m)
    if not ok:
        return ok, why
    if mma not in PERSISTENT:
        return False, f"the backward GEMMs are built for mma in {', '.join(PERSISTENT)}, not {mma}"
    if tile_n % BWD_MN_ATOM:
        return False, f"tile_n {tile_n} must be a multiple of {BWD_MN_ATOM} (N-major weight tiles)"
    return check_gemm(n, k, tile_m, tile_n, tile_k, stages, mma, arch=arch)


def cluster_tile_m(mma) -> int:
    """The tile height of a GEMM of this MMA in 2-CTA clusters along M: hopws 128 (two M tiles
    of one expert share each weight tile by multicast), umma 256 (one 2-CTA tcgen05.mma tile over
    the pair, the routing's tile: UMMA_PAIR_TILE_M); 0 for an MMA without clusters."""
    return {"hopws": 128, "umma": UMMA_PAIR_TILE_M}.get(mma, 0)


def cluster_applies(mma, tile_m) -> bool:
    """Whether a GEMM of this MMA and tile height may run in 2-CTA clusters along M."""
    return mma in CLUSTER_MMAS and tile_m == cluster_tile_m(mma)


def check_cluster(mma, tile_m, cluster_m) -> tuple[bool, str]:
    """(ok, reason) of the CTAs per cluster along M for this MMA and tile height."""
    if cluster_m not in CLUSTERS_M:
        return False, f"cluster {cluster_m} not in {CLUSTERS_M}"
    if mma in UMMA and (cluster_m > 1 or tile_m == UMMA_PAIR_TILE_M):
        return check_umma_pair(tile_m, cluster_m)
    if cluster_m > 1 and not cluster_applies(mma, tile_m):
        return False, (f"cluster {cluster_m} needs mma hopws with tile_m 128 or umma with tile_m {UMMA_PAIR_TILE_M}, "
                       f"got {mma} with tile_m {tile_m}")
    return True, ""


# Raster groups cut at expert boundaries (templates/hopper_gemm.py raster_experts): the wgmma
# GEMMs' persistent producers, single CTAs only (a 2-CTA cluster walks expert-paired units), in
# the precisions measured with it.
RASTER_MMAS = WGMMA
RASTER_PRECISIONS = ("bf16",)


def raster_applies(mma, cluster_m=1, precision="bf16") -> bool:
    """Whether a GEMM of this MMA, cluster and precision may cut its raster groups at experts."""
    return mma in RASTER_MMAS and cluster_m == 1 and precision in RASTER_PRECISIONS


def check_raster(mma, cluster_m, precision, raster_experts) -> tuple[bool, str]:
    """(ok, reason) of raster_experts for a GEMM of this MMA, cluster and precision."""
    if raster_experts and not raster_applies(mma, cluster_m, precision):
        return False, (f"raster_experts needs mma {' or '.join(RASTER_MMAS)} in single CTAs (cluster 1) in "
                       f"{' or '.join(RASTER_PRECISIONS)}, got {mma} with cluster {cluster_m} in {precision}")
    return True, ""


def check_umma_pair(tile_m, cluster_m) -> tuple[bool, str]:
    """(ok, reason) of umma's 2-CTA pairs: cluster 2 if and only if tile_m 256. A pair's one MMA
    multiplies its 256 rows by one expert's weights (a kernel cannot mix cta_group::1 and ::2), so
    its rows must be one routing tile: the routing pads every expert to tile_m = 256 rows."""
    if cluster_m > 1 and tile_m != UMMA_PAIR_TILE_M:
        return False, (f"umma: a 2-CTA pair (cluster {cluster_m}) multiplies {UMMA_PAIR_TILE_M}-row tiles "
                       f"of one expert, so tile_m must be {UMMA_PAIR_TILE_M} (the routing padding every expert "
                       f"to {UMMA_PAIR_TILE_M} rows), not {tile_m}")
    if cluster_m == 1 and tile_m == UMMA_PAIR_TILE_M:
        return False, (f"umma: tile_m {tile_m} is one 2-CTA tcgen05.mma (cta_group::2) over a CTA pair "
                       f"and needs cluster 2")
    return True, ""


def check_layer_tile_m(tile_m, glu_mma, glu_cluster, down_mma, down_cluster) -> tuple[bool, str]:
    """(ok, reason) of a layer's tile_m against its GEMMs: routing and both GEMMs share it, and
    UMMA_PAIR_TILE_M is built only as umma 2-CTA pairs, so it needs both GEMMs as such."""
    if tile_m == UMMA_PAIR_TILE_M and not (glu_mma in UMMA and down_mma in UMMA and glu_cluster == down_cluster == 2):
        return False, (f"tile_m {tile_m} is built only for 2-CTA tcgen05 pairs: both GEMMs need mma 'umma' "
                       f"with cluster 2, got {glu_mma} cluster {glu_cluster} and {down_mma} cluster {down_cluster}")
    return True, ""


def check_gemm(n, k, tile_m, tile_n, tile_k, stages, mma, warps_m=None, warps_n=None, arch=None,
               cluster_m=1, precision="bf16") -> tuple[bool, str]:
    """(ok, reason) of one grouped GEMM over [N, K] weights: the tile rules, the 2-CTA cluster
    rule and, if `arch` is given, what that target has (wgmma, shared memory)."""
    ok, reason = check_cluster(mma, tile_m, cluster_m)
    if not ok:
        return ok, reason
    if precision in BLOCKSCALED:  # their own tile rules (the role's own: check_blockscaled with a role)
        return check_blockscaled(None, precision, n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, arch)
    if precision in W4 and warps_m is None and warps_n is None:
        warps_m, warps_n = w4_warps(tile_m, tile_n)
    warps_m, warps_n = default_warps(tile_m, tile_n, warps_m, warps_n, mma)
    ok, reason = check_tiles(n, k, tile_m, tile_n, tile_k, stages, mma, warps_m, warps_n, precision, cluster_m)
    if ok:
        ok, reason = check_w4(precision, n, k, tile_m, tile_n, tile_k, stages, mma, warps_m * warps_n * 32)
    if not ok or arch is None:
        return ok, reason
    if mma in WGMMA and arch != "sm_90a":
        return False, f"{mma}: wgmma exists only on sm_90a, not {arch}"
    if mma in UMMA and arch not in UMMA_TARGETS:
        return False, f"{mma}: tcgen05 is built for {', '.join(UMMA_TARGETS)} only, not {arch}"
    cap = SMEM_CAPACITY.get(arch)
    if cap is None:
        return False, f"arch {arch} not supported (one of {sorted(SMEM_CAPACITY)})"
    need = smem_bytes(tile_m, tile_n, tile_k, stages, mma, precision, cluster_m)
    if need > cap:
        return False, f"needs {need} B of shared memory per block, {arch} allows {cap}"
    return True, ""


def check_glu_shape(intermediate, tile_n, interleave, activation="swiglu") -> tuple[bool, str]:
    """(ok, reason) of GEMM1's own rules: the GLU activation and the gate/up interleave."""
    if activation not in ACTIVATIONS:
        return False, f"activation {activation!r} must be one of {', '.join(ACTIVATIONS)}"
    if interleave % 8 or interleave < 8:
        return False, f"interleave {interleave} must be a positive multiple of 8"
    if intermediate % interleave:
        return False, f"I={intermediate} not divisible by interleave={interleave}"
    if tile_n % (2 * interleave):
        return False, f"tile_n {tile_n} not divisible by 2*interleave={2 * interleave}"
    return True, ""


def promotes(role, precision) -> bool:
    """Whether a GEMM of this role ("glu" or "down") and precision adds its partial sums per K
    block into an fp32 accumulator outside the tensor cores (scaled, where the block has its own
    scales): every fp8 GEMM. Hopper's fp8 wgmma accumulates with fewer bits than fp32; without
    this, "fp8" GEMM1 (no scales along K) measured 3-4x the error of the promoted kernels against
    the same reference on the H200 (tools/results/NOTES.md, 2026-12-01)."""
    return precision in FP8


def check_h_block(precision, h_block, glu_tile_n=None) -> tuple[bool, str]:
    """(ok, reason) of a layer's h scale block, with the tile_n of the GEMM1 that writes it
    (None: the rules GEMM2, which reads it, shares)."""
    if h_block == H_SCALE_BLOCK:
        return True, ""
    if precision not in FP8:
        return False, (f"h_block {h_block}: only fp8 layers quantize h (with scales per h_block columns); "
                       f"{precision} takes the default {H_SCALE_BLOCK}")
    if h_block not in H_SCALE_BLOCKS:
        return False, f"h_block {h_block} must be one of {H_SCALE_BLOCKS}"
    if glu_tile_n is not None and (glu_tile_n // 2) % h_block:
        return False, (f"h_block {h_block}: GEMM1's tile_n {glu_tile_n} holds {glu_tile_n // 2} h columns, "
                       f"not whole {h_block}-column scale blocks (tile_n {2 * h_block} writes them)")
    return True, ""


def check_fp8(role, precision, n, k, tile_m, tile_n, mma, tile_k=FP8_TILE_K) -> tuple[bool, str]:
    """(ok, reason) of the fp8 rules of one GEMM beyond check_tiles (bf16: always ok). 2-CTA
    clusters follow check_cluster, as bf16's (templates/hopper_fp8.py)."""
    if precision not in FP8:
        return True, ""
    if tile_k in FP8_TILE_KS[1:] and not (role == "glu" and mma == "hopws"):
        return False, (f"{precision} {role}: tile_k {tile_k} on {mma!r}: 256-wide k-tiles are GEMM1's on "
                       f"'hopws' only (GEMM2 promotes per h block: at most two per k-tile)")
    if k % SCALE_BLOCK or n % (2 * SCALE_BLOCK if role == "glu" else SCALE_BLOCK):
        what = "2I and H" if role == "glu" else "H and I"
        return False, (f"{precision}: {what} must be multiples of {SCALE_BLOCK} (got N={n}, K={k}: "
                       f"the scale blocks and 128-element k-tiles)")
    if role == "glu" and tile_n % (2 * H_SCALE_BLOCK):
        return False, (f"{precision} GEMM1: tile_n {tile_n} must be a multiple of {2 * H_SCALE_BLOCK} "
                       f"(whole {H_SCALE_BLOCK}-column scale blocks of its output)")
    if mma not in FP8_MMAS:
        return False, f"{precision} runs on mma in {FP8_MMAS}, not {mma!r}"
    if promotes(role, precision) and mma in WGMMA and promote_parts(mma, tile_m, tile_n) > 1:
        if tile_n % PROMOTE_PART_N:
            return False, (f"{precision} {role}: a {tile_m}x{tile_n} tile is promoted in parts of "
                           f"{PROMOTE_PART_N} columns; tile_n must be a multiple of {PROMOTE_PART_N}")
    elif promotes(role, precision) and mma in WGMMA:
        acc_threads = 128 if mma in PINGPONG else max(tile_m // 64, 1) * 128  # tile_m: check_tiles' rule
        if tile_m * tile_n // acc_threads > MAX_PROMOTE_ACC:
            return False, (f"{precision} {role}: a {tile_m}x{tile_n} tile needs "
                           f"{3 * tile_m * tile_n // acc_threads} accumulator registers per thread with "
                           f"its two partial sums (max {3 * MAX_PROMOTE_ACC}): tile_n <= 128 at "
                           f"64 rows per warpgroup (wider: hopws tiles of 256 columns, promoted in parts)")
    if promotes(role, precision) and mma == "warp":
        wm, wn = default_warps(tile_m, tile_n, mma=mma)
        acc = tile_m * tile_n // (wm * wn * 32)
        if 2 * acc > MAX_ACC_REGS:
            return False, (f"{precision} {role}: a {tile_m}x{tile_n} tile on {wm * wn} warps needs {2 * acc} "
                           f"accumulator registers per thread with its partial sums (max {MAX_ACC_REGS})")
    part_n = tile_n // promote_parts(mma, tile_m, tile_n) if mma in WGMMA else tile_n
    if precision == "fp8-block128" and role == "down" and SCALE_BLOCK % part_n:
        return False, (f"{precision} GEMM2: tile_n {tile_n} must divide {SCALE_BLOCK} (one weight block), "
                       f"or be promoted in parts that do (hopws tiles of 256 columns)")
    if role == "glu" and SCALE_BLOCK % (tile_n // 2):
        return False, (f"{precision} GEMM1: tile_n {tile_n} must cover whole gate rows of one {SCALE_BLOCK}-row "
                       f"weight block (tile_n / 2 dividing {SCALE_BLOCK})")
    return True, ""

# Block-scaled formats (moe_aot/blockscale.py defines them bit for bit; templates/blockscale_quant.py
# quantizes into them): elements per scale along K, the element format's largest power of two
# (OCP MX emax_elem) for the ue8m0-scaled ones, e2m1's largest value, its rounding midpoints
# (nearest, ties to even: (midpoint, whether the tie rounds up to the even code)), and the scale
# byte of a block holding NaN or Inf (ue8m0 NaN; e4m3 NaN for NVFP4).
BLOCKSCALE_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
BLOCKSCALE_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}
MX_EMAX = {"mxfp8": 8, "mxfp4": 2}
E2M1_MAX = 6.0
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                  (5.0, False))
MX_NAN_SCALE = 0xFF
E4M3_NAN = 0x7F
# PTX cvt.rn.satfinite.e2m1x2.f32 exists from sm_100a on; sm_90a rounds to e2m1 in software
E2M1_CVT_TARGETS = ("sm_100a", "sm_121a")

# Weight-only MXFP4 ("mxfp4-w", templates/grouped_w4.py): the mma.sync core only (the decode
# regime, where weight bytes are the cost), 32 weights per ue8m0 scale byte along K. The weights
# are prepared in fragment order (runtime/w4.py: chunks of 16 rows x 64 columns, 512 code bytes and
# 32 scale bytes each); each k-tile's chunks are cp.async-ed into pipeline stages and every warp
# converts its own mma.sync B fragments in registers, so a CTA's warps all lie along N (one warp
# per 16-row chunk column: w4_warps) and each weight is converted once per CTA.
W4 = ("mxfp4-w",)
W4_MMAS = ("warp",)
W4_BLOCK = 32  # weights per scale byte along K (OCP MX)
W4_CHUNK = (16, 64)  # rows x columns of one fragment-order chunk
W4_MIN_STAGES = 3
W4_PIECE = 16  # bytes per cp.async


def w4_warps(tile_m, tile_n) -> tuple[int, int]:
    """mxfp4-w's warp grid: one warp row (every warp multiplies all tile_m rows by its own columns,
    so no weight is converted twice in a CTA), up to 4 warps along N (8 from tile_n 256), each
    owning tile_n / (16 * warps) 16-row chunks."""
    return 1, max(1, min(tile_n // W4_CHUNK[0], 4 if tile_n <= 128 else 8))


def w4_pipeline_bytes(tile_m, tile_n, tile_k, stages) -> int:
    """Shared memory of an mxfp4-w mainloop: per stage the bf16 A tile, the packed weights (half a
    byte each) and their scale bytes (no bf16 weight tile: the conversion is in registers)."""
    return stages * (tile_m * tile_k * 2 + tile_n * tile_k // 2 + tile_n * tile_k // W4_BLOCK)


def check_w4(precision, n, k, tile_m, tile_n, tile_k, stages, mma, threads=None) -> tuple[bool, str]:
    """(ok, reason) of the mxfp4-w rules of one GEMM beyond check_tiles (other precisions: ok).
    ``threads``: the CTA's threads (default: w4_warps' grid for these tiles)."""
    if precision not in W4:
        return True, ""
    if mma not in W4_MMAS:
        return False, (f"{precision} runs on mma in {W4_MMAS} (mma.sync with weights converted in registers), "
                       f"not {mma!r}")
    cn, ck = W4_CHUNK
    if k % ck or tile_k % ck:
        return False, (f"{precision}: K={k} and tile_k {tile_k} must be multiples of {ck} (the {W4_BLOCK}-weight "
                       f"scale blocks, in fragment chunks of {cn}x{ck})")
    if n % cn or tile_n % cn:
        return False, f"{precision}: N={n} and tile_n {tile_n} must be multiples of {cn} (fragment chunks)"
    if stages < W4_MIN_STAGES:
        return False, (f"{precision}: stages {stages} must be >= {W4_MIN_STAGES} (k-tiles in flight while one is "
                       f"multiplied)")
    if threads is None:
        wm, wn = w4_warps(tile_m, tile_n)
        threads = wm * wn * 32
    # a k-tile's packed weights: tile_n / 16 rows of tile_k * 8 bytes, in 16-byte cp.async pieces
    rows_per_pass = threads // (tile_k * 8 // W4_PIECE)
    if rows_per_pass < 1 or (tile_n // cn) % rows_per_pass:
        return False, (f"{precision}: tile_n {tile_n} must be a multiple of the {max(rows_per_pass, 1) * cn} packed "
                       f"weight rows one cp.async pass of {threads} threads covers (tile_k {tile_k})")
    return True, ""

# Block-scaled grouped GEMMs ("mxfp8", "nvfp4"; templates/blockscaled_warp.py): activations and
# weights both block-scaled along K, multiplied by the sm_120-family warp MMAs
# `mma.sync ... kind::mxf8f6f4.block_scale.scale_vec::1X` (e4m3, ue8m0 scale per 32) and
# `kind::mxf4nvf4.block_scale.scale_vec::4X` (e2m1, e4m3 scale per 16), which exist on the
# sm_120 family only (DGX Spark's sm_121a here; sm_90a and sm_100a have neither). Values and scale
# bytes are cp.async-ed per k-tile: a k-tile row is 64-256 value bytes and 4-16 scale bytes (one
# cp.async of 4, 8 or 16 bytes), hence the k-tiles of BS_TILE_K elements.
# "w4a8-mx" (gpt-oss's MXFP4 expert weights; sm_100a: check_bs_umma): MXFP4 weights (e2m1, ue8m0 per 32) times
# MXFP8 activations (x by the quantizer, h by GEMM1's epilogue, as "mxfp8"), on the mixed-type
# `kind::mxf8f6f4 ... .e4m3.e2m1 ... ue8m0` (each e2m1 in a byte of the B registers, bits 5:2).
# Not "mxfp4": that names the format (blockscale.FORMATS) and "mxfp4-w" Hopper's weight-only layer.
BLOCKSCALED = ("mxfp8", "nvfp4", "w4a8-mx")
BS_FORMATS = {"mxfp8": ("mxfp8", "mxfp8"), "nvfp4": ("nvfp4", "nvfp4"),  # (activations, weights)
              "w4a8-mx": ("mxfp8", "mxfp4")}
BS_MMAS = ("warp", "umma")  # mma.sync on the sm_120 family; tcgen05 on sm_100a (check_bs_umma)
BS_TARGETS = with_standins(("sm_121a",))  # the stand-in emulates the MMA (standin=True)
BS_ELEM_BITS = {"mxfp8": 8, "nvfp4": 4, "mxfp4": 4}  # per format (a precision's activations: BS_FORMATS[p][0])
BS_MMA_K = {"mxfp8": 32, "nvfp4": 64, "w4a8-mx": 32}  # K of one m16n8kK block-scaled mma.sync
BS_TILE_K = (128, 256)
# hidden and intermediate: whole scale blocks of 32 (h's output blocks: GEMM1 tiles hold whole
# ones). The k-tiles need whole 128 elements: K (x and w13 along H, h and w2 along I) is padded
# to BS_K_ALIGN (bs_padded_k) with zero values and zero scale bytes, which add exactly 0 to every
# sum: the weights at preparation (runtime/blockscaled.py), x by its quantizer (k_out), h by
# GEMM1's epilogue (the last column tile's CTAs write the padding columns as quantized zeros).
# gpt-oss's 2880 is 2944 along K (+2.2% of weight bytes streamed); a multiple of 128 is unchanged.
# The N of each GEMM (2I, H) is not padded: y and the biases keep the model's shapes.
BS_SIZE_MULTIPLE = 32
BS_K_ALIGN = 128
# the sm_100a tcgen05 kernels read K unpadded (their 128-element k-tiles must divide it)
BS_UMMA_SIZE_MULTIPLE = 128


def bs_padded_k(k: int) -> int:
    """K of a block-scaled mma.sync GEMM (and the row length of its A and B operands in memory):
    k rounded up to whole BS_K_ALIGN-element k-tiles."""
    return -(-k // BS_K_ALIGN) * BS_K_ALIGN


def bs_stored_k(target, k: int) -> int:
    """The length along K of a block-scaled layer's rows in memory (x, h, the weights and their
    scales) on `target`: padded (bs_padded_k) for the sm_120 family's mma.sync kernels, as is
    for sm_100a's tcgen05 kernels (whose spec rule keeps K a multiple of 128)."""
    return k if bs_scale_layout(target) == "tcgen05" else bs_padded_k(k)


def bs_row_bytes(precision, tile_k, weights: bool = False) -> tuple[int, int]:
    """(value bytes, scale bytes) of one row of a block-scaled k-tile of tile_k elements of the
    activations (A) or, with ``weights``, of the weights (B)."""
    fmt = BS_FORMATS[precision][int(weights)]
    return tile_k * BS_ELEM_BITS[fmt] // 8, tile_k // BLOCKSCALE_BLOCK[fmt]


def bs_smem_bytes(precision, tile_m, tile_n, tile_k, stages) -> int:
    """Shared memory of a block-scaled CTA: per stage the A and B value tiles and their scale
    bytes, reused for the fp32 staging of the accumulator tile, + the allocator's alignment slack."""
    va, sa = bs_row_bytes(precision, tile_k)
    vb, sb = bs_row_bytes(precision, tile_k, weights=True)
    return max(stages * (tile_m * (va + sa) + tile_n * (vb + sb)), tile_m * (tile_n + 8) * 4) + 1024


def check_blockscaled(role, precision, n, k, tile_m, tile_n, tile_k, stages, mma, warps_m=None, warps_n=None,
                      arch=None) -> tuple[bool, str]:
    """(ok, reason) of one block-scaled grouped GEMM over [N, K] weights: its tile rules, GEMM1's
    own (role "glu"; None: the rules both roles share) and, if `arch` is given, that target's MMAs
    and shared memory (other precisions: ok)."""
    if precision not in BLOCKSCALED:
        return True, ""
    if mma in UMMA:
        return check_bs_umma(role, precision, n, k, tile_m, tile_n, tile_k, stages, arch)
    if mma not in BS_MMAS:
        return False, (f"{precision} runs on the block-scaled mma.sync (mma 'warp', sm_121a) or tcgen05 "
                       f"(mma 'umma', sm_100a), not {mma!r}")
    if arch is not None and arch not in BS_TARGETS:
        return False, (f"{precision}: the block-scaled mma.sync exists on the sm_120 family only "
                       f"({', '.join(BS_TARGETS)} here), not on {arch}")
    if tile_k not in BS_TILE_K:
        return False, f"{precision}: tile_k {tile_k} must be one of {BS_TILE_K} (whole cp.async rows of scale bytes)"
    if k % BS_SIZE_MULTIPLE or n % BS_SIZE_MULTIPLE:
        return False, f"{precision}: N={n} and K={k} must be multiples of {BS_SIZE_MULTIPLE} (whole scale blocks)"
    kp = bs_padded_k(k)
    if kp % tile_k or n % tile_n:
        padded = f" (padded from {k})" if kp != k else ""
        return False, f"{precision}: K={kp}{padded} must be a multiple of tile_k {tile_k} and N={n} of tile_n {tile_n}"
    k = kp
    warps_m, warps_n = default_warps(tile_m, tile_n, warps_m, warps_n)
    threads = warps_m * warps_n * 32
    if warps_m < 1 or warps_n < 1 or threads > 256:
        return False, f"{precision}: warps {warps_m}x{warps_n} must be 1..8 warps"
    if tile_m % (16 * warps_m) or tile_n % (16 * warps_n) or tile_m > 256 or tile_n > 256:
        return False, (f"{precision}: tile {tile_m}x{tile_n} must be multiples of 16 per warp "
                       f"({16 * warps_m}x{16 * warps_n}) and at most 256x256")
    for rows, weights in ((tile_m, False), (tile_n, True)):
        vb, _ = bs_row_bytes(precision, tile_k, weights)
        rows_per_pass = threads // (vb // 16)
        if rows_per_pass < 1 or rows % rows_per_pass:
            return False, (f"{precision}: tile_m {tile_m} and tile_n {tile_n} must be multiples of the "
                           f"{max(rows_per_pass, 1)} rows one 16-byte cp.async pass of {threads} threads covers "
                           f"(tile_k {tile_k})")
    if tile_m * tile_n // threads > MAX_ACC_REGS:
        return False, (f"{precision}: a {tile_m}x{tile_n} tile on {threads} threads needs "
                       f"{tile_m * tile_n // threads} fp32 accumulators per thread (max {MAX_ACC_REGS})")
    if not 2 <= stages <= 8:
        return False, f"{precision}: stages {stages} must be in 2..8"
    if k // tile_k < stages - 1:
        return False, f"{precision}: K={k} has {k // tile_k} k-tiles, fewer than stages-1={stages - 1}"
    vec = BLOCKSCALE_BLOCK[BS_FORMATS[precision][0]]  # h's scale blocks
    if role == "glu" and (tile_n // 2) % vec:
        return False, (f"{precision} GEMM1: tile_n {tile_n} must hold whole {vec}-column "
                       f"scale blocks of its output in its tile_n / 2 columns")
    if arch is not None:
        cap = SMEM_CAPACITY[arch]
        need = bs_smem_bytes(precision, tile_m, tile_n, tile_k, stages)
        if need > cap:
            return False, f"{precision}: needs {need} B of shared memory per block, {arch} allows {cap}"
    return True, ""


# Block-scaled GEMMs on tcgen05 (templates/blackwell_blockscaled.py, mma "umma", sm_100a only;
# compiled, never run: no Blackwell GPU was available): the bf16 umma kernels' persistent loop with
# `tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale` (mxfp8; w4a8-mx: e4m3 x e2m1, the weights
# unpacked by their TMA to 16 per 16 bytes of shared memory) / `kind::mxf4nvf4.block_scale
# .scale_vec::4X` (nvfp4), the scale factors copied per k-tile from shared memory into TMEM
# (tcgen05.cp) in the MMA's 128x4 atom layout (blockscale.to_tcgen05_scales). A k-tile row is one
# 128-byte swizzle atom of values (four MMAs of K 32 e4m3 or unpacked e2m1, or K 64 packed e2m1);
# tile_n covers whole 128-row scale atoms of B. TMEM: the accumulators (two where they fit beside
# the scale factors) and one k-tile's scale factors of A (tile_m / 32 * 4 columns) and B (tile_n /
# 32 * 4).
BS_UMMA_PRECISIONS = ("mxfp8", "nvfp4", "w4a8-mx")
BS_UMMA_TARGETS = ("sm_100a",)
BS_UMMA_TILE_N = (128, 256)
BS_UMMA_ROW_BYTES = 128  # value bytes of a k-tile row
# w4a8-mx's weights: the unpacking TMA (CUDA's CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B: 16 packed e2m1,
# 8 bytes, per 16-byte chunk of shared memory, 8 bytes of gap) wants a 32-byte aligned base, a row
# pitch of a multiple of 32 bytes, K a multiple of 128 and a box of 128 weights along K (tile_k 128)
BS_UMMA_UNPACK_ALIGN = 32
SF_ATOM_ROWS, SF_ATOM_BLOCKS = 128, 4  # the scale atom: 128 rows x 4 K blocks, 512 bytes
# How a target's block-scaled kernels read the weights' scale bytes (and GEMM1 writes h's):
# "rows" row-major [rows, K/vec] as blockscale.quantize gives them (mma.sync takes its scales from
# registers), "tcgen05" the MMA's 128x4 atoms (blockscale.to_tcgen05_scales). x's scales stay
# row-major everywhere (GEMM1 gathers its rows).
BS_SCALE_LAYOUTS = ("rows", "tcgen05")
BS_SCALE_LAYOUT = {"sm_100a": "tcgen05"}


def bs_scale_layout(target) -> str:
    """The scale layout `target`'s block-scaled weights (and h) are in."""
    return BS_SCALE_LAYOUT.get(target, "rows")


def bs_umma_tile_k(precision) -> int:
    """tile_k of a block-scaled umma GEMM: one 128-byte row of values (128 e4m3, 256 e2m1)."""
    return BS_UMMA_ROW_BYTES * 8 // BS_ELEM_BITS[BS_FORMATS[precision][0]]


def bs_umma_sf_columns(tile_m, tile_n) -> tuple[int, int]:
    """TMEM columns of one k-tile's scale factors of A and of B (4 per 32 rows)."""
    return tile_m // 32 * SF_ATOM_BLOCKS, -(-tile_n // SF_ATOM_ROWS) * SF_ATOM_ROWS // 32 * SF_ATOM_BLOCKS


def bs_umma_acc_stages(tile_n, tile_m=128) -> int:
    """fp32 accumulators in TMEM: two (a tile's epilogue beside the next tile's MMAs) where they fit
    beside the scale factors, else one."""
    return 2 if 2 * tile_n + sum(bs_umma_sf_columns(tile_m, tile_n)) <= TMEM_COLUMNS else 1


def bs_umma_tmem_columns(tile_n, tile_m=128) -> int:
    """TMEM columns a block-scaled umma CTA allocates (a power of two of at least 32)."""
    need = bs_umma_acc_stages(tile_n, tile_m) * tile_n + sum(bs_umma_sf_columns(tile_m, tile_n))
    cols = 32
    while cols < need:
        cols *= 2
    return cols


def bs_umma_stage_bytes(precision, tile_m, tile_n) -> tuple[int, int, int, int]:
    """Shared memory of one stage: (A values, B values, A scale atoms, B scale atoms)."""
    blocks = bs_umma_tile_k(precision) // BLOCKSCALE_BLOCK[BS_FORMATS[precision][0]]
    atoms = blocks // SF_ATOM_BLOCKS * 512
    return (tile_m * BS_UMMA_ROW_BYTES, tile_n * BS_UMMA_ROW_BYTES, tile_m // SF_ATOM_ROWS * atoms,
            -(-tile_n // SF_ATOM_ROWS) * atoms)


def bs_umma_tx_bytes(precision, rows) -> int:
    """Bytes a k-tile's TMA load of ``rows`` weight rows counts on its stage's barrier: the packed
    global bytes (w4a8-mx: half a byte per e2m1, though they fill twice that in shared memory), as
    NVIDIA's sm100 block-scaled collective and CuTe DSL example count their unpacking loads."""
    return rows * bs_umma_tile_k(precision) * BS_ELEM_BITS[BS_FORMATS[precision][1]] // 8


def bs_umma_smem_bytes(precision, tile_m, tile_n, stages) -> int:
    """Dynamic shared memory of a block-scaled umma CTA: the stages after the first KB (mbarriers
    and the TMEM address slot). Exactly what the kernel's launcher asks for."""
    return stages * sum(bs_umma_stage_bytes(precision, tile_m, tile_n)) + 1024


def check_bs_umma(role, precision, n, k, tile_m, tile_n, tile_k, stages, arch=None) -> tuple[bool, str]:
    """(ok, reason) of a block-scaled tcgen05 GEMM over [N, K] weights (both roles: GEMM1's
    interleave, 16, divides every scale block) and, if `arch` is given, that target."""
    if arch is not None and arch not in BS_UMMA_TARGETS:
        return False, f"{precision} on tcgen05 (mma 'umma') is built for {', '.join(BS_UMMA_TARGETS)} only, not {arch}"
    if precision not in BS_UMMA_PRECISIONS:
        return False, f"umma: block-scaled GEMMs are built for {', '.join(BS_UMMA_PRECISIONS)}, not {precision}"
    if tile_m not in UMMA_TILE_M:
        return False, f"{precision} umma: tile_m {tile_m} must be one of {UMMA_TILE_M} (one 1-CTA tcgen05.mma M)"
    if tile_n not in BS_UMMA_TILE_N:
        return False, (f"{precision} umma: tile_n {tile_n} must be one of {BS_UMMA_TILE_N} "
                       f"(whole {SF_ATOM_ROWS}-row scale atoms)")
    want_k = bs_umma_tile_k(precision)
    if tile_k != want_k:
        return False, f"{precision} umma: tile_k {tile_k} must be {want_k} (one 128-byte row of values per k-tile)"
    if not UMMA_MIN_STAGES <= stages <= 8:
        return False, f"{precision} umma: stages {stages} must be in {UMMA_MIN_STAGES}..8"
    if k % tile_k or n % tile_n:
        return False, f"{precision} umma: K={k} must be a multiple of tile_k {tile_k} and N={n} of tile_n {tile_n}"
    if arch is not None:
        need, cap = bs_umma_smem_bytes(precision, tile_m, tile_n, stages), SMEM_CAPACITY[arch]
        if need > cap:
            return False, f"{precision} umma: needs {need} B of shared memory per block, {arch} allows {cap}"
    return True, ""


# The one-launch decode kernel (templates/decode.py; measured, not served yet): its rules here, so
# that a variant of it can be checked without the DSL.
DECODE_ARCH = "sm_90a"  # bulk copies, mbarrier transaction counts, cooperative launch
DECODE_PRECISIONS = ("bf16",) + FP8  # weights; x and h stay bf16 / fp32
DECODE_WARPS = (4, 8, 16)  # consumer warps: h / output columns per unit
# The producer warps of each way of filling a stage: "bulk", one warp of 1-D bulk copies (transaction
# bytes on the full barrier). And how phase 2 learns h is complete: "grid", one grid barrier. Four
# warps of 16-byte cp.async ("cpasync": 1-5% slower at all five bf16 presets) and a counter per expert
# group ("group": 5-29% slower) were measured and removed (twenty-third session, NOTES); the fields stay,
# with one value each, because the kernels' names (records, picks) spell them.
DECODE_PRODUCERS = {"bulk": 1}
DECODE_SYNCS = ("grid",)
DECODE_BAR_WORDS = 2  # int32 words of the barrier workspace: the grid barrier's 64-bit count
DECODE_MAX_STAGES = 10
DECODE_CHUNK = 16  # bytes of a weight row a lane loads at a time
DECODE_MAX_PAIRS = 64


def decode_weight_bytes(precision: str) -> int:
    return 1 if precision in FP8 else 2


def decode_segments(hidden, intermediate, seg_bytes, precision="bf16") -> tuple[int, int]:
    """Weight elements per row segment of w13 (of H) and of w2 (of I): the longest that divides the
    row, fits seg_bytes and is made of whole 16-byte loads (0 where none does)."""
    wb = decode_weight_bytes(precision)
    step = DECODE_CHUNK // wb

    def seg(length):
        return max((d for d in range(step, min(length, seg_bytes // wb) + 1, step) if length % d == 0), default=0)

    return seg(hidden), seg(intermediate)


def decode_layout(hidden, intermediate, max_tokens, warps, stages, seg_bytes, precision="bf16"):
    """(bytes per ring stage, fp32 elements of x, stages): a phase-1 stage holds ``warps`` row
    segments of w13, a phase-2 stage ``warps`` of w2 plus max_tokens segments of h (bf16); stages=0
    takes as many as shared memory holds (at most DECODE_MAX_STAGES)."""
    seg1, seg2 = decode_segments(hidden, intermediate, seg_bytes, precision)
    wb = decode_weight_bytes(precision)
    nbytes = max(warps * seg1 * wb, warps * seg2 * wb + max_tokens * seg2 * 2, 1)
    nbytes = -(-nbytes // 128) * 128  # 128-byte aligned stages
    x_elems = -(-max_tokens * hidden // 32) * 32  # fp32
    acc = 2 * warps * 32 * max_tokens * 4 if max_tokens > 1 else 0  # per-lane slot accumulators
    room = SMEM_CAPACITY[DECODE_ARCH] - 4 * x_elems - acc - 2048  # barriers and the group tables
    fit = room // nbytes
    return nbytes, x_elems, (min(fit, DECODE_MAX_STAGES) if stages == 0 else stages)


def check_decode(num_experts, hidden, intermediate, top_k, activation="swiglu", interleave=16, max_tokens=4,
                 warps=8, stages=0, seg_bytes=2048, ctas=132, arch=None, precision="bf16", producer="bulk",
                 sync="grid") -> tuple[bool, str]:
    """(ok, reason) of a one-launch decode kernel for this layer and these choices."""
    for name, value, allowed in (("precision", precision, DECODE_PRECISIONS),
                                 ("producer", producer, tuple(DECODE_PRODUCERS)),
                                 ("sync", sync, DECODE_SYNCS), ("activation", activation, ACTIVATIONS)):
        if value not in allowed:
            return False, f"{name} {value!r} must be one of {allowed}"
    step = DECODE_CHUNK // decode_weight_bytes(precision)
    if hidden % step or intermediate % step:
        return False, (f"hidden {hidden} and intermediate {intermediate} must be multiples of {step} "
                       f"({precision}: whole 16-byte loads)")
    if precision == "fp8-block128" and (hidden % SCALE_BLOCK or intermediate % SCALE_BLOCK or SCALE_BLOCK % interleave):
        return False, (f"fp8-block128: hidden {hidden} and intermediate {intermediate} must be multiples of "
                       f"{SCALE_BLOCK} and interleave {interleave} divide it (the 128x128 scale blocks)")
    if warps not in DECODE_WARPS or interleave % warps or intermediate % interleave or hidden % warps:
        return False, (f"warps {warps} must be one of {DECODE_WARPS} and divide interleave {interleave} and hidden "
                       f"{hidden}, and interleave divide intermediate {intermediate}")
    if not 1 <= max_tokens <= 8 or max_tokens * top_k > DECODE_MAX_PAIRS:
        return False, f"max_tokens {max_tokens} must be in 1..8 with max_tokens*top_k <= {DECODE_MAX_PAIRS}"
    if not 1 <= ctas <= 1024:
        return False, f"ctas {ctas} must be in 1..1024"
    if seg_bytes % 16 or seg_bytes < 16:
        return False, f"seg_bytes {seg_bytes} must be a positive multiple of 16"
    _, _, fit = decode_layout(hidden, intermediate, max_tokens, warps, 0, seg_bytes, precision)
    if fit < 2 or stages > fit or (stages and stages < 2):
        return False, (f"{max(stages, 2)} stages of weight segments and x of {max_tokens} tokens do not fit "
                       f"shared memory ({fit} stages fit)")
    if arch is not None and arch != DECODE_ARCH:
        return False, f"the cooperative decode kernel is built for {DECODE_ARCH}, not {arch}"
    return True, ""
