"""GPU test of expert parallelism: the layer on N GPUs through NCCL (one spawned process per GPU,
NVLink multicast off) against the single-GPU layer, both exchanges; the padded one without a
host sync (torch.cuda.set_sync_debug_mode("error")) and replayed from a CUDA graph. Skips with
fewer than 2 GPUs. Needs the kernels of the whole layer and of its E/N-expert share, e.g. for
2 GPUs: `moe-aot compile --model qwen3-30b-a3b` and `moe-aot compile --experts 64 --top-k 8
--hidden 2048 --intermediate 768` (MOE_AOT_DB names the database; MOE_AOT_TEST_EP_GPUS the
number of GPUs, default all)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
GPUS = int(os.environ.get("MOE_AOT_TEST_EP_GPUS", torch.cuda.device_count() if torch.cuda.is_available() else 0))
if GPUS < 2:
    pytest.skip("expert parallelism needs 2 or more CUDA GPUs", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from moe_aot.harness.reference import rel_err  # noqa: E402
from moe_aot.harness.verify import random_routing  # noqa: E402
from moe_aot.integrations import parallel as ep  # noqa: E402
from moe_aot.integrations.modules import MoeExperts  # noqa: E402
from moe_aot.spec import make_spec  # noqa: E402

SPEC = make_spec("qwen3-30b-a3b")


def _rank(rank, world, store, tokens, result):
    from moe_aot.harness.verify import random_weights
    from moe_aot.runtime.store import KernelMissingError

    torch.cuda.set_device(rank)
    ep.init_expert_parallel("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same weights on every rank
        w13, w2 = random_weights(SPEC, torch.device("cuda", rank))
        whole = MoeExperts(w13, w2)
        placement = ep.Placement.contiguous(SPEC.experts, world)
        mine = placement.local_experts(rank).cuda()
        for m in tokens:
            torch.manual_seed(100 + rank)
            x = torch.randn(m, SPEC.hidden, device="cuda", dtype=torch.bfloat16)
            tw, ids = random_routing(m, SPEC, torch.device("cuda", rank))
            want = whole(x, tw, ids)
            for exchange in ("exact", "padded"):
                layer = ep.ExpertParallelMoe.from_weights(w13[mine].contiguous(), w2[mine].contiguous(), placement,
                                                          exchange=exchange)
                try:
                    got = layer(x, tw, ids)
                except KernelMissingError as exc:
                    result[rank] = f"skip: {exc}"
                    return
                err = rel_err(got.float(), want.float())
                assert err < 1e-2, (rank, m, exchange, err)
                if exchange == "padded":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")  # any host sync in the padded forward raises
                    try:
                        again = layer(x, tw, ids)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    assert torch.equal(again, got)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        out = layer(x, tw, ids)
                    x.copy_(torch.randn_like(x))
                    g.replay()
                    torch.cuda.synchronize()
                    assert rel_err(out.float(), whole(x, tw, ids).float()) < 1e-2
        result[rank] = "ok"
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_matches_one_gpu(tmp_path):
    result = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank, args=(GPUS, str(tmp_path / "store"), (1, 16, 256, 4096), result), nprocs=GPUS, join=True)
    skips = [v for v in result.values() if v.startswith("skip")]
    if skips:
        pytest.skip(skips[0])
    assert dict(result) == {r: "ok" for r in range(GPUS)}
