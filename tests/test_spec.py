import dataclasses
import json
from pathlib import Path

import pytest

from moe_aot.spec import PRESETS, LayerSpec, SpecError, load_specs, make_spec

SHAPES = Path(__file__).resolve().parents[2] / "shared" / "bench" / "shapes.json"


SOURCE = Path(__file__).resolve().parents[1] / "moe_aot" / "presets_source.json"
# config.json field names per shape field, in the order the model families use them
FIELDS = {"experts": ("num_experts", "n_routed_experts", "num_local_experts"),
          "top_k": ("num_experts_per_tok", "experts_per_token"),
          "hidden": ("hidden_size",), "intermediate": ("moe_intermediate_size", "intermediate_size")}


def test_presets_are_the_published_configs_shipped_with_the_package():
    """Every preset is derived from its model's config.json fields, which ship in the package
    (moe_aot/presets_source.json), so this runs without ../shared."""
    import importlib.resources

    source = json.loads(importlib.resources.files("moe_aot").joinpath("presets_source.json").read_text())
    assert source == json.loads(SOURCE.read_text())
    assert set(source) - {"_doc"} == set(PRESETS)
    for name, entry in source.items():
        if name == "_doc":
            continue
        cfg = entry["config"]
        derived = {f: next(cfg[k] for k in keys if k in cfg) for f, keys in FIELDS.items()}
        assert cfg["hidden_act"] == "silu"  # SwiGLU experts
        # gpt-oss: the clamped SwiGLU (its config's swiglu_limit) and biases in every expert GEMM
        gpt_oss = cfg.get("model_type") == "gpt_oss"
        if gpt_oss:
            assert cfg["swiglu_limit"] == 7.0, "the kernels build gpt-oss's published limit only"
        spec = make_spec(name)
        assert (spec.experts, spec.top_k, spec.hidden, spec.intermediate, spec.activation, spec.bias) == \
            (derived["experts"], derived["top_k"], derived["hidden"], derived["intermediate"],
             "swigluoai" if gpt_oss else "swiglu", gpt_oss), name


@pytest.mark.skipif(not SHAPES.exists(), reason="benchmark matrix not beside the checkout")
def test_presets_match_benchmark_matrix():
    models = json.loads(SHAPES.read_text())["models"]
    assert set(models) == set(PRESETS)
    for name, m in models.items():
        spec = make_spec(name)
        # the matrix times gpt-oss with plain SwiGLU ("unless a spec says otherwise", its notes); the
        # preset computes the model's own clamped SwiGLU with expert biases
        activation = "swigluoai" if name == "gpt-oss-120b" and m["activation"] == "swiglu" else m["activation"]
        assert (spec.experts, spec.top_k, spec.hidden, spec.intermediate, spec.activation) == \
            (m["experts"], m["top_k"], m["hidden"], m["intermediate"], activation)


def test_preset_with_override_and_key():
    s = make_spec("qwen3-30b-a3b", activation="GeGLU", target="sm_121a")
    assert s.activation == "geglu" and s.target == "sm_121a"
    assert s.workload_key == "e128_k8_h2048_i768_geglu_bf16"


@pytest.mark.parametrize("fields, words", [
    (dict(experts=0, top_k=1, hidden=64, intermediate=64), ["experts", "positive"]),
    (dict(experts=8, top_k=-2, hidden=64, intermediate=64), ["top_k", "positive"]),
    (dict(experts=8, top_k=9, hidden=64, intermediate=64), ["top_k", "experts"]),
    (dict(experts=8, top_k=2, hidden=100, intermediate=64), ["hidden", "multiple of 64", "64", "128"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=4000), ["intermediate", "multiple of 64"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=64, activation="relu"), ["activation", "swiglu", "geglu"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=64, target="sm_89"), ["target", "sm_90a"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=64, precision="int3"), ["precision", "bf16"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=64, precision="fp8"), ["multiple of 128", "fp8"]),
    (dict(experts=8, top_k=2, hidden=128, intermediate=128, precision="mxfp4-w", target="sm_100a"),
     ["not yet supported for sm_100a"]),
    (dict(experts=8, top_k=2, hidden=128, intermediate=128, precision="mxfp8", target="sm_90a"),
     ["not yet supported for sm_90a"]),
    # sm_121a pads K to whole k-tiles (hidden 64 builds there); sm_100a's tcgen05 kernels do not
    (dict(experts=8, top_k=2, hidden=64, intermediate=128, precision="nvfp4", target="sm_100a"),
     ["hidden", "multiple of 128", "nvfp4", "sm_100a"]),
    (dict(experts=8, top_k=2, hidden=128, intermediate=128, precision="nvfp4", target="sm_100a", bias=True),
     ["expert biases", "tcgen05", "sm_121a"]),
    (dict(experts=8, top_k=2, hidden=64.0, intermediate=64), ["hidden", "integer"]),
    (dict(experts=4096, top_k=2, hidden=64, intermediate=64), ["experts", "at most"]),
    (dict(experts=8, top_k=2, hidden=64), ["missing", "intermediate"]),
    (dict(experts=8, top_k=2, hidden=64, intermediate=64, colour="red"), ["unknown field", "colour"]),
])
def test_bad_input_gets_one_sentence(fields, words):
    with pytest.raises(SpecError) as err:
        make_spec(**fields)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_unknown_model_lists_presets():
    with pytest.raises(SpecError, match="model must be one of qwen3-30b-a3b"):
        make_spec("llama-moe")


def test_spec_files(tmp_path):
    toml = tmp_path / "layers.toml"
    toml.write_text('[[layer]]\nmodel = "mixtral-8x7b"\n\n[[layer]]\nexperts = 16\ntop_k = 2\n'
                    'hidden = 1024\nintermediate = 512\nactivation = "geglu"\n')
    specs = load_specs(toml, default_target="sm_121a")
    assert [s.experts for s in specs] == [8, 16] and all(s.target == "sm_121a" for s in specs)
    js = tmp_path / "layers.json"
    js.write_text(json.dumps([{"model": "deepseek-v3"}, {"model": "gpt-oss-120b", "target": "sm_100a"}]))
    assert [s.target for s in load_specs(js)] == ["sm_90a", "sm_100a"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [{"model": "deepseek-v3"}, {"experts": 8, "top_k": 9,
                                                                       "hidden": 64, "intermediate": 64}]}))
    with pytest.raises(SpecError, match="layer 2 in .*top_k"):
        load_specs(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[[layer]\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_specs(broken)
    with pytest.raises(SpecError, match="cannot read"):
        load_specs(tmp_path / "missing.toml")


def test_spec_is_frozen():
    s = make_spec("mixtral-8x7b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.experts = 4
    assert isinstance(s, LayerSpec)
