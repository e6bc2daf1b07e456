"""Spec front-end: what MoE layer to build, in which precision, for which GPU.

Everything a user types arrives here first and is rejected here, with one sentence that names the
field and what is allowed, before any compiler or kernel sees it.
"""
from __future__ import annotations

import dataclasses
import json
import operator
import reprlib
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path

from .gemm_limits import (
    ACTIVATIONS,
    BIAS_PRECISIONS,
    BLOCKSCALED,
    BS_SIZE_MULTIPLE,
    BS_UMMA_SIZE_MULTIPLE,
    STANDINS,
    bs_scale_layout,
    with_standins,
)

# "mxfp4-w": weight-only MXFP4 (gpt-oss's expert weights as shipped), activations bf16
# "w4a8-mx": MXFP4 weights (gpt-oss's) times MXFP8 activations, block-scaled (sm_121a, sm_100a)
PRECISIONS = ("bf16", "fp8", "fp8-block128", "mxfp4-w", "mxfp8", "nvfp4", "w4a8-mx")
SUPPORTED_PRECISIONS = {"sm_90a": ("bf16", "fp8", "fp8-block128", "mxfp4-w"),
                        # mxfp8 / nvfp4 / w4a8-mx on sm_100a: tcgen05 block-scaled MMAs
                        # (templates/blackwell_blockscaled.py; compiled only, no Blackwell GPU was available)
                        "sm_100a": ("bf16", "fp8", "fp8-block128", "mxfp8", "nvfp4", "w4a8-mx"),
                        # mxfp8 / nvfp4 / w4a8-mx: the block-scaled mma.sync of the sm_120 family
                        # (templates/blockscaled_warp.py)
                        "sm_121a": ("bf16", "fp8", "fp8-block128", "mxfp8", "nvfp4", "w4a8-mx")}
SUPPORTED_PRECISIONS = with_standins(SUPPORTED_PRECISIONS)
FP8_SIZE_MULTIPLE = 128  # fp8: hidden/intermediate in whole 128-element k-tiles and scale blocks
TARGETS = {
    "sm_90a": "Hopper: H100 / H200",
    "sm_100a": "Blackwell datacenter: B200 / GB200",
    "sm_121a": "Blackwell desktop: DGX Spark (GB10)",
}
# gemm_limits.STANDINS: for checks and the tuning flow on another GPU, never for a deployment
TARGETS.update({t: f"stand-in: the {s.model} layer built for {s.arch} GPUs" for t, s in STANDINS.items()})
SIZE_MULTIPLE = 64  # hidden/intermediate: 16-byte aligned rows and whole 64-wide K tiles
MAX_EXPERTS = 512  # the routing kernel keeps a per-warp histogram of E+1 words in shared memory
MAX_TOP_K = 32

# Public models' MoE layers (full expert set on one GPU); sources: each model's config.json, whose
# fields ship in presets_source.json (tests/test_spec.py derives every preset from them).
PRESETS = {
    "qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, intermediate=768, activation="swiglu"),
    "qwen3-235b-a22b": dict(experts=128, top_k=8, hidden=4096, intermediate=1536, activation="swiglu"),
    # gpt-oss: clamped SwiGLU (alpha 1.702, limit 7.0) and expert biases in both GEMMs
    "gpt-oss-120b": dict(experts=128, top_k=4, hidden=2880, intermediate=2880, activation="swigluoai", bias=True),
    "deepseek-v3": dict(experts=256, top_k=8, hidden=7168, intermediate=2048, activation="swiglu"),
    "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, intermediate=14336, activation="swiglu"),
}
BENCH_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def value_class(cls=None, /, *, frozen: bool = True, order: bool = False):
    """`@dataclass(frozen=frozen, order=order)` for a class that writes its own `__init__`: the
    same fields (dataclasses.fields, replace, asdict), equality, hash, ordering, repr and
    FrozenInstanceError, without the source text a dataclass compiles for each method at import
    (1.5-2 ms per class on Python 3.11, most of the runtime's import). The `__init__` must take
    exactly the fields in order with their defaults (checked here) and set every one of them
    (tests/test_coldstart.py compares each class with the dataclass it stands for)."""
    def wrap(cls):
        init = cls.__dict__["__init__"]
        cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
        fields = dataclasses.fields(cls)
        names = tuple(f.name for f in fields)
        code = init.__code__
        defaults = tuple(f.default for f in fields if f.default is not dataclasses.MISSING)
        if code.co_varnames[1:code.co_argcount] != names or (init.__defaults__ or ()) != defaults or \
                any(f.default_factory is not dataclasses.MISSING for f in fields):
            raise TypeError(f"{cls.__name__}.__init__ must take the fields {names} with their defaults")
        params = cls.__dataclass_params__
        params.init = params.repr = params.eq = True
        params.order, params.frozen = order, frozen
        _value_methods(cls, fields, frozen, order)
        return cls
    return wrap if cls is None else wrap(cls)


def _value_methods(cls, fields, frozen: bool, order: bool) -> None:
    def getter(names):
        return operator.attrgetter(*names) if len(names) != 1 else lambda obj, n=names[0]: (getattr(obj, n),)

    key = getter([f.name for f in fields if f.compare])
    shown = [f.name for f in fields if f.repr]

    @reprlib.recursive_repr()
    def __repr__(self):
        return f"{self.__class__.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def compare(op):
        def method(self, other):
            if other.__class__ is self.__class__:
                return op(key(self), key(other))
            return NotImplemented
        return method

    methods = {"__repr__": __repr__, "__eq__": compare(operator.eq)}
    if order:
        methods.update(__lt__=compare(operator.lt), __le__=compare(operator.le), __gt__=compare(operator.gt),
                       __ge__=compare(operator.ge))
    if frozen:
        hash_key = getter([f.name for f in fields if (f.compare if f.hash is None else f.hash)])
        names = frozenset(f.name for f in fields)

        def __setattr__(self, name, value):
            if type(self) is cls or name in names:
                raise FrozenInstanceError(f"cannot assign to field {name!r}")
            super(cls, self).__setattr__(name, value)

        def __delattr__(self, name):
            if type(self) is cls or name in names:
                raise FrozenInstanceError(f"cannot delete field {name!r}")
            super(cls, self).__delattr__(name)

        methods.update(__hash__=lambda self: hash(hash_key(self)), __setattr__=__setattr__, __delattr__=__delattr__)
    else:
        methods["__hash__"] = None  # a mutable dataclass with eq is unhashable
    for name, fn in methods.items():
        if fn is not None:
            fn.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, fn)


class SpecError(ValueError):
    """Bad user input; the message is one sentence naming the field and what is allowed."""


@value_class
class LayerSpec:
    """One MoE layer: sizes, activation, precision, target (and the preset it came from)."""
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    activation: str = "swiglu"
    precision: str = "bf16"
    target: str = "sm_90a"
    model: str | None = None  # preset name, informational only (not part of the key)
    bias: bool = False  # expert biases in both GEMMs (gpt-oss): b13 [E, 2I] and b2 [E, H]

    def __init__(self, experts: int, top_k: int, hidden: int, intermediate: int, activation: str = "swiglu",
                 precision: str = "bf16", target: str = "sm_90a", model: str | None = None, bias: bool = False):
        vars(self).update(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                          activation=activation, precision=precision, target=target, model=model, bias=bias)
        _validate(self)

    @property
    def workload_key(self) -> str:
        """Database key of the layer's math: shape, activation, precision (target is separate)."""
        return (f"e{self.experts}_k{self.top_k}_h{self.hidden}_i{self.intermediate}"
                f"_{self.activation}{'_bias' if self.bias else ''}_{self.precision}")

    @property
    def precision_tag(self) -> str:
        """The precision as it appears in kernel names (C identifiers): "fp8block128" for "fp8-block128"."""
        return self.precision.replace("-", "")

    @property
    def shape_tag(self) -> str:
        """The layer's sizes in kernel names ("b" after them: the GEMMs take expert biases)."""
        return f"e{self.experts}k{self.top_k}h{self.hidden}i{self.intermediate}{'b' if self.bias else ''}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("model")
        if not self.bias:  # the field came later than the stored workloads without biases
            d.pop("bias")
        return d

    def workload_dict(self) -> dict:
        """The fields the workload key stands for (the target is keyed separately)."""
        d = self.to_dict()
        d.pop("target")
        return d

    def label(self) -> str:
        return self.model or self.workload_key


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(s: LayerSpec) -> None:
    for name in ("experts", "top_k", "hidden", "intermediate"):
        v = getattr(s, name)
        if not _is_int(v) or v <= 0:
            raise SpecError(f"{name} must be a positive integer, got {v!r}")
    if s.experts > MAX_EXPERTS:
        raise SpecError(f"experts must be at most {MAX_EXPERTS}, got {s.experts}")
    if s.top_k > s.experts:
        raise SpecError(f"top_k ({s.top_k}) must not exceed experts ({s.experts})")
    if s.top_k > MAX_TOP_K:
        raise SpecError(f"top_k must be at most {MAX_TOP_K}, got {s.top_k}")
    for name in ("hidden", "intermediate"):
        v = getattr(s, name)
        if v % SIZE_MULTIPLE:
            raise SpecError(f"{name} must be a multiple of {SIZE_MULTIPLE} (aligned rows and whole K tiles), "
                            f"got {v}; the nearest allowed values are {v - v % SIZE_MULTIPLE or SIZE_MULTIPLE} "
                            f"and {v - v % SIZE_MULTIPLE + SIZE_MULTIPLE}")
    if s.activation not in ACTIVATIONS:
        raise SpecError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {s.activation!r}")
    if not isinstance(s.bias, bool):
        raise SpecError(f"bias must be true or false, got {s.bias!r}")
    if s.target not in TARGETS:
        raise SpecError(f"target must be one of {', '.join(TARGETS)}, got {s.target!r}")
    if s.precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {s.precision!r}")
    if s.precision not in SUPPORTED_PRECISIONS[s.target]:
        raise SpecError(f"precision {s.precision!r} is not yet supported for {s.target}; "
                        f"supported: {', '.join(SUPPORTED_PRECISIONS[s.target])}")
    if s.precision.startswith("fp8"):
        for name in ("hidden", "intermediate"):
            v = getattr(s, name)
            if v % FP8_SIZE_MULTIPLE:
                raise SpecError(f"{name} must be a multiple of {FP8_SIZE_MULTIPLE} for precision {s.precision} "
                                f"(128-element k-tiles and scale blocks), got {v}; use bf16 for this layer")
    if s.precision in BLOCKSCALED:
        # the sm_120 family's mma.sync kernels pad K to whole k-tiles (gemm_limits.bs_padded_k);
        # sm_100a's tcgen05 kernels do not
        tcgen05 = bs_scale_layout(s.target) == "tcgen05"
        multiple = BS_UMMA_SIZE_MULTIPLE if tcgen05 else BS_SIZE_MULTIPLE
        why = "128-element k-tiles, no padding on tcgen05" if tcgen05 else "whole 32-element scale blocks"
        for name in ("hidden", "intermediate"):
            v = getattr(s, name)
            if v % multiple:
                raise SpecError(f"{name} must be a multiple of {multiple} for precision {s.precision} on {s.target} "
                                f"({why}), got {v}; use bf16 for this layer")
        if s.bias and tcgen05:
            raise SpecError(f"expert biases (bias=true) are not built for the {s.precision} tcgen05 kernels of "
                            f"{s.target}; the sm_121a kernels have them")
    if s.bias and s.precision not in BIAS_PRECISIONS:
        raise SpecError(f"expert biases (bias=true) are built for precision {', '.join(BIAS_PRECISIONS)} only, "
                        f"not {s.precision}")


_FIELDS = {"experts", "top_k", "hidden", "intermediate", "activation", "precision", "target", "model", "bias"}


def make_spec(model: str | None = None, **fields) -> LayerSpec:
    """A spec from a preset name, explicit fields, or a preset with fields overriding it."""
    unknown = set(fields) - _FIELDS
    if unknown:
        raise SpecError(f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_FIELDS))}")
    fields = {k: v for k, v in fields.items() if v is not None}
    base: dict = {}
    if model is not None:
        if model not in PRESETS:
            raise SpecError(f"model must be one of {', '.join(PRESETS)}, got {model!r}")
        base = dict(PRESETS[model], model=model)
    merged = {**base, **fields}
    missing = [f for f in ("experts", "top_k", "hidden", "intermediate") if f not in merged]
    if missing:
        raise SpecError(f"missing {', '.join(missing)}: give a --model preset ({', '.join(PRESETS)}) "
                        "or every layer size")
    if isinstance(merged.get("activation"), str):
        merged["activation"] = merged["activation"].lower()
    if isinstance(merged.get("precision"), str):
        merged["precision"] = merged["precision"].lower()
    return LayerSpec(**merged)


def load_specs(path: str | Path, default_target: str | None = None) -> list[LayerSpec]:
    """Layers from a TOML or JSON file: a list of tables under `layer` (or a top-level JSON list),
    each a preset `model` and/or explicit fields."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read spec file {path}: {exc.strerror}") from None
    import tomllib  # here, not at import time: the runtime never reads TOML

    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise SpecError(f"spec file {path} is not valid {kind}: {exc}") from None
    layers = (data if isinstance(data, list)
              else data.get("layer", data.get("layers")) if isinstance(data, dict) else None)
    if not isinstance(layers, list) or not layers:
        raise SpecError(f"spec file {path} must list layers: [[layer]] tables in TOML or a JSON list / "
                        "{\"layers\": [...]}")
    specs = []
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            raise SpecError(f"layer {i + 1} in {path} must be a table of fields, got {type(entry).__name__}")
        entry = dict(entry)
        if default_target and "target" not in entry:
            entry["target"] = default_target
        try:
            specs.append(make_spec(**entry))
        except SpecError as exc:
            raise SpecError(f"layer {i + 1} in {path}: {exc}") from None
        except TypeError as exc:
            raise SpecError(f"layer {i + 1} in {path}: {exc}") from None
    return specs
