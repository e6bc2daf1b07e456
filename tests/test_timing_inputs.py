"""The timing input sets (harness.measure.input_sets): every variant of a bucket is timed on the
same x and routings, whatever was timed before, and the sets of one bucket differ from each other."""
from __future__ import annotations

import torch

from moe_aot.harness.measure import input_sets
from moe_aot.spec import LayerSpec


def test_every_variant_of_a_bucket_is_timed_on_the_same_routings():
    spec = LayerSpec(experts=64, top_k=6, hidden=256, intermediate=128)
    first = input_sets(spec, 96, "cpu")
    torch.rand(1000)  # the global generator's state must not matter
    again = input_sets(spec, 96, torch.device("cpu"))
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    # the sets differ from each other (a replay must not find the previous set's experts in L2)
    assert len({tuple(s[2].flatten().tolist()) for s in first}) == len(first)
    # each routing is a real one: top_k distinct experts per token, weights summing to one
    for x, tw, ids, out in first:
        assert x.shape == out.shape == (96, 256) and ids.shape == tw.shape == (96, 6)
        assert ids.dtype == torch.int32 and int(ids.min()) >= 0 and int(ids.max()) < 64
        assert all(len(set(row)) == 6 for row in ids.tolist())
        assert torch.allclose(tw.sum(1), torch.ones(96))


def test_other_buckets_and_layers_get_other_routings():
    spec = LayerSpec(experts=64, top_k=6, hidden=256, intermediate=128)
    base = input_sets(spec, 96, "cpu", n=1)[0][2]
    other_tokens = input_sets(spec, 97, "cpu", n=1)[0][2][:96]
    other_layer = input_sets(LayerSpec(experts=64, top_k=6, hidden=256, intermediate=256), 96, "cpu", n=1)[0][2]
    assert not torch.equal(base, other_tokens) and not torch.equal(base, other_layer)
