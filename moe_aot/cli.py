"""`moe-aot`: the thin command-line layer that wires spec, compiler, database and runtime.

Every user error becomes one click.ClickException sentence; storage errors arrive as
DatabaseError and are shown as they are (they already name the database and what to do).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from . import env
from .database import SUSTAINED_WARMUP_S, Database, DatabaseError
from .spec import PRESETS, TARGETS, SpecError, load_specs, make_spec
from .variants import DecodeVariant, LayerVariant, can_implement, default_variant, parse_variant, token_buckets

DB_HELP = "SQLAlchemy URL of the kernel database (default: $MOE_AOT_DB, else SQLite in cache/)."


def _open(url: str | None, readonly: bool = False) -> Database:
    try:
        return Database(url, readonly=readonly)
    except DatabaseError as exc:
        raise click.ClickException(str(exc)) from None


def _tokens(text: str | None) -> tuple[int, ...]:
    if not text:
        return token_buckets()
    try:
        vals = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise click.BadParameter(f"must be comma-separated positive integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"must be comma-separated positive integers, got {text!r}")
    return vals


def _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision):
    try:
        specs = []
        sizes = dict(experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate)
        names = [n.strip() for m in models for n in m.split(",") if n.strip()]
        for name in names:  # size flags beside a preset override the preset's sizes
            specs.append(make_spec(name, **sizes, target=target, activation=activation, precision=precision))
        if spec_file:
            specs += load_specs(spec_file, default_target=target)
        if not names and any(v is not None for v in sizes.values()):
            specs.append(make_spec(None, **sizes, activation=activation, precision=precision, target=target))
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    if not specs:
        raise click.UsageError("say which layers: --model PRESET, --spec FILE, or --experts/--top-k/--hidden/"
                               f"--intermediate (presets: {', '.join(PRESETS)})")
    return specs


def spec_options(f):
    opts = [
        click.option("--model", "--models", "models", multiple=True,
                     help=f"Model preset(s), comma-separated: {', '.join(PRESETS)}."),
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False), help="TOML/JSON file listing layers."),
        click.option("--target", default="sm_90a", show_default=True,
                     help=f"GPU target: {', '.join(f'{k} ({v})' for k, v in TARGETS.items())}."),
        click.option("--experts", type=int, help="Routed experts (with --model: overrides the preset's; "
                                                 "alone, with the other sizes, one layer)."),
        click.option("--top-k", "top_k", type=int, help="Experts per token (overrides --model's, as --experts)."),
        click.option("--hidden", type=int, help="Hidden size H (overrides --model's, as --experts)."),
        click.option("--intermediate", type=int, help="Intermediate size I per expert (overrides --model's)."),
        click.option("--activation", default=None,
                     help="swiglu (default), geglu or swigluoai (gpt-oss's clamped SwiGLU); expert biases "
                          "come with a preset (gpt-oss-120b) or `bias = true` in a --spec file."),
        click.option("--precision", default=None,
                     help="bf16 (default); fp8 (per-tensor weights, per-token x) and fp8-block128 "
                          "(DeepSeek-V3-style 128x128 weight blocks); on sm_90a also mxfp4-w (weight-only "
                          "MXFP4); on sm_121a (and its stand-in) also mxfp8 and nvfp4 (block-scaled)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-aot")
def main():
    """Compile, store, tune and run fused MoE kernels ahead of time."""


@main.command("compile")
@spec_options
@click.option("--tokens", default=None,
              help="Token-count buckets to prepare defaults for (default: 1,16,64,256,1024,4096,16384).")
@click.option("--variant", "variant_names", multiple=True,
              help="Compile this layer variant (a moe_layer_... name, or a moe_decode_... one-launch decode "
                   "kernel) instead of the defaults.")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel compile processes (default: CPU count).")
@click.option("--force", is_flag=True, help="Compile again even if the database has the kernel.")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def compile_cmd(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision,
                tokens, variant_names, jobs, force, db_url):
    """Compile the kernels of the given layers into the database (no GPU needed). sm_121a's
    libraries are for the DGX Spark's aarch64 host: on an x86-64 machine they link with Debian's
    gcc-aarch64-linux-gnu and the DSL's aarch64 runtime archive (fetched with pip at first use)."""
    from .compiler import HostToolchainError, compile_into

    specs = _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision)
    buckets = _tokens(tokens)
    pairs = []
    for spec in specs:
        if variant_names:
            for vn in variant_names:
                try:
                    v = DecodeVariant.parse(vn) if vn.startswith("moe_decode_") else LayerVariant.parse(vn)
                except ValueError as exc:
                    raise click.ClickException(str(exc)) from None
                if v.name(spec) != vn:
                    raise click.ClickException(
                        f"variant {vn} is not one of {spec.label()} on {spec.target}: for that layer its "
                        f"tiles are named {v.name(spec)}")
                ok, why = can_implement(spec, v)
                if not ok:
                    raise click.ClickException(f"variant {vn} cannot implement {spec.label()} on {spec.target}: {why}")
                pairs.append((spec, v))
        else:
            try:
                pairs += sorted({(spec, default_variant(spec, t)) for t in buckets}, key=lambda p: p[1].tile_m)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
    db = _open(db_url)
    t0 = time.perf_counter()
    click.echo(f"compiling kernels for {len(specs)} layer(s) on {len({s.target for s in specs})} target(s) "
               f"into {_where(db_url)}", err=True)

    def progress(res, done, total):
        status = "ok" if res.artifact else "FAILED"
        first = next((ln.strip() for ln in (res.error or "").splitlines() if ln.strip()), "")
        size = f"{len(res.artifact.library) / 1e3:.0f} KB" if res.artifact else first[:160]
        click.echo(f"[{done}/{total}] {status:6} {res.seconds:6.1f}s  {res.kernel.name}  {size}", err=True)

    try:
        results = compile_into(db, pairs, jobs=jobs, progress=progress, force=force)
    except (DatabaseError, HostToolchainError) as exc:
        raise click.ClickException(str(exc)) from None
    failed = [r for r in results if r.artifact is None]
    note = " (everything was already in the database)" if not results else ""
    click.echo(f"{len(results) - len(failed)} compiled, {len(failed)} failed{note} "
               f"in {time.perf_counter() - t0:.1f}s", err=True)
    db.close()
    if failed:
        sys.exit(1)


def _where(url):
    return url or env.default_db_url()


@main.command("ls")
@click.option("--model", default=None, help="Only this preset's layer.")
@click.option("--target", default=None, help="Only this target.")
@click.option("--failed", is_flag=True, help="Only kernels that failed to compile.")
@click.option("--gpu", default=None, help="Only tuned picks for this GPU (as torch.cuda.get_device_name() spells it).")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def ls_cmd(model, target, failed, gpu, db_url):
    """List stored kernels, one per line, name first; then the tuned picks, one per GPU and token
    bucket: `tuned  workload  target  gpu  tokens=N  variant  median`."""
    workload = None
    if model:
        try:
            workload = make_spec(model).workload_key
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
    if target is not None and target not in TARGETS:
        raise click.BadParameter(f"{target!r} is not a target; targets: {', '.join(TARGETS)}", param_hint="--target")
    db = _open(db_url, readonly=True)
    try:
        rows = db.list_artifacts(workload=workload, target=target, status="failed" if failed else None)
        for a in rows:
            size = f"{a.library_size / 1e3:.0f}KB" if a.library_size else "-"
            extra = f"  error: {a.error}" if a.status != "ok" else ""
            click.echo(f"{a.name}\t{a.role}\t{a.target}\t{a.status}\t{size}\t{a.compile_s or 0:.1f}s"
                       f"\t{a.workload}{extra}")
        picks = [] if failed else db.all_best(workload=workload, target=target, gpu=gpu)
        for b in picks:
            click.echo(f"tuned\t{b.workload}\t{b.target}\t{b.gpu}\ttokens={b.tokens}\t{b.variant}\t{b.median_us:.1f}us")
    except DatabaseError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        db.close()


@main.command("show")
@click.argument("name")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def show_cmd(name, db_url):
    """Show one stored kernel: toolchain, sizes, argument ABI, compile assumptions."""
    import json

    db = _open(db_url, readonly=True)
    try:
        rows = [a for a in db.list_artifacts() if a.name == name]
        if not rows:
            raise click.ClickException(f"no kernel named {name} in {_where(db_url)}; `moe-aot ls` lists them")
        for a in rows:
            art = db.get_artifact(a.name, a.toolchain)
            click.echo(f"name:       {art.name}\nrole:       {art.role}\nworkload:   {art.workload}\n"
                       f"target:     {art.target}\ntoolchain:  {art.toolchain}\nstatus:     {art.status}\n"
                       f"compiled:   {art.created_at} in {art.compile_s}s")
            if art.status != "ok":
                click.echo(f"error:\n{art.error}")
                continue
            m = art.meta
            click.echo(f"library:    {len(art.library)} bytes, sha256 {art.sha256}\n"
                       f"cubin:      {len(art.cubin or b'')} bytes"
                       f"\nptx isa:    {m.get('ptx_isa')}\nkernels:    {', '.join(m.get('kernels', []))}")
            click.echo("arguments:")
            for arg in m["args"]:
                if arg["kind"] == "stream":
                    click.echo("  stream")
                    continue
                shape = ",".join("?" if s is None else str(s) for s in arg["static_shape"])
                divs = [d for d in arg["shape_divisibility"] if d]
                click.echo(f"  {arg['name']}: {arg['dtype']}[{shape}] align {arg['assumed_align']}"
                           + (f" divisibility {divs}" if divs else ""))
            click.echo(f"timing:     {json.dumps(m.get('timing_s'))}")
        for line in _tuned_uses(db, name):
            click.echo(f"tuned for:  {line}")
    except DatabaseError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        db.close()


def _tuned_uses(db: Database, kernel: str) -> list[str]:
    """The tuned picks (GPU, bucket) whose layer variant launches this kernel."""
    from .spec import LayerSpec

    out, specs = [], {}
    for b in db.all_best():
        key = (b.workload, b.target)
        if key not in specs:
            wd = db.workload(b.workload)
            specs[key] = LayerSpec(**wd, target=b.target) if wd else None
        if specs[key] and kernel in {kv.name for kv in parse_variant(b.variant).kernels(specs[key])}:
            out.append(f"{b.gpu} tokens={b.tokens} ({b.median_us:.1f}us, toolchain {b.toolchain})")
    return sorted(set(out))


@main.command("verify")
@click.option("--model", "models", multiple=True, help="Preset(s) to verify (default: all five).")
@click.option("--tokens", default="1,16,256,4096", show_default=True, help="Token counts to check.")
@click.option("--precision", default=None, help="The layers' precision (default bf16).")
@click.option("--target", default=None, help="The kernels' target (default: this GPU's; on an H100/H200 "
              "also sm_121a-standin, the DGX Spark's layer built for sm_90a).")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def verify_cmd(models, tokens, precision, target, db_url):
    """On a GPU: run the stored kernels against the fp32 PyTorch reference."""
    from .harness.verify import verify_layer

    try:
        import torch
    except ImportError:
        raise click.ClickException("verify needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise click.ClickException("verify runs the kernels and needs a CUDA GPU; none is visible here")
    from .runtime.layer import device_target
    from .runtime.library import KernelArgumentError

    names = [n for m in models for n in m.split(",") if n] or list(PRESETS)
    try:
        target = target or device_target(torch.device("cuda"))
    except KernelArgumentError as exc:
        raise click.ClickException(str(exc)) from None
    bad = 0
    for name in names:
        try:
            spec = make_spec(name, target=target, precision=precision)
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
        from .runtime.store import KernelMissingError

        try:
            rows = verify_layer(spec, _tokens(tokens), db_url)
        except (KernelMissingError, KernelArgumentError, DatabaseError) as exc:
            raise click.ClickException(str(exc)) from None
        for row in rows:
            bad += not row["ok"]
            click.echo(f"{name}\ttokens={row['tokens']}\t{row['stage']}\trel_err={row['rel_err']:.2e}\t"
                       f"{'PASS' if row['ok'] else 'FAIL'}")
    if bad:
        raise click.ClickException(f"{bad} check(s) failed")


# -- tuning: tune, measure (the GPU half of tune --compile-only), export, build, report ------------

def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


def _export(db, export_dir, gpu):
    from .picks import export_tuned

    for path in export_tuned(db, Path(export_dir) if export_dir else env.tuned_dir(), gpu):
        click.echo(f"tuned picks for {gpu} written to {path}", err=True)


def _warmup(ctx, param, value):
    if value < 0:
        raise click.BadParameter(f"{value} is negative; give the seconds of untimed replays before each timing "
                                 "(0: none)")
    return value


WARMUP_HELP = ("Seconds of untimed replays before each candidate's timed ones, so that each is timed at the clock "
               "the GPU sustains under it (an H200 under a large layer runs at its power cap); 0: timed at once, as "
               "records before 2026-12-03 were. Records of different warm-ups are not compared with each other.")


def _gpu_measurer(db_url, replays, warmup_s):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise click.ClickException(
            "measuring needs a CUDA GPU and none is visible here; on a machine without one run "
            "`moe-aot tune --compile-only --gpu NAME ...`, then `moe-aot measure` on the GPU machine")
    from .measure_worker import GpuMeasurer

    return GpuMeasurer(db_url, replays=replays, warmup_s=warmup_s)


EXPORT_HELP = "Folder of the tuned picks' text export, one <GPU>.jsonl per GPU (default: cache/tuned/)."
BACKWARD_TOKENS = (1024, 4096, 16384)  # `tune --backward`'s default buckets: training batches
CONFIRM_HELP = ("Once a bucket's trials are measured, measure its fastest candidates (at most this many, within "
                "10% of the fastest) and its default again, each twice in mirrored order, and pick on the medians; "
                "0: no confirmation round (default: 3).")


def _confirm(ctx, param, value):
    if value is not None and value < 0:
        raise click.BadParameter(f"{value} is negative; give how many candidates to measure again beside the "
                                 "default, or 0 for no confirmation round")
    return value


def _tiles(text: str):
    """A LayerVariant from a variant name's tunable part (`tune --try`)."""
    from .variants import LayerVariant

    try:
        return LayerVariant.parse("_" + text.strip().lstrip("_"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a variant's tiles; write them as a variant name ends, e.g. "
                                 "m16r1_glun32k128s6warp_downn32k128s6warp", param_hint="--try") from None


@main.command("tune")
@spec_options
@click.option("--tokens", default=None,
              help="Token-count buckets, one study each (default: 1,16,64,256,1024,4096,16384).")
@click.option("--gpu", default=None, help="GPU to tune for, as torch.cuda.get_device_name() spells it "
              "(default: this machine's; required with --compile-only).")
@click.option("--trials", type=int, default=30, show_default=True,
              help="Stop once each bucket's study holds this many trials; earlier sessions count, "
                   "so a killed run resumes.")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Wall-time budget in seconds (then nothing new is asked).")
@click.option("--jobs", "-j", type=int, default=None, help="Compile processes (default: CPU count - 1).")
@click.option("--compile-only", is_flag=True, help="No GPU here: compile candidates and leave them in the database, "
              "ready for `moe-aot measure` on the GPU machine.")
@click.option("--replays", type=int, default=None, help="CUDA-graph replays per measurement (default: 100; "
              "with --backward 20).")
@click.option("--warmup", "warmup_s", type=float, default=SUSTAINED_WARMUP_S, show_default=True, callback=_warmup,
              help=WARMUP_HELP)
@click.option("--seed", type=int, default=None, help="Sampler seed.")
@click.option("--confirm", type=int, default=None, callback=_confirm,
              help=CONFIRM_HELP + " Not with --compile-only (`moe-aot measure` confirms).")
@click.option("--seed-picks", "seed_dir", default=None,
              help="With --compile-only: after each bucket's default, try first the committed pick for --gpu "
                   "(or --seed-gpu) in this folder of tuned picks (e.g. cache/tuned), then its twins and the "
                   "default's (tuner.seed_variants).")
@click.option("--seed-gpu", default=None,
              help="With --seed-picks: seed from this GPU's picks in that folder instead of --gpu's, e.g. a GPU "
                   "with no picks yet from the H200's (--seed-gpu \"NVIDIA H200\"); the studies stay --gpu's.")
@click.option("--try", "try_tiles", multiple=True,
              help="With --compile-only: try these tiles early in every bucket they can serve (after the "
                   "default and, with --seed-picks, the committed pick); a variant name's tunable part, e.g. "
                   "m16r1_glun32k128s6warp_downn32k128s6warp. Repeatable.")
@click.option("--backward", is_flag=True,
              help="Tune the fused backward instead of the forward: per bucket (default: "
                   f"{','.join(map(str, BACKWARD_TOKENS))}) its default, the variants that change one part (dH "
                   "tiles, dX tiles, the data path at 64-row routing tiles (the default's tiles, cooperative and "
                   "ping-pong), the weight gradients: torch's or compiled, with or without the TMA-store "
                   "epilogue), every GEMM torch's around the compiled GLU backward (..._dtorch_wtorch), and the "
                   "combination of the parts that beat it, each checked against fp32 and timed "
                   "over whole backwards; then a confirmation round (--confirm) and the picks. With "
                   "--compile-only: compile those candidates here.")
@click.option("--export-dir", default=None, help=EXPORT_HELP)
@click.option("--db", "db_url", default=None, help=DB_HELP)
def tune_cmd(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision, tokens, gpu,
             trials, timeout_s, jobs, compile_only, replays, warmup_s, seed, confirm, seed_dir, seed_gpu, try_tiles,
             backward, export_dir, db_url):
    """Search tile configurations with optuna per token bucket: compile in a CPU pool, measure on the
    GPU (CUDA-graph replays, median, after a check against the reference), record every trial and
    keep the best. With --compile-only, only the compiling half (see `moe-aot measure`). With
    --backward, the fused backward's variants (see the option)."""
    import os

    from . import picks, tuner

    specs = _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision)
    buckets = _tokens(tokens) if tokens or not backward else BACKWARD_TOKENS
    jobs = jobs if jobs is not None else max(1, (os.cpu_count() or 2) - 1)
    url = _where(db_url)
    _open(url).close()  # the schema and a readable error before optuna touches the URL
    if seed_gpu and not seed_dir:
        raise click.UsageError("--seed-gpu goes with --seed-picks DIR, the folder its picks are read from")
    try:
        if backward:
            _tune_backward(url, specs, buckets, gpu, compile_only, jobs, replays, warmup_s, confirm,
                           seed_dir or try_tiles, export_dir)
            return
        replays = 100 if replays is None else replays
        if compile_only:
            if not gpu:
                raise click.UsageError("--compile-only needs --gpu NAME: the GPU the candidates will be measured on "
                                       "(as torch.cuda.get_device_name() spells it, e.g. \"NVIDIA H200\")")
            seeds = None
            extra = tuple(_tiles(t) for t in try_tiles)
            if seed_dir or extra:
                from pathlib import Path

                if seed_dir and not Path(seed_dir).is_dir():
                    raise click.BadParameter(f"{seed_dir!r} is not a folder of tuned picks", param_hint="--seed-picks")
                if seed_gpu and not picks.tuned_path(Path(seed_dir), seed_gpu).exists():
                    have = sorted({r["gpu"] for r in picks.read_tuned(Path(seed_dir))})
                    raise click.BadParameter(f"{seed_dir!r} holds no picks for {seed_gpu!r}; GPUs with picks there: "
                                             f"{', '.join(map(repr, have)) or 'none'}", param_hint="--seed-gpu")
                seeds = tuner.seed_variants(Path(seed_dir) if seed_dir else None, seed_gpu or gpu, specs, buckets,
                                            extra)
            if confirm is not None:
                raise click.UsageError("--confirm goes with measuring: --compile-only measures nothing "
                                       "(`moe-aot measure --confirm K` confirms on the GPU machine)")
            n = tuner.prepare(url, specs, buckets, gpu, trials=trials, timeout_s=timeout_s, jobs=jobs, seed=seed,
                              seeds=seeds)
            click.echo(f"{n} trial(s) compiled and left ready for `moe-aot measure` on {gpu}", err=True)
            return
        if seed_dir or try_tiles:
            raise click.UsageError("--seed-picks and --try go with --compile-only")
        measurer = _gpu_measurer(url, replays, warmup_s)
        if gpu and gpu != measurer.gpu:
            raise click.ClickException(f"--gpu {gpu!r} but this machine's GPU is {measurer.gpu!r}")
        tuner.tune(url, specs, buckets, measurer, trials=trials, timeout_s=timeout_s, jobs=jobs, seed=seed,
                   confirm=picks.CONFIRM_K if confirm is None else confirm)
        with Database(url) as db:
            for spec in specs:
                click.echo(picks.format_summary(spec, measurer.gpu, picks.summary(db, spec, measurer.gpu, buckets)))
            _export(db, export_dir, measurer.gpu)
    except DatabaseError as exc:
        raise _fail(exc) from None


def _tune_backward(url, specs, buckets, gpu, compile_only, jobs, replays, warmup_s, confirm, seeded,
                   export_dir) -> None:
    from . import backward_tune, picks

    if seeded:
        raise click.UsageError("--seed-picks and --try are the forward's; --backward walks its whole candidate list")
    specs = [s for s in specs if backward_tune.candidate_kernels([s], buckets)]
    if not specs:
        raise click.UsageError("no layer given has a fused backward to tune: it is built for bf16 layers on "
                               "sm_90a (the persistent Hopper core)")
    if compile_only:
        if confirm is not None:
            raise click.UsageError("--confirm goes with measuring: --compile-only measures nothing")

        def progress(res, done, total):
            click.echo(f"[{done}/{total}] {'ok' if res.artifact else 'FAILED':6} {res.seconds:6.1f}s  "
                       f"{res.kernel.name}", err=True)
        with Database(url) as db:
            results = backward_tune.compile_candidates(db, specs, buckets, jobs, progress)
        failed = [r for r in results if r.artifact is None]
        click.echo(f"{len(results) - len(failed)} backward kernel(s) compiled, {len(failed)} failed, for "
                   f"{len(specs)} layer(s) at {len(buckets)} bucket(s); measure them with `moe-aot tune --backward` "
                   "on the GPU", err=True)
        if failed:
            sys.exit(1)
        return
    measurer = _gpu_measurer(url, 20 if replays is None else replays, warmup_s)
    if gpu and gpu != measurer.gpu:
        raise click.ClickException(f"--gpu {gpu!r} but this machine's GPU is {measurer.gpu!r}")
    try:
        n = backward_tune.tune_backward(url, specs, buckets, measurer,
                                        picks.CONFIRM_K if confirm is None else confirm)
    finally:
        # the runtime's reader closed first, so that the last connection to close (the export's)
        # folds SQLite's write-ahead log into the database file: a copy of that one file then
        # holds every record (the H200 run of 2026-12-03 lost a round's records to a copy without
        # its -wal file)
        measurer.store.db.close()
    click.echo(f"{n} backward pick(s) deployed for {measurer.gpu}", err=True)
    with Database(url) as db:
        _export(db, export_dir, measurer.gpu)


def _all_precisions(model: str) -> list:
    """The preset in every precision a spec accepts for it (a study is one workload: shape and precision)."""
    from .spec import PRECISIONS

    out = []
    for p in PRECISIONS:
        try:
            out.append(make_spec(model, precision=p))
        except SpecError:
            continue
    return out


@main.command("measure")
@click.option("--model", "models", multiple=True,
              help="Only these presets' studies (default: every study for this GPU).")
@click.option("--target", default=None, help="Only studies for this target.")
@click.option("--tokens", default=None, help="Only these token buckets.")
@click.option("--trials", type=int, default=None, help="Measure at most this many trials.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Wall-time budget in seconds.")
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Keep polling this long for new ready trials (a compiling side still at work).")
@click.option("--replays", type=int, default=100, show_default=True, help="CUDA-graph replays per measurement.")
@click.option("--warmup", "warmup_s", type=float, default=SUSTAINED_WARMUP_S, show_default=True, callback=_warmup,
              help=WARMUP_HELP)
@click.option("--confirm", type=int, default=None, callback=_confirm, help=CONFIRM_HELP)
@click.option("--devices", default=None,
              help="Measure on several GPUs of this host at once: 'all' or indices such as 0,1 (one worker "
                   "process per GPU, all on one database; with it --trials is per worker). Default: one "
                   "worker on the current GPU.")
@click.option("--export-dir", default=None, help=EXPORT_HELP)
@click.option("--db", "db_url", default=None, help=DB_HELP)
def measure_cmd(models, target, tokens, trials, timeout_s, wait_s, replays, warmup_s, confirm, devices, export_dir,
                db_url):
    """On the GPU machine (no DSL needed): measure the trials `tune --compile-only` left ready for
    this GPU, record them, tell the studies, keep the best and export them as text. Several
    processes may measure the same database at once.

    Confirmation round: once a bucket has no ready trial left, its fastest candidates (--confirm,
    within 10% of the fastest) and its default are measured again, each twice in mirrored order
    (A B C D D C B A, so drift weighs on all alike), every measurement recorded. A confirmed
    candidate is judged by the median of all its measurements and must beat the default's median
    of the same round; one line per round shows the medians and the pick. A round is due until
    the bucket's candidates have been in one, so running `measure` again runs the rounds that
    --timeout left out or a failure cut short; rounds do not count against --trials.

    Several GPUs (--devices all): one worker per GPU, each seeing only its GPU, sharing the
    studies; each ready trial, default and round is measured by one of them, and records say
    which GPU measured them (stats "device": index and UUID) under the GPU model's key, so GPUs
    of one model pool their records. Lines start with `[gpu N]`; Ctrl-C stops every worker,
    keeps what was measured and derives the picks from it. Use a PostgreSQL server on the
    host (`URL=$(tools/pg_local.sh)`, then --db "$URL"); a SQLite file works on a local disk."""
    from .measure_worker import measure
    from .picks import CONFIRM_K

    url = _where(db_url)
    _open(url).close()
    try:
        names = [n for m in models for n in m.split(",") if n]
        for n in names:
            make_spec(n)  # an unknown preset is refused here, with the list of presets
        workloads = {spec.workload_key for n in names for spec in _all_precisions(n)} or None
    except SpecError as exc:
        raise _fail(exc) from None
    if devices is not None:
        return _measure_devices(url, devices, replays, warmup_s, workloads, target, _tokens(tokens) if tokens else None,
                                trials, timeout_s, wait_s, CONFIRM_K if confirm is None else confirm, export_dir)
    measurer = _gpu_measurer(url, replays, warmup_s)
    try:
        n = measure(url, measurer, workloads, target, _tokens(tokens) if tokens else None, trials, timeout_s, wait_s,
                    confirm=CONFIRM_K if confirm is None else confirm)
        click.echo(f"{n} trial(s) measured on {measurer.gpu}", err=True)
        with Database(url) as db:
            _export(db, export_dir, measurer.gpu)
    except (LookupError, DatabaseError) as exc:
        raise _fail(exc) from None


def _measure_devices(url, devices, replays, warmup_s, workloads, target, buckets, trials, timeout_s, wait_s, confirm,
                     export_dir):
    """`measure --devices`: the GPUs named, one spawned worker each (measure_worker.measure_devices)."""
    import functools

    from .measure_worker import gpu_measurer_on, measure_devices, parse_devices

    try:
        import torch
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        visible = 0
    if visible == 0:
        raise click.ClickException("--devices measures on this machine's GPUs and none is visible here")
    try:
        chosen = parse_devices(devices, visible)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from None
    t0 = time.perf_counter()
    try:
        make = functools.partial(gpu_measurer_on, url, replays, warmup_s=warmup_s)
        counts = measure_devices(url, chosen, make, workloads, target, buckets, trials, timeout_s, wait_s, confirm)
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: every worker stopped; what was measured is recorded and the picks "
                                   "are derived from it (run the same command again to go on)") from None
    except (LookupError, RuntimeError, DatabaseError) as exc:
        raise _fail(exc) from None
    per = ", ".join(f"GPU {d}: {n}" for d, n in counts.items())
    click.echo(f"{sum(counts.values())} trial(s) measured on {len(counts)} GPUs ({per}) in "
               f"{time.perf_counter() - t0:.1f}s", err=True)
    try:
        with Database(url) as db:
            gpus = sorted({torch.cuda.get_device_name(d) for d in chosen})
            for g in gpus:
                _export(db, export_dir, g)
    except DatabaseError as exc:
        raise _fail(exc) from None


@main.command("export")
@click.option("--gpu", default=None, help="Only this GPU (default: every GPU with tuned picks).")
@click.option("--dir", "export_dir", default=None, help=EXPORT_HELP)
@click.option("--db", "db_url", default=None, help=DB_HELP)
def export_cmd(gpu, export_dir, db_url):
    """Write the tuned picks, derived from the records, as reviewable text (one JSON object per
    line, the default's record beside each pick) for the repository."""
    from .picks import export_tuned

    db = _open(db_url, readonly=True)
    out_dir = Path(export_dir) if export_dir else env.tuned_dir()
    try:
        paths = export_tuned(db, out_dir, gpu)
    except DatabaseError as exc:
        raise _fail(exc) from None
    except OSError as exc:  # a read-only or missing folder, a full disk
        raise click.ClickException(f"cannot write the tuned picks to {out_dir}: {exc.strerror or exc}; "
                                   "give --dir a writable folder") from None
    finally:
        db.close()
    if not paths:
        raise click.ClickException(f"no tuned picks{' for ' + gpu if gpu else ''} in {_where(db_url)}; "
                                   "run `moe-aot tune` or `moe-aot measure` first")
    for p in paths:
        click.echo(str(p))


@main.command("build")
@spec_options
@click.option("--tokens", default=None, help="Token-count buckets (default: 1,16,64,256,1024,4096,16384).")
@click.option("--gpu", default=None, help="Only this GPU's tuned picks (default: every GPU's).")
@click.option("--tuned-dir", default=None, help="Tuned picks as text to turn into binaries (default: cache/tuned/).")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel compile processes (default: CPU count).")
@click.option("--pdl-twins", is_flag=True,
              help="Also compile each variant's twin with programmatic dependent launch flipped "
                   "(for `tools/bench.py --pdl`, which measures both side by side).")
@click.option("--backward", is_flag=True,
              help="Also compile the kernels of training: the backward's (torch.ops.moe_aot.fused_moe under "
                   "autograd: the GLU backward; every bucket's default backward variant and the tuned backward "
                   "picks, `moe-aot tune --backward`: dH, dX, the weight-gradient GEMMs), and each "
                   "variant's GEMM1 that keeps its pre-activations for the backward (fused_moe_train); "
                   "without them those parts run in torch ops.")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def build_cmd(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision, tokens, gpu,
              tuned_dir, jobs, pdl_twins, backward, db_url):
    """Precompile everything a deployment needs: the tuned pick per bucket where the database or
    the text export has one for the target (and GPU), the default variant for every bucket.
    Idempotent: what is already in the database is not compiled again."""
    from .compiler import HostToolchainError, compile_into, toolchain_key
    from .picks import backward_build_plan, build_plan
    from .variants import backward_kernels, training_kernels, wgrad_kernels, workload_for

    specs = _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision)
    db = _open(db_url)
    t0 = time.perf_counter()
    try:
        skipped: list[dict] = []
        pairs, picks = build_plan(db, specs, _tokens(tokens), gpu, Path(tuned_dir) if tuned_dir else env.tuned_dir(),
                                  skipped)
        for e in skipped:
            click.echo(f"left out the tuned pick for {e['gpu']} tokens={e['tokens']} ({e['workload']}): it was "
                       f"measured against the default {e['default']}, which is no longer this bucket's default; "
                       "tune again to compare it with today's", err=True)
        if pdl_twins:
            pairs = list(dict.fromkeys(pairs + [(s, v.pdl_twin()) for s, v in pairs if isinstance(v, LayerVariant)]))

        def progress(res, done, total):
            status = "ok" if res.artifact else "FAILED"
            click.echo(f"[{done}/{total}] {status:6} {res.seconds:6.1f}s  {res.kernel.name}", err=True)

        extra, bwd_picks = [], []
        if backward:
            left: list[dict] = []
            extra, bwd_picks = backward_build_plan(db, specs, _tokens(tokens), gpu,
                                                   Path(tuned_dir) if tuned_dir else env.tuned_dir(), left)
            # the GLU backward (the torch-GEMM path's) and the default weight-gradient tiles (which
            # autograd.USE_WGRAD_KERNELS = True uses at any bucket) beside the buckets' variants
            extra = list(dict.fromkeys([(s, kv) for s in specs for kv in backward_kernels(s) + wgrad_kernels(s)]
                                       + extra))
            extra += list(dict.fromkeys((s, kv) for s, v in pairs for kv in training_kernels(s, v)))
            for e in left:
                click.echo(f"left out the tuned backward pick for {e['gpu']} tokens={e['tokens']} ({e['workload']}): "
                           f"it was measured against {e['default']}, no longer this bucket's default", err=True)
        results = compile_into(db, pairs, jobs=jobs, progress=progress, extra=extra)
        failed = [r for r in results if r.artifact is None]
        tools = {s.target: toolchain_key(s.target) for s in specs}
        gpus = set()
        for bwd, (spec, g, n, v, us) in [(False, p) for p in picks] + [(True, p) for p in bwd_picks]:
            # The picks point at binaries of this build's toolchain, which the runtime then finds;
            # they replace what was deployed there (each was checked against its default).
            if all(db.has_artifact(kv.name, tools[spec.target]) for kv in v.kernels(spec)):
                db.put_workload(workload_for(spec, bwd), spec.workload_dict())
                db.commit_best(workload=workload_for(spec, bwd), target=spec.target, gpu=g,
                               toolchain=tools[spec.target], tokens=n, variant=v.name(spec), median_us=us, force=True)
                gpus.add(g)
    except (ValueError, DatabaseError, HostToolchainError) as exc:
        raise _fail(exc) from None
    finally:
        db.close()
    click.echo(f"{len(results) - len(failed)} compiled, {len(failed)} failed; {len(picks)} tuned pick(s)"
               f"{f' and {len(bwd_picks)} backward pick(s)' if bwd_picks else ''}"
               f"{' for ' + ', '.join(sorted(gpus)) if gpus else ''}, defaults for every bucket; "
               f"in {time.perf_counter() - t0:.1f}s", err=True)
    if failed:
        sys.exit(1)


@main.command("report")
@spec_options
@click.option("--tokens", default=None, help="Token-count buckets (default: 1,16,64,256,1024,4096,16384).")
@click.option("--gpu", default=None, help="GPU whose records to show (default: every GPU with records).")
@click.option("--out", "out_dir", default=None, help="Folder for the PNG and HTML (default: cache/reports/).")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def report_cmd(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision, tokens, gpu,
               out_dir, db_url):
    """A picture of a tuning session: time per trial against its configuration, and the best per
    bucket against the roofline floor (PNG and HTML)."""
    try:
        from .report import render
    except ImportError:
        raise click.ClickException("report draws with matplotlib: pip install 'moe-aot[report]' "
                                   "(or pip install matplotlib)") from None
    specs = _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision)
    buckets = _tokens(tokens)
    db = _open(db_url, readonly=True)
    try:
        for spec in specs:
            gpus = [gpu] if gpu else sorted({r.gpu for r in db.records(spec.workload_key, spec.target)})
            if not gpus:
                raise click.ClickException(f"no tuning records for {spec.label()} on {spec.target} in {_where(db_url)}")
            for g in gpus:
                for path in render(db, spec, g, buckets, Path(out_dir) if out_dir else env.cache_dir() / "reports"):
                    click.echo(str(path))
    except ImportError:
        raise click.ClickException("report draws with matplotlib: pip install 'moe-aot[report]'") from None
    except DatabaseError as exc:
        raise _fail(exc) from None
    finally:
        db.close()

if __name__ == "__main__":
    main()
