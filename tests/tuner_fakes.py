"""Stand-ins for the tuner's two expensive halves, importable by spawned worker processes:
a compiler that stores placeholder artifacts in a blink, and a measurer whose time is a
deterministic function of the variant's tiles (so the best pick is known in advance)."""
from __future__ import annotations

import math
import time

from moe_aot.database import Database
from moe_aot.tuner import Compiled, Outcome

GPU = "Fake GPU 80GB"


def toolchain(target: str) -> str:
    return f"fake-dsl|cu13.0|{target}|x86-64|fmt1|srcfake"


def fake_compile(db_url, spec, variant) -> Compiled:
    tc = toolchain(spec.target)
    with Database(db_url) as db:
        db.put_workload(spec.workload_key, spec.workload_dict())
        for kv in variant.kernels(spec):
            if not db.has_artifact(kv.name, tc):
                db.put_artifact(name=kv.name, workload=spec.workload_key, role=kv.role, target=spec.target,
                                toolchain=tc, status="ok", library=b"fake:" + kv.name.encode(), meta={})
    # Like the real templates, some tile shapes fail to compile (here: wgmma with 32-wide K).
    bad = [g for g in (variant.glu, variant.down) if g.mma == "wgmma" and g.tile_k == 32]
    return Compiled(tc, "wgmma needs tile_k 64" if bad else None, 0.01)


def fake_time_us(spec, variant, tokens: int) -> float:
    g, d = variant.glu, variant.down
    return (5.0 + tokens / 64 + abs(math.log2(variant.tile_m) - (6 if tokens < 256 else 7)) * 3
            + abs(math.log2(g.tile_n) - 7) * 2 + abs(math.log2(d.tile_n) - 7) * 1.5
            + abs(g.stages - 4) * 0.7 + abs(d.stages - 4) * 0.3 + (g.tile_k == 32) * 0.9
            + (d.tile_k == 32) * 0.4 + (g.mma == "wgmma") * -0.5 + math.log2(variant.route_cluster) * 0.05)


class FakeMeasurer:
    gpu = GPU
    driver = "999.0 (CUDA 13.0)"

    def __init__(self, gpu: str = GPU, delay_s: float = 0.0):
        self.gpu = gpu
        self.delay_s = delay_s

    def __call__(self, spec, variant, tokens) -> Outcome:
        time.sleep(self.delay_s)
        if variant.tile_m == 128 and variant.down.tile_n == 256 and variant.down.stages == 5:
            return Outcome("resource_error", error="too many resources requested for launch")
        if variant.glu.tile_n == 64 and variant.down.tile_n == 64 and variant.tile_m == 128:
            return Outcome("wrong_result", rel_err=0.5, error="relative error 0.5")
        t = fake_time_us(spec, variant, tokens)
        return Outcome("ok", median_us=t, stats={"median_us": t, "min_us": t * 0.98, "replays": 100},
                       rel_err=3e-3)
