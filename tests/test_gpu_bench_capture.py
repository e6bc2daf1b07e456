"""GPU test of tools/bench_backward.py's capture of a training step as two CUDA graphs (the forward
with autograd recording, then its backward alone, one stream and one memory pool) and of
harness.measure.timed_units, which replays them in turn: the replayed backward's gradients are
autograd's for the inputs the forward graph last read, however often each graph was replayed.
Needs no compiled kernels (a torch function stands for the layer)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_backward as bb  # noqa: E402

from moe_aot.harness.measure import timed_units  # noqa: E402


def test_captured_forward_and_backward_replay_autograds_gradients():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(512, 1024, device="cuda", generator=gen) * 0.05).requires_grad_()
    dout = torch.randn(256, 1024, device="cuda", generator=gen)

    def fwd():
        return torch.sigmoid(x @ w) * (x @ w)  # saves its inputs and its own output

    gf, gb, kept = bb.capture_training(fwd, [x, w], dout)
    _, grads = kept
    for _ in range(2):  # new inputs in place, then the forward graph, then the backward graph twice
        with torch.no_grad():
            x.copy_(torch.randn(256, 512, device="cuda", generator=gen))
        gf.replay()
        gb.replay()
        gb.replay()  # the backward alone again: it reads what the last forward saved, accumulates nothing
        torch.cuda.synchronize()
        want = torch.autograd.grad(fwd(), [x, w], dout)
        for got, ref in zip(grads, want):
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)

    times, state = timed_units([[gf], [gb], [gf, gb]], 9, warmup_s=0.0)
    assert len(times) == 9 and state == {} and all(t > 0 for t in times)
