"""Weight-only MXFP4 grouped GEMMs ("mxfp4-w"): the mma.sync GEMMs of grouped_gemm.py with their
weights read as MXFP4 and converted to bf16 in registers, straight into the MMA's B fragments.

What gpt-oss ships: e2m1 weights, two per byte, and one ue8m0 scale byte per 32 weights along K
(2^(byte - 127)); moe_aot/blockscale.py defines the format bit for bit. moe_aot/runtime/w4.py
prepares the operands once at load time in *fragment order* (as Marlin does): per expert, chunks
of 16 rows x 64 columns, ``wq`` [E, N/16, K/64, 512] code bytes and ``ws`` [E, N/16, K/64, 32]
scale bytes. Lane l of a warp finds all the codes of its m16n8k16 B fragments of a chunk (rows
16c + l/4 and 16c + 8 + l/4, four k16 blocks) in bytes 16l..16l+15 of it and their four scale
bytes at 4 * (l/4): one 16-byte and one 4-byte shared load per chunk.

The mainloop (``_mainloop``, replacing grouped_gemm's "warp" one; x's gather, the fp32 staging
and both epilogues, GLU + biases and routing weight + biases, are the bf16 classes'):

  * per k-tile one cp.async group: the gathered bf16 A rows (as the bf16 kernel), the k-tile's
    code chunks and scale bytes (16-byte pieces), ``stages`` deep;
  * the warps lie along N only (``gemm_limits.w4_warps``): warp w owns the 16-row chunks
    w, w + warps, ... of the tile (the tiled MMA's N permutation gives it exactly those columns),
    multiplies all tile_m rows by them, and converts only its own chunks: each weight is
    converted once per CTA, with no shared-memory round trip and no barrier of its own;
  * per 32-bit word (8 codes, one scale): four bf16x2 registers, each a rotate and a mask of the
    word (``_word_regs``; runtime/w4.CODE_BITS put each code bit where that lands it: the code's
    magnitude at bf16 bits 6..8, its sign at 15, i.e. the e2m1 value times 2^-126 exactly, the
    0.5 code as the subnormal 2^-127), then two ``mul.bf16x2``: by c1 = 2^126 and by
    c2 = 2^(byte - 127). 9 integer operations and 8 multiplies per 8 weights; per scale a byte
    permute, a shift, a ``max.bf16x2`` (byte 0: the subnormal 2^-127) and an ``fma.bf16x2``
    (c1 = c2 * 0 + 2^126: NaN for byte 255, whose c2 is inf). bf16 arithmetic keeps subnormals,
    so every product is the exact dequantized weight (inf where it exceeds bf16, as fp32's
    dequantization) and byte 255 gives NaN (tests/test_w4.py emulates it for every code and byte).

Constraints beyond grouped_gemm's "warp" ones (``gemm_limits.check_w4``): mma "warp" only;
K and tile_k multiples of 64, N and tile_n of 16; stages >= 3; tile_n a multiple of the packed
rows one cp.async pass covers. Shared memory: ``gemm_limits.w4_pipeline_bytes``. No
pre-activation output (training is bf16's).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from moe_aot import gemm_limits as limits

from .grouped_gemm import _MMA_SHAPE, PERSISTENT_CTAS, GroupedDownGemm, GroupedGluGemm

QB = limits.W4_BLOCK  # weights per scale byte
CN, CK = limits.W4_CHUNK  # fragment-order chunk: rows x columns
CHUNK_BYTES = CN * CK // 2
CHUNK_SCALES = CN * CK // QB
_P = "0x81C081C0"  # bf16x2 bits 6..8 and 15 of both halves: a code's magnitude and sign
# runtime/w4.ROTATE: output o of a word is rotl(word, ROTATE[o]) & _P; output 3 takes bits 6, 7, 15
# (and 22, 23, 31) from rotl(word, 6) and bits 8, 24 from rotl(word, 30)
_ROTATE = (0, 4, 10)


def _asm(args, body, constraints, loc=None, ip=None):
    return Int32(llvm.inline_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip) for a in args], body, constraints,
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _word_reg(word, o: int, c1, c2, *, loc=None, ip=None) -> Int32:
    """Output ``o`` (0..3) of a word of eight e2m1 codes: a bf16x2 register of two weights times
    the pair of scales c1 * c2 (see the module docstring)."""
    if o == 3:
        bits = ("shf.l.wrap.b32 t, $1, $1, 6; and.b32 t, t, 0x80C080C0; "
                "shf.l.wrap.b32 u, $1, $1, 30; and.b32 u, u, 0x01000100; or.b32 t, t, u; ")
    elif _ROTATE[o] == 0:
        bits = f"and.b32 t, $1, {_P}; "
    else:
        bits = f"shf.l.wrap.b32 t, $1, $1, {_ROTATE[o]}; and.b32 t, t, {_P}; "
    return _asm([word, c1, c2], "{ .reg .b32 t, u; " + bits + "mul.rn.bf16x2 t, t, $2; mul.rn.bf16x2 $0, t, $3; }",
                "=r,r,r,r", loc=loc, ip=ip)


@dsl_user_op
def _scale_pair(sword, j: int, *, loc=None, ip=None):
    """(c1, c2) bf16x2 pairs of scale byte ``j`` of ``sword``: c2 = 2^(byte - 127) in both halves
    (byte << 7, at least the subnormal 2^-127 for byte 0, inf for 255), c1 = c2 * 0 + 2^126
    (NaN for byte 255)."""
    sel = f"0x{0x4040 | (j << 8) | j:04x}"  # bytes j, 0, j, 0 (selector 4: the zero register)
    c2 = _asm([sword], "{ .reg .b32 t, z, m; mov.b32 z, 0; mov.b32 m, 0x00400040; "
              f"prmt.b32 t, $1, z, {sel}; shl.b32 t, t, 7; max.bf16x2 $0, t, m; }}", "=r,r", loc=loc, ip=ip)
    c1 = _asm([c2], "{ .reg .b32 z, k; mov.b32 z, 0; mov.b32 k, 0x7E807E80; fma.rn.bf16x2 $0, $1, z, k; }",
              "=r,r", loc=loc, ip=ip)
    return c1, c2


class _W4Mainloop:
    """The mxfp4-w shared memory and mainloop of both GEMMs (see the module docstring). The
    weight arguments are (codes, scales) pairs wherever the bf16 classes pass one tensor."""

    @staticmethod
    def _w4_warps(tile_m, tile_n, warps_m, warps_n):
        if warps_m is None and warps_n is None:
            return limits.w4_warps(tile_m, tile_n)
        return warps_m, warps_n

    def _w4_init(self):
        if self.precision not in limits.W4:
            raise ValueError(f"{type(self).__name__} is the mxfp4-w GEMM; precision {self.precision!r} is not")
        if self.warps_m != 1:
            raise ValueError(f"mxfp4-w GEMMs put every warp along N (warps_m 1), got warps_m {self.warps_m}")
        self.chunks_n = self.tile_n // CN // self.warps_n  # 16-row chunks per warp
        self.chunks_k = self.tile_k // CK
        if self.chunks_n * CN * self.warps_n != self.tile_n:
            raise ValueError(f"tile_n {self.tile_n} is not a multiple of {CN} rows x {self.warps_n} warps")
        # 16-byte pieces of one k-tile's scales: tile_n / 16 rows of tile_k / 2 bytes
        self.scale_pieces = (self.tile_n // CN) * (self.tile_k // 2 // limits.W4_PIECE)
        if self.scale_pieces > self.mma_threads:
            raise ValueError(f"{self.scale_pieces} scale pieces per k-tile exceed the {self.mma_threads} threads")

    # ------------------------------------------------------------------ host side
    def _make_tiled_mma(self):
        """mma.sync m16n8k16 on a 1 x warps_n warp grid whose N permutation gives warp w the
        16-row chunks w, w + warps_n, ... of the tile (two n8 atoms each: rows 16c + lane/4 and
        16c + 8 + lane/4, the rows of a fragment-order chunk's lane)."""
        op = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, _MMA_SHAPE)
        perm_n = cute.make_layout((8, self.warps_n, 2), stride=(1, CN, 8))
        return cute.make_tiled_mma(op, cute.make_layout((1, self.warps_n, 1)), permutation_mnk=(16, perm_n, 16))

    def _make_piece_copy(self, per_row: int, rows: int):
        """cp.async of 16-byte pieces, ``per_row`` threads per row and ``rows`` rows per pass of
        a 2-D byte tile."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Uint8, num_bits_per_copy=128)
        thr = cute.make_layout((rows, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, limits.W4_PIECE)))

    @staticmethod
    def _fake_chunks(dtype, e, n, k, per_chunk):
        """[E, N/16, K/64, per_chunk] bytes in fragment order (runtime/w4.py), contiguous."""
        from cutlass.cute.runtime import make_fake_tensor

        kc = k // CK
        return make_fake_tensor(dtype, (e, n // CN, kc, per_chunk),
                                (n // CN * kc * per_chunk, kc * per_chunk, per_chunk, 1), assumed_align=16)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _smem_tensors(self):
        """A stages (bf16, the bf16 kernel's swizzled layout), code stages [tile_n/16, tile_k*8]
        bytes and scale stages [tile_n/16, tile_k/2] bytes; the fp32 staging tile over the same
        bytes. Returns (sA, (sQ, sS), sC_ptr)."""
        smem = cutlass.memory.SmemAllocator()
        a_bytes = self.stages * self.tile_m * self.tile_k * 2
        q_stage = self.tile_n * self.tile_k // 2
        s_stage = self.tile_n * self.tile_k // QB
        ab = a_bytes + self.stages * (q_stage + s_stage)
        base = smem.allocate(max(ab, self.tile_m * self.c_row_stride * 4), byte_alignment=1024)
        sA_layout, swizzle = self._smem_layout_ab(self.tile_m)
        sA = cute.make_tensor(cute.recast_ptr(base, swizzle, BFloat16), sA_layout)
        q_base = base + a_bytes
        rows = self.tile_n // CN
        sQ = cute.make_tensor(cute.recast_ptr(q_base, dtype=Uint8), cute.make_layout(
            (rows, self.tile_k * 8, self.stages), stride=(self.tile_k * 8, 1, q_stage)))
        sS = cute.make_tensor(cute.recast_ptr(q_base + self.stages * q_stage, dtype=Uint8), cute.make_layout(
            (rows, self.tile_k // 2, self.stages), stride=(self.tile_k // 2, 1, s_stage)))
        return sA, (sQ, sS), cute.recast_ptr(base, dtype=cutlass.Float32)

    @cute.jit
    def _expert_weights(self, mW, expert):
        """(codes [N/16, K*8], scales [N/16, K/2]) bytes of one expert (a row: one 16-row chunk
        row, its chunks along K in order), offsets formed in 64 bits."""
        mQ, mS = mW
        rows = self.n // CN
        q = cute.make_tensor((mQ.iterator + cutlass.Int64(expert) * (self.n * self.k // 2)).align(16),
                             cute.make_layout((rows, self.k * 8), stride=(self.k * 8, 1)))
        s = cute.make_tensor((mS.iterator + cutlass.Int64(expert) * (self.n * self.k // QB)).align(16),
                             cute.make_layout((rows, self.k // 2), stride=(self.k // 2, 1)))
        return q, s

    @cute.jit
    def _mainloop(self, tidx, mA, a_rows, sA, mBe, bn, sB, tiled_mma, acc, pstate=None):
        """acc += A[a_rows] @ dequant(B_e)[bn-tile]^T over all of K (see the module docstring);
        ``pstate`` is always None here (the weights' scales are applied in the conversion)."""
        mQe, mSe = mBe
        sQ, sS = sB
        k_tiles = self.k // self.tile_k
        stages = self.stages
        rows = self.tile_n // CN
        # A: the bf16 kernel's cp.async partitions; padding rows zero-filled in every stage
        a_copy = self._make_g2s_copy()
        thr_a = a_copy.get_slice(tidx)
        tAsA = thr_a.partition_D(sA)
        tAcA = thr_a.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            if a_rows[m] < 0:
                for s in cutlass.range_constexpr(stages):
                    tAsA[None, m, None, s].fill(0)
        # codes and scales: 16-byte pieces of [rows, tile_k * 8] and [rows, tile_k / 2] byte tiles
        q_per_row = self.tile_k * 8 // limits.W4_PIECE
        q_copy = self._make_piece_copy(q_per_row, self.mma_threads // q_per_row)
        tQgQ = q_copy.get_slice(tidx).partition_S(cute.local_tile(mQe, (rows, self.tile_k * 8), (bn, None)))
        tQsQ = q_copy.get_slice(tidx).partition_D(sQ)
        s_copy = self._make_piece_copy(self.tile_k // 2 // limits.W4_PIECE, rows)  # the first scale_pieces threads
        thr_s = s_copy.get_slice(tidx % self.scale_pieces)
        tSgS = thr_s.partition_S(cute.local_tile(mSe, (rows, self.tile_k // 2), (bn, None)))
        tSsS = thr_s.partition_D(sS)
        copies = (q_copy, tQgQ, tQsQ, s_copy, tSgS, tSsS)

        # this lane's words of every chunk: [4 words, lane, chunks_k, rows, stage] and its scale
        # word [lane / 4, chunks_k, rows, stage]
        sQw = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=Int32), cute.make_layout(
            (4, 32, self.chunks_k, rows, stages),
            stride=(1, 4, CHUNK_BYTES // 4, self.tile_k * 2, self.tile_n * self.tile_k // 8)))
        sSw = cute.make_tensor(cute.recast_ptr(sS.iterator, dtype=Int32), cute.make_layout(
            (8, self.chunks_k, rows, stages),
            stride=(1, CHUNK_SCALES // 4, self.tile_k // 8, self.tile_n * self.tile_k // QB // 4)))
        lane = tidx % 32
        warp = tidx // 32

        # prologue: k-tiles 0 .. stages-2, one group each (pdl: the weights of all of them
        # before waiting for the previous grid, A after)
        if const_expr(self.early_b):
            for s in cutlass.range_constexpr(stages - 1):
                self._load_w(s, s, tidx, copies)
            self._grid_dependency_wait()
            for s in cutlass.range_constexpr(stages - 1):
                self._load_a(s, s, a_copy, mA, a_rows, tAsA, tAcA)
                cute.arch.cp_async_commit_group()
        else:
            for s in cutlass.range_constexpr(stages - 1):
                self._load_w(s, s, tidx, copies)
                self._load_a(s, s, a_copy, mA, a_rows, tAsA, tAcA)
                cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(
            cute.make_identity_tensor((self.tile_n, self.tile_k))).shape)
        rB = cute.recast_tensor(tCrB, Int32)  # ((1, 2 registers), (2 n8 atoms, chunks_n), k16 blocks)
        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16)
        s2r_A = cute.make_tiled_copy_A(ldm, tiled_mma)
        tXsA = s2r_A.get_slice(tidx).partition_S(sA)
        tXrA = s2r_A.get_slice(tidx).retile(tCrA)
        num_kb = cute.size(tCrA, mode=[2])

        stage = Int32(0)  # k-tile kt's stage
        write_stage = Int32(stages - 1)
        for kt in range(k_tiles):
            # k-tile kt has landed (one group per k-tile); every warp is done with k-tile kt - 1's
            # stage, which the loads below refill
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.sync_threads()
            if kt + (stages - 1) < k_tiles:
                self._load_w(kt + (stages - 1), write_stage, tidx, copies)
                self._load_a(kt + (stages - 1), write_stage, a_copy, mA, a_rows, tAsA, tAcA)
            cute.arch.cp_async_commit_group()
            write_stage = stage
            self._convert(sQw, sSw, rB, lane, warp, stage)
            for kb in cutlass.range_constexpr(num_kb):
                cute.copy(s2r_A, tXsA[None, None, kb, stage], tXrA[None, None, kb])
            for kb in cutlass.range_constexpr(num_kb):
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            stage = stage + 1
            if stage == stages:
                stage = Int32(0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

    @cute.jit
    def _load_w(self, kt, stage, tidx, copies):
        """cp.async of k-tile ``kt``'s codes and scales into pipeline stage ``stage``."""
        q_copy, tQgQ, tQsQ, s_copy, tSgS, tSsS = copies
        cute.copy(q_copy, tQgQ[None, None, None, kt], tQsQ[None, None, None, stage])
        if tidx < self.scale_pieces:
            cute.copy(s_copy, tSgS[None, None, None, kt], tSsS[None, None, None, stage])

    @cute.jit
    def _convert(self, sQw, sSw, rB, lane, warp, stage):
        """This warp's B fragments of the k-tile in ``stage``: per chunk (j, kc) one 16-byte and
        one 4-byte shared load, then word w = 2h + b -> n8 atom h, k16 blocks 4kc + 2b + i,
        registers r (output o = 2i + r of the word)."""
        for j in cutlass.range_constexpr(self.chunks_n):
            row = warp + j * self.warps_n
            for kc in cutlass.range_constexpr(self.chunks_k):
                words = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                cute.autovec_copy(sQw[None, lane, kc, row, stage], words)
                sword = sSw[lane // 4, kc, row, stage]
                for w in cutlass.range_constexpr(4):
                    c1, c2 = _scale_pair(sword, w)
                    for o in cutlass.range_constexpr(4):
                        kb = 4 * kc + 2 * (w % 2) + o // 2
                        # colexicographic index of ((1, 2 registers), (2 atoms, chunks_n), k16 blocks)
                        rB[o % 2 + 2 * (w // 2) + 4 * j + 4 * self.chunks_n * kb] = _word_reg(words[w], o, c1, c2)


class GroupedGluGemmW4(_W4Mainloop, GroupedGluGemm):
    """GEMM1 + GLU of an mxfp4-w layer: GroupedGluGemm with MXFP4 weights.

    ``__call__(x, w13q, w13s, sorted_ids, tile_expert, h, b13, stream)``: x [M, H] bf16;
    w13q [E, 2I/16, H/64, 512] and w13s [E, 2I/16, H/64, 32] uint8 in fragment order
    (runtime/w4.py; rows gate/up interleaved in blocks of ``interleave``); the rest, the
    activations and the biases (b13 [E, 2I] bf16 or None) as GroupedGluGemm's.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 activation: str = "swiglu", interleave: int = 16,
                 tile_m: int = 16, tile_n: int = 128, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "mxfp4-w",
                 bias: bool = False, save_preact: bool = False):
        warps_m, warps_n = self._w4_warps(tile_m, tile_n, warps_m, warps_n)
        super().__init__(num_experts, hidden, intermediate, top_k, activation, interleave, tile_m, tile_n,
                         tile_k, stages, mma, warps_m, warps_n, pdl, ctas, precision, bias, save_preact)
        self._w4_init()

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream

        args = dict(super().fake_arguments())
        e, hd, i2 = self.num_experts, self.hidden, 2 * self.intermediate
        return [("x", args["x"]),
                ("w13q", self._fake_chunks(Uint8, e, i2, hd, CHUNK_BYTES)),
                ("w13s", self._fake_chunks(Uint8, e, i2, hd, CHUNK_SCALES)),
                ("sorted_ids", args["sorted_ids"]), ("tile_expert", args["tile_expert"]), ("h", args["h"]),
                ("b13", args["b13"]), ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, x: cute.Tensor, w13q: cute.Tensor, w13s: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, h: cute.Tensor, b13: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_w4(x, w13q, w13s, sorted_ids, tile_expert, h, b13).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_w4(self, mX: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mH: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mX, (mWq, mWs), mIds, mTileExpert, self._epi(mH, mB, mIds, mTileExpert))


class GroupedDownGemmW4(_W4Mainloop, GroupedDownGemm):
    """GEMM2 of an mxfp4-w layer: GroupedDownGemm with MXFP4 weights.

    ``__call__(h, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, b2, stream)``: w2q
    [E, H/16, I/64, 512] and w2s [E, H/16, I/64, 32] uint8 in fragment order; the rest as
    GroupedDownGemm's.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 tile_m: int = 16, tile_n: int = 64, tile_k: int = 64, stages: int = 4,
                 mma: str = "warp", warps_m: int | None = None, warps_n: int | None = None,
                 pdl: bool = False, ctas: int = PERSISTENT_CTAS, precision: str = "mxfp4-w",
                 bias: bool = False):
        warps_m, warps_n = self._w4_warps(tile_m, tile_n, warps_m, warps_n)
        super().__init__(num_experts, hidden, intermediate, top_k, tile_m, tile_n, tile_k, stages, mma,
                         warps_m, warps_n, pdl, ctas, precision, bias)
        self._w4_init()

    def fake_arguments(self):
        from cutlass.cute.runtime import make_fake_stream

        args = dict(super().fake_arguments())
        e, hd, i = self.num_experts, self.hidden, self.intermediate
        return [("h", args["h"]),
                ("w2q", self._fake_chunks(Uint8, e, hd, i, CHUNK_BYTES)),
                ("w2s", self._fake_chunks(Uint8, e, hd, i, CHUNK_SCALES)),
                ("sorted_ids", args["sorted_ids"]), ("tile_expert", args["tile_expert"]),
                ("topk_weights", args["topk_weights"]), ("y", args["y"]), ("b2", args["b2"]),
                ("stream", make_fake_stream())]

    @cute.jit
    def __call__(self, h: cute.Tensor, w2q: cute.Tensor, w2s: cute.Tensor, sorted_ids: cute.Tensor,
                 tile_expert: cute.Tensor, topk_weights: cute.Tensor, y: cute.Tensor,
                 b2: Optional[cute.Tensor], stream: cuda.CUstream):
        grid, block = self._launch_common(self.n // self.tile_n, tile_expert)
        self.kernel_w4(h, w2q, w2s, sorted_ids, tile_expert, topk_weights, y, b2).launch(
            grid=grid, block=block, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel_w4(self, mH: cute.Tensor, mWq: cute.Tensor, mWs: cute.Tensor, mIds: cute.Tensor,
                  mTileExpert: cute.Tensor, mTopkW: cute.Tensor, mY: cute.Tensor, mB: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        self._tile(tidx, mH, (mWq, mWs), mIds, mTileExpert, self._epi(mIds, mTopkW, mY, mB, mTileExpert))
