"""Expert parallelism over torch.distributed: each rank holds some of a layer's experts, tokens
go to the ranks that own their experts by all_to_all_single, the local experts are computed by
our layer (MoeExperts with an expert_map: the AOT kernels on CUDA, the fp32 reference on the
CPU), and the results come back and are summed per token.

    dist.init_process_group("nccl")                            # or init_expert_parallel()
    placement = Placement.contiguous(experts=256, world=dist.get_world_size())
    layer = ExpertParallelMoe.from_weights(w13_local, w2_local, placement)   # this rank's experts
    out = layer(x, topk_weights, topk_ids)                     # global ids; [M, H] like x

The exchange is per (token, rank): a token goes once to each rank owning at least one of its
experts, with its ids there and -1 in the slots of experts owned elsewhere, so a rank computes
exactly the pairs it owns (even if it holds copies of others' experts) and returns one partial
sum per token, already weighted by the routing weights (the fused layer's combine). The origin
adds the partials in fp32 and rounds once to x's dtype. Two exchanges:

- "padded" (default): every rank sends its whole batch to every rank, ids masked as above, and
  receives [world, capacity] rows. No host sync at all (every size is a shape: tokens, world,
  capacity), so it runs under CUDA-graph capture and torch.compile. What it costs: world x the
  activations over the wire and in the routing kernel, where a token really needs only the
  ranks it routes to; with top_k >= world (DeepSeek-V3, Qwen3-235B: top_k 8 on up to 8 ranks) a
  token reaches most ranks anyway (6.6 of 8 on average with uniform routing), so padding costs
  little, and rows whose ids are all -1 cost the GEMMs nothing (the kernels skip them). Every
  rank's batch must have the same number of rows, `capacity` (a constructor argument; batches
  of fewer tokens are padded to it here, by shape); None means this call's token count, which
  then has to be equal on every rank (engines pad data-parallel batches to one size anyway).
- "exact": only the (token, rank) pairs needed, in variable splits. all_to_all_single needs the
  split sizes on the host, so this exchange exchanges the per-rank counts and reads them back:
  one explicit host sync per forward (plus the nonzero() that builds the send order), which a
  CUDA graph cannot capture. Any token count per rank; less traffic where top_k < world.

Start the process group through init_expert_parallel (or keep the variables it checks): NVLink
multicast stays off in NCCL, PyTorch and NVSHMEM (MULTICAST_OFF), as the GPU hosts require.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ..runtime.library import KernelArgumentError

EXCHANGES = ("padded", "exact")
# NVLink multicast off: a program using it can take a shared host's GPUs out of service.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off(environ=None) -> None:
    """Set the MULTICAST_OFF variables where unset; refuse where one is set otherwise (before
    NCCL reads them, i.e. before the first communicator is created)."""
    environ = os.environ if environ is None else environ
    for k, v in MULTICAST_OFF.items():
        if environ.setdefault(k, v) != v:
            raise RuntimeError(f"{k}={environ[k]} turns NVLink multicast on; expert parallelism keeps it off "
                               f"({k}={v}): unset it or set it to {v}")


def init_expert_parallel(backend: str | None = None, **kw):
    """torch.distributed.init_process_group with NVLink multicast off (multicast_off); backend
    nccl where CUDA is available, else gloo. Returns the default group."""
    import torch.distributed as dist

    multicast_off()
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), **kw)
    return dist.group.WORLD


# -- placement: which rank owns which expert ------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """owner[e]: the rank that computes global expert e; local[e]: its index among that rank's
    experts (what the rank's weights are indexed by)."""
    owner: torch.Tensor  # [E] int64
    local: torch.Tensor  # [E] int64
    world: int

    @classmethod
    def contiguous(cls, experts: int, world: int) -> "Placement":
        """Rank r owns experts [r E/N, (r+1) E/N)."""
        if world < 1 or experts % world:
            raise KernelArgumentError(f"{experts} experts do not split evenly over {world} ranks; give a "
                                      "Placement.from_expert_maps for an uneven split")
        e = torch.arange(experts)
        per = experts // world
        return cls(e // per, e % per, world)

    @classmethod
    def from_expert_maps(cls, maps) -> "Placement":
        """From each rank's expert_map ([E] local id, -1 where not local; MoeExperts' argument):
        every expert must be local to exactly one rank, each rank's local ids 0..n-1."""
        maps = [torch.as_tensor(m, dtype=torch.int64).cpu() for m in maps]
        if not maps or any(m.dim() != 1 or m.shape != maps[0].shape for m in maps):
            raise KernelArgumentError("expert maps must be 1-D tensors of one length [global experts], one per rank")
        held = torch.stack([m >= 0 for m in maps])
        per_expert = held.sum(0)
        if (per_expert != 1).any():
            e = int(torch.nonzero(per_expert != 1)[0])
            raise KernelArgumentError(f"expert {e} is local to {int(per_expert[e])} ranks; each expert needs "
                                      "exactly one owner")
        for r, m in enumerate(maps):
            ids = m[m >= 0].sort().values
            if not torch.equal(ids, torch.arange(len(ids))):
                raise KernelArgumentError(f"rank {r}'s expert_map must number its experts 0..{len(ids) - 1}")
        owner = held.to(torch.int64).argmax(0)
        local = torch.stack(maps).gather(0, owner[None]).squeeze(0)
        return cls(owner, local, len(maps))

    @property
    def experts(self) -> int:
        return self.owner.shape[0]

    def expert_map(self, rank: int) -> torch.Tensor:
        """[E] int32: local id on `rank`, -1 elsewhere (MoeExperts' expert_map)."""
        return torch.where(self.owner == rank, self.local, -1).to(torch.int32)

    def local_experts(self, rank: int) -> torch.Tensor:
        """The global ids of `rank`'s experts in local order."""
        ids = torch.nonzero(self.owner == rank).flatten()
        return ids[self.local[ids].argsort()]


# -- the index math (pure tensor ops, one process; tested against a reference) ---------------------

def owners_of(topk_ids: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """[M, K] owning rank of each pair; -1 for ids outside [0, E) (they contribute nothing)."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < owner.shape[0])
    return torch.where(valid, owner.to(ids.device)[ids.clamp(0, owner.shape[0] - 1)], -1)


def mask_for(topk_ids: torch.Tensor, pair_owner: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """The ids sent to `dest` (broadcasting): each pair's global id where dest owns it, else -1."""
    return torch.where(pair_owner == dest, topk_ids.to(torch.int32), -1).to(torch.int32)


def padded_dispatch(topk_ids: torch.Tensor, owner: torch.Tensor, world: int) -> torch.Tensor:
    """[world, M, K] int32: the ids row block r of the padded exchange carries to rank r."""
    po = owners_of(topk_ids, owner)
    ranks = torch.arange(world, device=topk_ids.device).view(world, 1, 1)
    return mask_for(topk_ids[None], po[None], ranks)


def exact_dispatch(topk_ids: torch.Tensor, owner: torch.Tensor, world: int):
    """The exact exchange's send side: (rows [S] int64, the token of each send slot, grouped by
    destination rank in rank order and by token within a rank; ids [S, K] int32 masked for the
    slot's rank; counts [world] int64 slots per rank). A token goes to each owning rank once.
    nonzero() here has a data-dependent size: this synchronizes with the host."""
    po = owners_of(topk_ids, owner)
    M = topk_ids.shape[0]
    hit = torch.zeros(world, M, dtype=torch.bool, device=topk_ids.device)
    valid = po >= 0
    rows = torch.arange(M, device=topk_ids.device).unsqueeze(1).expand_as(po)
    hit[po[valid], rows[valid]] = True
    dest, token = hit.nonzero(as_tuple=True)
    ids = mask_for(topk_ids[token], po[token], dest.unsqueeze(1))
    return token, ids, hit.sum(1)


def combine_padded(back: torch.Tensor) -> torch.Tensor:
    """[world, M, H] partial sums from each rank -> [M, H] fp32."""
    return back.float().sum(0)


def combine_exact(back: torch.Tensor, token: torch.Tensor, tokens: int) -> torch.Tensor:
    """[S, H] partial sums in send order -> [tokens, H] fp32, summed per token (zero where no
    rank had any of a token's experts)."""
    out = torch.zeros(tokens, back.shape[1], dtype=torch.float32, device=back.device)
    return out.index_add_(0, token, back.float())


def _pack(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ids int32 and weights fp32 side by side as one int32 tensor: one collective for both."""
    return torch.cat([ids, weights.float().contiguous().view(torch.int32)], dim=-1)


def _unpack(meta: torch.Tensor, k: int):
    return meta[..., :k].contiguous(), meta[..., k:].contiguous().view(torch.float32)


# -- the layer -----------------------------------------------------------------------------------

class ExpertParallelMoe(nn.Module):
    """forward(x [M, H], topk_weights [M, K], topk_ids [M, K] global ids) -> [M, H] in x's dtype,
    the whole layer's output (every rank's experts), on every rank for its own tokens.

    experts: this rank's experts, called as experts(x_rows, weights, ids) with global ids, -1
    where a pair is not this rank's; MoeExperts with expert_map=placement.expert_map(rank) is
    one (from_weights builds it), any module of that contract another. group: the process
    group (default: the world). exchange: "padded" or "exact" (module docstring)."""

    def __init__(self, experts: nn.Module, placement: Placement, group=None, exchange: str = "padded",
                 capacity: int | None = None, rank: int | None = None):
        super().__init__()
        import torch.distributed as dist

        if exchange not in EXCHANGES:
            raise KernelArgumentError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise KernelArgumentError(f"capacity must be a number of tokens >= 0 or None, got {capacity!r}")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group) if rank is None else rank
        if placement.world != self.world:
            raise KernelArgumentError(f"the placement is for {placement.world} ranks, the group has {self.world}")
        self.experts, self.placement, self.exchange, self.capacity = experts, placement, exchange, capacity
        self.register_buffer("owner", placement.owner.clone(), persistent=False)

    @classmethod
    def from_weights(cls, w13: torch.Tensor, w2: torch.Tensor, placement: Placement, group=None,
                     activation: str = "swiglu", b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     **kw) -> "ExpertParallelMoe":
        """This rank's experts' prepared weights (w13 [E_local, 2I, H] from prepare_weights, w2
        [E_local, H, I], biases likewise, in local order; Placement.local_experts(rank) says
        which) -> the layer over a MoeExperts with the rank's expert_map."""
        import torch.distributed as dist

        from .modules import MoeExperts

        rank = dist.get_rank(group)
        n = int((placement.owner == rank).sum())
        if w13.shape[0] != n:
            raise KernelArgumentError(f"rank {rank} owns {n} experts in the placement, the weights hold {w13.shape[0]}")
        experts = MoeExperts(w13, w2, activation, expert_map=placement.expert_map(rank), b13=b13, b2=b2)
        return cls(experts, placement, group, **kw)

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, world={self.world}, experts={self.placement.experts}, exchange={self.exchange}"
                + (f", capacity={self.capacity}" if self.capacity is not None else ""))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or \
                topk_ids.shape[0] != x.shape[0]:
            raise KernelArgumentError(f"x [M, H], topk_weights and topk_ids [M, K] expected, got {tuple(x.shape)}, "
                                      f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
        if self.exchange == "padded":
            return self._padded(x, topk_weights, topk_ids)
        return self._exact(x, topk_weights, topk_ids)

    def _a2a(self, out, inp, out_splits=None, in_splits=None):
        import torch.distributed as dist

        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        return out

    def _padded(self, x, topk_weights, topk_ids):
        N, (M, H), K = self.world, x.shape, topk_ids.shape[1]
        cap = M if self.capacity is None else self.capacity
        if M > cap:
            raise KernelArgumentError(f"{M} tokens exceed the padded exchange's capacity of {cap} per rank")
        ids = topk_ids.to(torch.int32)
        if cap > M:  # by shape: padding rows route nowhere
            x = torch.cat([x, x.new_zeros(cap - M, H)])
            ids = torch.cat([ids, ids.new_full((cap - M, K), -1)])
            topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(cap - M, K)])
        meta = _pack(padded_dispatch(ids, self.owner, N), topk_weights.float().expand(N, cap, K))
        x_recv = self._a2a(x.new_empty(N, cap, H), x.expand(N, cap, H).contiguous())
        meta_recv = self._a2a(torch.empty_like(meta), meta)
        ids_recv, w_recv = _unpack(meta_recv.view(N * cap, 2 * K), K)
        y = self.experts(x_recv.view(N * cap, H), w_recv, ids_recv).to(x.dtype)
        back = self._a2a(torch.empty_like(y), y.contiguous()).view(N, cap, H)
        return combine_padded(back)[:M].to(x.dtype)

    def _exact(self, x, topk_weights, topk_ids):
        M, H, K = x.shape[0], x.shape[1], topk_ids.shape[1]
        token, ids, counts = exact_dispatch(topk_ids, self.owner, self.world)
        recv_counts = self._a2a(torch.empty_like(counts), counts)
        send, recv = counts.tolist(), recv_counts.tolist()  # the host sync of this exchange
        x_recv = self._a2a(x.new_empty(sum(recv), H), x[token].contiguous(), recv, send)
        meta = _pack(ids, topk_weights[token])
        meta_recv = self._a2a(meta.new_empty(sum(recv), 2 * K), meta, recv, send)
        ids_recv, w_recv = _unpack(meta_recv, K)
        y = self.experts(x_recv, w_recv, ids_recv).to(x.dtype).contiguous()  # no rows: an empty y
        back = self._a2a(y.new_empty(sum(send), H), y, send, recv)
        return combine_exact(back, token, M).to(x.dtype)
