#!/usr/bin/env python3
"""Check and time the backward's weight-gradient GEMMs (templates/hopper_wgrad.py) on a GPU,
beside torch._grouped_mm on the same operands as moe_backward's gmm_k calls it.

  python3 tools/check_wgrad.py --compile DIR [-j N] [--models a,b] [--configs C]
      (CPU, needs the DSL) the dW13 and dW2 kernels of each model (variants.wgrad_kernels, what
      `moe-aot build --backward` builds) into DIR/wgrad.sqlite; prints its size
  python3 tools/check_wgrad.py --run DIR --out OUT [--tokens 4096,16384] [--iters N] [--models a,b] [--configs C]
      (GPU, torch + moe_aot only) per model and token count, a realistic random routing (top-k of
      Gaussian logits plus a per-expert bias, so experts are unevenly loaded) in the forward's
      routing layout (tile_m 128): fresh random operands (padding rows zero), our kernels into
      NaN-poisoned outputs, every expert against an fp32 reference, then cold-L2 times (CUDA events,
      median of N, a 512 MB clear before each launch) of ours and of torch._grouped_mm over the
      unpadded stable sort of pairs (integrations.autograd.route's order) with its token gather by
      index_select, timed with and without the gather; writes OUT/check_wgrad.json and .md, exits
      1 on any failed check.

  --configs: the tile configurations compared side by side on the same operands, ';'-separated:
  "default" (what the build builds) or "b=TMxTNsS[pp][ts],a=..." (dW13's tiles, dW2's; pp:
  ping-pong; ts: the epilogue stored by TMA from shared memory), e.g.
  "default;b=64x256s5pp,a=64x256s5pp". Default: "default". A configuration a model's sizes do not
  divide is skipped for that model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO.parent))
from kernel_timing import cold_l2_timer  # noqa: E402

DB_NAME = "wgrad.sqlite"
MODELS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"]
TILE_M = 128  # the routing's tile_m (the persistent forward GEMMs' at these token counts)
TOL = 1e-2


def parse_configs(text: str) -> dict:
    """--configs: {name: None (the default tiles) or {gather: (tile_m, tile_n, stages, pingpong)}}."""
    import re

    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        if part == "default":
            out[part] = None
            continue
        tiles = {}
        for item in part.split(","):
            m = re.fullmatch(r"([ab])=(\d+)x(\d+)s(\d+)(pp)?(ts)?", item.strip())
            if not m:
                raise SystemExit(f"--configs: {item!r} is not GATHER=TMxTNsS[pp][ts] with GATHER a or b "
                                 "(e.g. b=64x256s6pp)")
            tiles[m[1]] = (int(m[2]), int(m[3]), int(m[4]), bool(m[5]), bool(m[6]))
        out[part] = tiles
    return out


def config_kernels(spec, configs: dict) -> dict:
    """{config name: [dW13 variant, dW2 variant]} of one model; a configuration whose tiles this
    model's sizes refuse is left out (and said so)."""
    from moe_aot.variants import wgrad_kernels

    out = {}
    for name, tiles in configs.items():
        try:
            out[name] = wgrad_kernels(spec, tiles)
        except ValueError as exc:
            print(f"skipped: {exc}", flush=True)
    return out


def compile_db(folder: Path, jobs: int, models, configs: dict) -> int:
    from moe_aot.compiler import compile_into
    from moe_aot.database import Database
    from moe_aot.spec import make_spec

    folder.mkdir(parents=True, exist_ok=True)
    extra, seen = [], set()
    for m in models:
        spec = make_spec(m, target="sm_90a")
        for kvs in config_kernels(spec, configs).values():
            for kv in kvs:
                if kv.name not in seen:
                    seen.add(kv.name)
                    extra.append((spec, kv))

    def progress(res, i, n):
        status = "ok    " if res.error is None else "FAILED"
        print(f"{status} {i}/{n} {res.seconds:6.1f}s {res.kernel.name}" + (f": {res.error}" if res.error else ""),
              flush=True)

    with Database(f"sqlite:///{folder / DB_NAME}") as db:
        results = compile_into(db, [], jobs=jobs, progress=progress, extra=extra)
    failed = [r for r in results if r.error]
    size = (folder / DB_NAME).stat().st_size
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed; {folder / DB_NAME}: {size / 2**20:.2f} MiB",
          flush=True)
    return 1 if failed else 0


def realistic_routing(tokens, E, K, gen, dev):
    import torch

    bias = torch.randn(E, device=dev, generator=gen) * 0.5  # some experts more popular than others
    logits = torch.randn(tokens, E, device=dev, generator=gen) + bias
    return torch.topk(logits, K, dim=1).indices.to(torch.int32)


def run_one(spec, tokens, gen, timed, configs: dict):
    """One model and token count: every configuration's kernels ({name: (dW13, dW2)}) checked and
    timed on the same operands (torch's times, measured once, in every row)."""
    import torch

    from moe_aot.harness.reference import routing_reference
    from moe_aot.runtime.wgrad import weight_gradients

    dev = torch.device("cuda")
    E, K, H, I = spec.experts, spec.top_k, spec.hidden, spec.intermediate
    ids = realistic_routing(tokens, E, K, gen, dev)
    counts, offsets, sorted_ids, _ = routing_reference(ids, E, TILE_M)
    R, P = sorted_ids.numel(), tokens * K
    live = (sorted_ids >= 0).unsqueeze(1)
    da = torch.where(live, torch.randn(R, 2 * I, device=dev, generator=gen), 0.0).bfloat16()
    hw = torch.where(live, torch.randn(R, I, device=dev, generator=gen), 0.0).bfloat16()
    x = torch.randn(tokens, H, device=dev, generator=gen).bfloat16()
    d_out = torch.randn(tokens, H, device=dev, generator=gen).bfloat16()
    dw13 = torch.full((E, 2 * I, H), float("nan"), dtype=torch.bfloat16, device=dev)
    dw2 = torch.full((E, H, I), float("nan"), dtype=torch.bfloat16, device=dev)

    # torch, as moe_backward calls it: the pairs unpadded in the same order, offsets of their ends
    rows = (sorted_ids >= 0).nonzero().squeeze(1)
    tok = sorted_ids[rows].long() // K
    da_u, hw_u = da[rows].contiguous(), hw[rows].contiguous()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs, ds = x.index_select(0, tok), d_out.index_select(0, tok)

    def torch13():
        return torch._grouped_mm(da_u.t(), x.index_select(0, tok), offs=offs)

    def torch2():
        return torch._grouped_mm(d_out.index_select(0, tok).t(), hw_u, offs=offs)

    t13, t2 = torch13(), torch2()
    torch.cuda.synchronize()
    off = offsets.tolist()
    tall = (sorted_ids >= 0).long()
    tok_all = torch.where(tall.bool(), sorted_ids.long() // K, 0)
    def reference(e):
        """Expert e's (dW13, dW2) in fp32."""
        lo, hi = off[e], off[e + 1]
        xe = torch.where(live[lo:hi], x.index_select(0, tok_all[lo:hi]).float(), 0.0)
        de = torch.where(live[lo:hi], d_out.index_select(0, tok_all[lo:hi]).float(), 0.0)
        return da[lo:hi].float().t() @ xe, de.t() @ hw[lo:hi].float()

    def errors(pairs):
        """{key: [worst expert, sum of squared errors, of squared reference]} over every expert
        with rows; (empty experts all zero, any NaN)."""
        err = {key: [0.0, 0.0, 0.0] for key, _ in pairs}
        empty_ok, nan = True, False
        for e in range(E):
            lo, hi = off[e], off[e + 1]
            if hi == lo:
                for key, (g13, g2) in pairs:
                    if key.startswith("torch"):
                        continue
                    empty_ok &= not bool(g13[e].any()) and not bool(g2[e].any())
                continue
            ref13, ref2 = reference(e)
            for key, (g13, g2) in pairs:
                for which, got, ref in (("13", g13[e], ref13), ("2", g2[e], ref2)):
                    nan |= bool(torch.isnan(got).any())
                    d2, r2 = (got.float() - ref).square().sum().item(), ref.square().sum().item()
                    slot = err.setdefault(key + which, [0.0, 0.0, 0.0])
                    slot[0] = max(slot[0], (d2 / r2) ** 0.5 if r2 > 0 else float(d2 > 0))
                    slot[1] += d2
                    slot[2] += r2
        return {k: {"worst_expert": v[0], "all": (v[1] / v[2]) ** 0.5 if v[2] else 0.0}
                for k, v in err.items() if v[2] or v[1]}, empty_ok, nan

    terr, _, tnan = errors([("torch_dw", (t13, t2))])
    del t13, t2
    flops = {"dw13": 2.0 * P * 2 * I * H, "dw2": 2.0 * P * H * I}
    torch_us = {
        "torch_dw13_gather": timed(torch13),
        "torch_dw2_gather": timed(torch2),
        "torch_dw13": timed(lambda: torch._grouped_mm(da_u.t(), xs, offs=offs)),
        "torch_dw2": timed(lambda: torch._grouped_mm(ds.t(), hw_u, offs=offs)),
    }
    rows_out = []
    for name, kernels in configs.items():
        dw13.fill_(float("nan"))
        dw2.fill_(float("nan"))
        t0 = time.time()
        weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts, K, TILE_M, kernels, dw13, dw2)
        torch.cuda.synchronize()  # a kernel that never ends shows here, by name
        print(f"  {name}: first launch done in {time.time() - t0:.2f} s", flush=True)
        err, empty_ok, nan = errors([("dw", (dw13, dw2))])
        again13, again2 = torch.empty_like(dw13), torch.empty_like(dw2)
        weight_gradients(da, x, d_out, hw, sorted_ids, offsets, counts, K, TILE_M, kernels, again13, again2)
        repeatable = bool(torch.equal(again13, dw13) and torch.equal(again2, dw2))
        del again13, again2
        k13, k2 = kernels
        us = {"ours_dw13": timed(lambda: k13(da, x, sorted_ids, offsets, counts, dw13)),
              "ours_dw2": timed(lambda: k2(d_out, hw, sorted_ids, offsets, counts, dw2))}
        us.update(torch_us)
        errs = {"dw13": err["dw13"], "dw2": err["dw2"], "torch_dw13": terr["torch_dw13"],
                "torch_dw2": terr["torch_dw2"]}
        ok = (not nan and empty_ok and repeatable and errs["dw13"]["worst_expert"] <= TOL
              and errs["dw2"]["worst_expert"] <= TOL)
        rows_out.append({
            "model": spec.model or spec.label(), "tokens": tokens, "config": name, "pairs": P, "rows": R,
            "empty_experts": int((counts == 0).sum()), "max_rows": int(counts.max()), "min_rows": int(counts.min()),
            "kernels": [k.name for k in kernels], "rel_err": errs, "nan": nan, "torch_nan": tnan,
            "empty_zero": empty_ok, "repeatable": repeatable, "ok": ok, "us": us,
            "tflops": {k: flops[k.replace("ours_", "").replace("torch_", "").replace("_gather", "")] / v / 1e6
                       for k, v in us.items()}})
    return rows_out


def run(folder: Path, out: Path, tokens, iters: int, models, configs: dict) -> int:
    import torch

    from moe_aot.runtime.store import KernelMissingError, KernelStore
    from moe_aot.spec import make_spec

    torch.backends.cuda.matmul.allow_tf32 = False
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    store = KernelStore(f"sqlite:///{folder / DB_NAME}")
    timed = cold_l2_timer(dev, iters)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows = []
    for m in models:
        spec = make_spec(m, target="sm_90a")
        try:
            loaded = {name: tuple(store.load(kv.name, spec.target, dev.index) for kv in kvs)
                      for name, kvs in config_kernels(spec, configs).items()}
        except KernelMissingError as exc:
            print(f"{m}: weight-gradient kernels missing in {folder / DB_NAME}: {exc}", flush=True)
            rows.append({"model": m, "ok": False, "error": "kernels missing"})
            continue
        for t in tokens:
            t0 = time.time()
            got = run_one(spec, t, gen, timed, loaded)
            rows.extend(got)
            for r in got:
                u, f = r["us"], r["tflops"]
                print(f"{m:16s} {t:6d} {r['config'][:24]:24s} {'ok ' if r['ok'] else 'BAD'} "
                      f"err13 {r['rel_err']['dw13']['worst_expert']:.1e} "
                      f"err2 {r['rel_err']['dw2']['worst_expert']:.1e} | dW13 ours {u['ours_dw13']:8.1f} us "
                      f"{f['ours_dw13']:5.0f} TF/s torch {u['torch_dw13']:8.1f} ({u['torch_dw13_gather']:8.1f} w/ "
                      f"gather) | dW2 ours {u['ours_dw2']:8.1f} us {f['ours_dw2']:5.0f} TF/s torch "
                      f"{u['torch_dw2']:8.1f} ({u['torch_dw2_gather']:8.1f}) [{time.time() - t0:.0f}s]", flush=True)
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": iters, "tile_m": TILE_M,
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / "check_wgrad.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Weight-gradient GEMMs vs torch._grouped_mm ({meta['gpu']}, {meta['time']})", "",
             "Cold L2, median of {} launches; torch's time with its index_select gather in brackets; "
             "rel err: worst expert against fp32.".format(iters), "",
             "| model | tokens | config | empty experts | dW13 ours µs (TF/s) | dW13 torch µs (TF/s) "
             "| dW2 ours µs (TF/s) | dW2 torch µs (TF/s) | ours/torch (w/ gather) | rel err 13 / 2 | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['model']} | | | | | | | | | | {r['error']} |")
            continue
        u, f = r["us"], r["tflops"]
        ours, th, tg = u["ours_dw13"] + u["ours_dw2"], u["torch_dw13"] + u["torch_dw2"], \
            u["torch_dw13_gather"] + u["torch_dw2_gather"]
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['config']} | {r['empty_experts']} "
            f"| {u['ours_dw13']:.0f} ({f['ours_dw13']:.0f}) "
            f"| {u['torch_dw13']:.0f} ({f['torch_dw13']:.0f}) [{u['torch_dw13_gather']:.0f}] "
            f"| {u['ours_dw2']:.0f} ({f['ours_dw2']:.0f}) | {u['torch_dw2']:.0f} ({f['torch_dw2']:.0f}) "
            f"[{u['torch_dw2_gather']:.0f}] | {ours / th:.2f} ({ours / tg:.2f}) "
            f"| {r['rel_err']['dw13']['worst_expert']:.1e} / {r['rel_err']['dw2']['worst_expert']:.1e} "
            f"| {'yes' if r['ok'] else 'NO'} |")
    (out / "check_wgrad.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'check_wgrad.json'} and {out / 'check_wgrad.md'}", flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", type=Path, metavar="DIR")
    ap.add_argument("--run", type=Path, metavar="DIR")
    ap.add_argument("--out", type=Path, default=Path("check_wgrad_out"))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("-j", "--jobs", type=int, default=None)
    ap.add_argument("--configs", default="default")
    a = ap.parse_args()
    models = a.models.split(",")
    configs = parse_configs(a.configs)
    if a.compile:
        return compile_db(a.compile, a.jobs, models, configs)
    if a.run:
        return run(a.run, a.out, [int(t) for t in a.tokens.split(",")], a.iters, models, configs)
    ap.error("give --compile DIR (CPU) or --run DIR (GPU)")


if __name__ == "__main__":
    sys.exit(main())
