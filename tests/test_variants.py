import dataclasses

import pytest

from moe_aot.spec import make_spec
from moe_aot.variants import GemmTiles, LayerVariant, bucket_for, can_implement, candidate_space, default_variant

SPEC = make_spec("qwen3-30b-a3b")


def _kernel_names(spec, v):
    return {kv.role: kv.name for kv in v.kernels(spec)}


def test_every_compile_time_field_changes_the_names():
    base = LayerVariant(64, GemmTiles(128, 64, 3, "warp"), GemmTiles(128, 64, 4, "warp"))
    names = _kernel_names(SPEC, base)
    # Layer variant fields: each one must change the name of every kernel built with it.
    for role, t in (("glu", base.glu), ("down", base.down)):
        for f in dataclasses.fields(GemmTiles):
            other = {"tile_n": 64, "tile_k": 32, "stages": 5, "mma": "hoppp", "cluster": 2,
                     "raster_experts": True, "promote": 2, "fast_act": True}[f.name]
            v = dataclasses.replace(base, **{role: dataclasses.replace(t, **{f.name: other})})
            assert _kernel_names(SPEC, v)[role] != names[role], (role, f.name)
            assert v.name(SPEC) != base.name(SPEC)
    v = dataclasses.replace(base, tile_m=128)
    changed = _kernel_names(SPEC, v)
    assert all(changed[r] != names[r] for r in ("routing", "glu", "down"))
    v = dataclasses.replace(base, route_cluster=16)
    assert _kernel_names(SPEC, v)["routing"] != names["routing"] and v.name(SPEC) != base.name(SPEC)
    v = dataclasses.replace(base, pdl=True)  # every kernel's launch and body change
    changed = _kernel_names(SPEC, v)
    assert all(changed[r] != names[r] for r in names) and v.name(SPEC) != base.name(SPEC)
    # h's scale block (fp8): GEMM1 writes it and GEMM2 reads it, so exactly their names change
    f8 = make_spec("qwen3-30b-a3b", precision="fp8")
    b8 = LayerVariant(128, GemmTiles(256, 128, 4, "hopws"), GemmTiles(256, 128, 4, "hopws"))
    n8, c8 = _kernel_names(f8, b8), _kernel_names(f8, dataclasses.replace(b8, h_block=128))
    assert {r for r in n8 if n8[r] != c8[r]} == {"glu", "down"}
    assert dataclasses.replace(b8, h_block=128).name(f8) != b8.name(f8)
    # Spec fields baked into kernels: each changes every kernel that takes it.
    for field, value in (("experts", 64), ("top_k", 4), ("hidden", 1024), ("intermediate", 512),
                         ("activation", "geglu"), ("target", "sm_121a")):
        spec = dataclasses.replace(SPEC, **{field: value})
        other = _kernel_names(spec, base)
        for kv in base.kernels(SPEC):
            takes = {k for k, _ in kv.params}
            if field in ("experts", "top_k", "hidden", "intermediate", "activation"):
                key = {"experts": "num_experts"}.get(field, field)
                if key in takes:
                    assert other[kv.role] != kv.name, (field, kv.role)
            else:
                assert other[kv.role] != kv.name, (field, kv.role)


def _name_tokens(kv) -> dict:
    """Each constructor argument as it must appear in the kernel's name, with its neighbours,
    so that a value showing up elsewhere in the name (tile_k=64 for tile_m=64) does not count."""
    p = kv.kwargs()
    tokens = {"num_experts": f"_e{p.get('num_experts')}k", "top_k": f"k{p.get('top_k')}",
              "cluster_size": f"_c{p.get('cluster_size')}", "pdl": "_pdl" if p.get("pdl") else None,
              "interleave": f"_g{p.get('interleave')}", "stages": f"_s{p.get('stages')}_",
              "mma": f"_{p.get('mma')}", "activation": f"_{p.get('activation')}_",
              "cluster_m": f"_{p.get('mma')}_c{p.get('cluster_m')}", "h_block": f"_h{p.get('h_block')}",
              "raster_experts": "_xe" if p.get("raster_experts") else None,
              "promote_every": f"_p{p.get('promote_every')}",
              "fast_act": "_fa" if p.get("fast_act") else None,
              "precision": f"_{str(p.get('precision')).replace('-', '')}_"}
    if "hidden" in p:
        tokens["hidden"] = f"h{p['hidden']}"
    if "intermediate" in p:
        tokens["intermediate"] = f"i{p['intermediate']}"
    if "quant" in p:  # fp8's routing quantizes x: to what, and of which width
        tokens["quant"] = f"_q{p['quant'][1].replace('-', '')}h{p['quant'][0]}"
    if kv.role == "routing":
        tokens["tile_m"] = f"_m{p['tile_m']}_"
    elif "tile_n" in p:
        tokens["tile_m"] = tokens["tile_n"] = tokens["tile_k"] = f"_t{p['tile_m']}x{p['tile_n']}x{p['tile_k']}_"
    return {k: tokens[k] for k in p}


def test_name_covers_every_constructor_argument():
    # Every constructor argument value appears in the name, in its place (so equal names mean
    # equal kernels). Distinct values, so no token can be matched by another argument's value.
    v = LayerVariant(16, GemmTiles(128, 64, 3), GemmTiles(256, 32, 5), route_cluster=8, pdl=True)
    clustered = LayerVariant(128, GemmTiles(192, 64, 4, "hopws", 2), GemmTiles(256, 64, 3, "hopws", 2))
    rastered = LayerVariant(64, GemmTiles(192, 64, 5, "hoppp", raster_experts=True),
                            GemmTiles(256, 64, 4, "hoppp", raster_experts=True))
    f8 = make_spec("qwen3-30b-a3b", precision="fp8-block128")
    h128 = LayerVariant(128, GemmTiles(256, 128, 4, "hopws"), GemmTiles(256, 128, 3, "hopws"), h_block=128)
    for kv in v.kernels(SPEC) + clustered.kernels(SPEC) + rastered.kernels(SPEC) + h128.kernels(f8):
        for key, token in _name_tokens(kv).items():
            assert token is None or token in kv.name, (kv.name, key, token)
    # The check can fail: a name that lost its tile_m is caught, though "64" (the old token for
    # tile_m=64) still occurs in it through tile_k.
    glu = LayerVariant(64, GemmTiles(128, 64, 3)).kernels(SPEC)[1]
    broken = glu.name.replace("_t64x128x64_", "_t128x64_")
    assert "64" in broken and _name_tokens(glu)["tile_m"] not in broken


def test_parse_round_trip():
    space = candidate_space(SPEC)
    assert {v.pdl for v in space} == {False, True}
    clustered = [v for v in space if v.glu.cluster > 1 or v.down.cluster > 1]
    assert clustered and all(v.tile_m == 128 for v in clustered)
    for v in space[:50] + space[-50:] + clustered[:50]:
        assert LayerVariant.parse(v.name(SPEC)) == v
    with pytest.raises(ValueError):
        LayerVariant.parse("moe_layer_nonsense")


def test_can_implement_reasons():
    spark = make_spec("qwen3-30b-a3b", target="sm_121a")
    ok, why = can_implement(spark, LayerVariant(64, GemmTiles(128, 64, 3, "hopws")))
    assert not ok and "hopws" in why and "sm_121a" in why
    ok, why = can_implement(spark, LayerVariant(128, GemmTiles(256, 64, 5), GemmTiles(256, 64, 5)))
    assert not ok and "shared memory" in why
    ok, why = can_implement(make_spec("gpt-oss-120b"), LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(256, 64, 3)))
    assert not ok and "2880" in why and "256" in why
    ok, why = can_implement(SPEC, LayerVariant(64, GemmTiles(64, 64, 9)))
    assert not ok and "stages" in why
    ok, why = can_implement(spark, LayerVariant(64, GemmTiles(64, 64, 3), GemmTiles(64, 64, 3), 16))
    assert not ok and "cluster" in why and "sm_121a" in why


def test_candidate_space_is_pruned_and_defaults_valid():
    for model in ("qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b"):
        for target in ("sm_90a", "sm_121a"):
            spec = make_spec(model, target=target)
            space = candidate_space(spec)
            assert space and all(can_implement(spec, v)[0] for v in space)
            for t in (1, 16, 4096):
                assert can_implement(spec, default_variant(spec, t))[0]


def test_bucket_for_nearest_on_log_scale():
    assert bucket_for(1) == 1 and bucket_for(3) == 1 and bucket_for(5) == 16
    assert bucket_for(700) == 1024 and bucket_for(100000) == 16384


def test_variant_checks_agree_with_the_template(monkeypatch):
    """variants.gemm_can_implement and the templates' own checks are the same rules
    (moe_aot/gemm_limits.py, which the runtime can import without the DSL): a rule added to
    either side alone fails here, over every tile for both GEMMs of every preset's layer on
    two targets, for every MMA the template has (those not selectable on sm_90a made selectable)."""
    import itertools

    from moe_aot_templates.grouped_gemm import MMAS, GroupedDownGemm, GroupedGluGemm

    from moe_aot.spec import PRESETS
    from moe_aot.variants import STAGES, TARGET_LIMITS, TILE_K, TILE_M, TILE_N, gemm_can_implement

    monkeypatch.setitem(TARGET_LIMITS["sm_90a"], "mma", MMAS)
    disagree = []
    for target, model in itertools.product(("sm_90a", "sm_121a"), PRESETS):
        spec = make_spec(model, target=target)
        for m, n, k, st, mma in itertools.product(TILE_M, TILE_N, TILE_K, STAGES, MMAS):
            t = GemmTiles(n, k, st, mma)
            mine = gemm_can_implement(spec.hidden, spec.intermediate, m, t, target)[0]
            theirs = GroupedDownGemm.can_implement(spec.experts, spec.hidden, spec.intermediate, spec.top_k,
                                                   tile_m=m, tile_n=n, tile_k=k, stages=st, mma=mma,
                                                   arch=target)[0]
            if mine != theirs:
                disagree.append(("down", target, m, t))
            mine = gemm_can_implement(2 * spec.intermediate, spec.hidden, m, t, target)[0] and n % 32 == 0
            theirs = GroupedGluGemm.can_implement(spec.experts, spec.hidden, spec.intermediate, spec.top_k,
                                                  tile_m=m, tile_n=n, tile_k=k, stages=st, mma=mma,
                                                  arch=target)[0]
            if mine != theirs:
                disagree.append(("glu", target, m, t))
    assert not disagree, disagree[:10]


def test_pingpong_variants_and_twins():
    """hoppp: no clusters, per-warpgroup accumulators (a 64x256 or 128x128 tile is allowed: 128
    registers on one warpgroup, 128x256 is not), parsed back from its name; the tuner's ping-pong
    twin keeps routing and PDL, fits N and shared memory, and does not exist on sm_121a."""
    pp = LayerVariant(64, GemmTiles(256, 64, 5, "hoppp"), GemmTiles(256, 64, 5, "hoppp"), 16, True)
    assert can_implement(SPEC, pp) == (True, "ok")
    assert LayerVariant.parse(pp.name(SPEC)) == pp and "hoppp" in pp.name(SPEC)
    ok, why = can_implement(SPEC, dataclasses.replace(pp, tile_m=128))
    assert not ok and "256 fp32 accumulator registers" in why
    wide = LayerVariant(128, GemmTiles(128, 64, 6, "hoppp"), GemmTiles(128, 64, 6, "hoppp"))
    assert can_implement(SPEC, wide) == (True, "ok")
    ok, why = can_implement(SPEC, dataclasses.replace(pp, down=GemmTiles(256, 64, 6, "hoppp")))
    assert not ok and "shared memory" in why
    ok, why = can_implement(SPEC, dataclasses.replace(pp, down=GemmTiles(256, 64, 5, "hoppp", 2)))
    assert not ok and "cluster" in why
    assert pp.cluster_twins() == []
    assert any(v.glu.mma == "hoppp" for v in candidate_space(SPEC))
    hopws = LayerVariant(128, GemmTiles(192, 64, 4, "hopws"), GemmTiles(256, 64, 4, "hopws"), 16, True)
    twin = hopws.pingpong_twin(SPEC)
    assert twin == LayerVariant(64, GemmTiles(192, 64, 6, "hoppp"), GemmTiles(256, 64, 5, "hoppp"), 16, True)
    gpt = make_spec("gpt-oss-120b")  # N = 5760 and 2880: 256 does not divide them, 192 does
    twin = LayerVariant(16, GemmTiles(32, 64, 8), GemmTiles(32, 64, 8)).pingpong_twin(gpt)
    assert (twin.glu.tile_n, twin.down.tile_n, twin.glu.stages) == (192, 192, 6) and can_implement(gpt, twin)[0]
    assert hopws.pingpong_twin(make_spec("qwen3-30b-a3b", target="sm_121a")) is None


def test_name_layouts_name_every_field_and_parse_inverts_them():
    """name() and parse() are both read off GEMM_NAME / LAYER_NAME: those tables list every
    field of the dataclasses (a new field cannot be left out of the name), and every committed
    pick's name parses back to a variant whose name is the same string."""
    import json
    from pathlib import Path

    from moe_aot.variants import GEMM_NAME, LAYER_NAME

    assert sorted(f for f, _ in GEMM_NAME) == sorted(f.name for f in dataclasses.fields(GemmTiles))
    assert sorted(f for f, _ in LAYER_NAME) == sorted(f.name for f in dataclasses.fields(LayerVariant))
    tuned = Path(__file__).resolve().parents[1] / "cache" / "tuned" / "NVIDIA_H200.jsonl"
    from moe_aot.variants import BACKWARD_SUFFIX, parse_variant

    for line in tuned.read_text().splitlines():
        name = json.loads(line)["variant"]
        v = parse_variant(name)  # a backward pick ("<layer>_bwd" workload) parses to a BackwardVariant
        workload = json.loads(line)["workload"].removesuffix(BACKWARD_SUFFIX)
        # the presets in every precision they build, and gpt-oss's shape with plain SwiGLU and no
        # biases (the preset before it computed gpt-oss's own activation)
        specs = [make_spec(m, precision=p) for m in ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b",
                                                     "deepseek-v3", "mixtral-8x7b")
                 for p in ("bf16", "fp8", "fp8-block128") if m != "gpt-oss-120b" or p == "bf16"]
        specs.append(make_spec("gpt-oss-120b", activation="swiglu", bias=False))
        spec = next(s for s in specs if s.workload_key == workload)
        assert v.name(spec) == name
    assert LayerVariant.parse("x_m128r16_glun256k64s4hopwsc2_downn128k64s6hoppp_pdl") == LayerVariant(
        128, GemmTiles(256, 64, 4, "hopws", 2), GemmTiles(128, 64, 6, "hoppp"), 16, True)


def test_fast_act_only_where_the_activation_takes_a_sigmoid():
    """fast_act puts a sigmoid's reciprocal on rcp.approx: swiglu and swigluoai have one, geglu's
    tanh GELU has none, so a geglu layer's fast_act variant would be the default's kernel under
    another name. It is refused (naming why), has no twin, and is not in the tuner's space."""
    from moe_aot.tuner import search_space

    swiglu = make_spec(experts=8, top_k=2, hidden=1024, intermediate=512, activation="swiglu")
    geglu = make_spec(experts=8, top_k=2, hidden=1024, intermediate=512, activation="geglu")
    base = LayerVariant(128, GemmTiles(128, 64, 4, "hopws"), GemmTiles(128, 64, 4, "hopws"))
    fast = dataclasses.replace(base, glu=dataclasses.replace(base.glu, fast_act=True))
    assert can_implement(swiglu, base)[0] and can_implement(geglu, base)[0]
    assert can_implement(swiglu, fast)[0]
    ok, why = can_implement(geglu, fast)
    assert not ok and "fast_act" in why and "geglu" in why and "swiglu" in why
    assert base.fast_act_twin(swiglu) == fast and base.fast_act_twin(geglu) is None
    assert not any(v.glu.fast_act for v in candidate_space(geglu))
    assert any(v.glu.fast_act for v in candidate_space(swiglu))
    assert search_space(geglu)["glu_fast_act"].choices == (False,)
    assert set(search_space(swiglu)["glu_fast_act"].choices) == {False, True}
    gpt = make_spec("gpt-oss-120b")
    assert any(v.glu.fast_act for v in candidate_space(gpt))


def test_shallow_twin_only_for_128_row_cooperative_gemm1_deeper_than_three_promoting_every_k_tile():
    """LayerVariant.shallow_twin: GEMM1's ring at three stages, everything else as it was, where
    GEMM1 is a 128-row hopws tile deeper than three stages that promotes every k-tile; None for
    64-row, ping-pong or mma.sync GEMM1s, rings already three deep, and fp8's 2-k-tile promotion
    (measured slower at three stages)."""
    spec = make_spec("deepseek-v3")
    base = LayerVariant(128, GemmTiles(256, 64, 4, "hopws", fast_act=True), GemmTiles(256, 64, 4, "hopws", 2),
                        16, True)
    twin = base.shallow_twin(spec)
    assert twin == dataclasses.replace(base, glu=dataclasses.replace(base.glu, stages=3))
    assert twin.down == base.down and twin.pdl and can_implement(spec, twin)[0]
    assert twin.shallow_twin(spec) is None  # already three deep
    for m, t in ((64, GemmTiles(256, 64, 5, "hoppp")), (64, GemmTiles(128, 64, 4, "hopws")),
                 (16, GemmTiles(32, 64, 8, "warp"))):
        assert LayerVariant(m, t, t, 16).shallow_twin(spec) is None, (m, t)
    fp8 = make_spec("deepseek-v3", precision="fp8")
    p2 = LayerVariant(128, GemmTiles(256, 128, 4, "hopws", promote=2, fast_act=True), GemmTiles(256, 128, 4, "hopws"),
                      16, h_block=128)
    assert can_implement(fp8, p2)[0] and p2.shallow_twin(fp8) is None
    p1 = dataclasses.replace(p2, glu=dataclasses.replace(p2.glu, promote=1))
    assert p1.shallow_twin(fp8).glu.stages == 3
