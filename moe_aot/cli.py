"""`moe-aot`: the thin command-line layer that wires spec, compiler, database and runtime.

Every user error becomes one click.ClickException sentence; storage errors arrive as
DatabaseError and are shown as they are (they already name the database and what to do).
"""
from __future__ import annotations

import sys
import time

import click

from . import env
from .database import Database, DatabaseError
from .spec import PRESETS, TARGETS, SpecError, load_specs, make_spec
from .variants import LayerVariant, can_implement, default_variant, token_buckets

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
        for m in models:
            for name in m.split(","):
                if name.strip():
                    specs.append(make_spec(name.strip(), target=target, activation=activation, precision=precision))
        if spec_file:
            specs += load_specs(spec_file, default_target=target)
        if any(v is not None for v in (experts, top_k, hidden, intermediate)):
            specs.append(make_spec(None, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                                   activation=activation, precision=precision, target=target))
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    if not specs:
        raise click.UsageError("say which layers: --model PRESET, --spec FILE, or --experts/--top-k/--hidden/"
                               f"--intermediate (presets: {', '.join(PRESETS)})")
    return specs


def spec_options(f):
    opts = [
        click.option("--model", "models", multiple=True, help=f"Model preset(s), comma-separated: {', '.join(PRESETS)}."),
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False), help="TOML/JSON file listing layers."),
        click.option("--target", default="sm_90a", show_default=True,
                     help=f"GPU target: {', '.join(f'{k} ({v})' for k, v in TARGETS.items())}."),
        click.option("--experts", type=int), click.option("--top-k", "top_k", type=int),
        click.option("--hidden", type=int), click.option("--intermediate", type=int),
        click.option("--activation", default=None, help="swiglu (default) or geglu."),
        click.option("--precision", default=None, help="bf16 (default); fp8, fp8-block128, mxfp8, nvfp4 are not yet supported."),
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
@click.option("--tokens", default=None, help="Token-count buckets to prepare defaults for (default: 1,16,64,256,1024,4096,16384).")
@click.option("--variant", "variant_names", multiple=True, help="Compile this layer variant (a moe_layer_... name) instead of the defaults.")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel compile processes (default: CPU count).")
@click.option("--force", is_flag=True, help="Compile again even if the database has the kernel.")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def compile_cmd(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision,
                tokens, variant_names, jobs, force, db_url):
    """Compile the kernels of the given layers into the database (no GPU needed)."""
    from .compiler import compile_into

    specs = _specs(models, spec_file, target, experts, top_k, hidden, intermediate, activation, precision)
    buckets = _tokens(tokens)
    pairs = []
    for spec in specs:
        if variant_names:
            for vn in variant_names:
                try:
                    v = LayerVariant.parse(vn)
                except ValueError as exc:
                    raise click.ClickException(str(exc)) from None
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
    except DatabaseError as exc:
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
@click.option("--db", "db_url", default=None, help=DB_HELP)
def ls_cmd(model, target, failed, db_url):
    """List stored kernels, one per line, name first."""
    workload = None
    if model:
        try:
            workload = make_spec(model).workload_key
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
    db = _open(db_url, readonly=True)
    try:
        rows = db.list_artifacts(workload=workload, target=target, status="failed" if failed else None)
        for a in rows:
            size = f"{a.library_size / 1e3:.0f}KB" if a.library_size else "-"
            extra = f"  error: {a.error}" if a.status != "ok" else ""
            click.echo(f"{a.name}\t{a.role}\t{a.target}\t{a.status}\t{size}\t{a.compile_s or 0:.1f}s\t{a.workload}{extra}")
        picks = db.all_best(workload=workload, target=target)
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
            click.echo(f"library:    {len(art.library)} bytes, sha256 {art.sha256}\ncubin:      {len(art.cubin or b'')} bytes"
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
    except DatabaseError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        db.close()


@main.command("verify")
@click.option("--model", "models", multiple=True, help="Preset(s) to verify (default: all five).")
@click.option("--tokens", default="1,16,256,4096", show_default=True, help="Token counts to check.")
@click.option("--db", "db_url", default=None, help=DB_HELP)
def verify_cmd(models, tokens, db_url):
    """On a GPU: run the stored kernels against the fp32 PyTorch reference."""
    from .runtime.verify import verify_layer

    try:
        import torch
    except ImportError:
        raise click.ClickException("verify needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise click.ClickException("verify runs the kernels and needs a CUDA GPU; none is visible here")
    names = [n for m in models for n in m.split(",") if n] or list(PRESETS)
    bad = 0
    for name in names:
        try:
            spec = make_spec(name, target="sm_90a")
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
        for row in verify_layer(spec, _tokens(tokens), db_url):
            bad += not row["ok"]
            click.echo(f"{name}\ttokens={row['tokens']}\t{row['stage']}\trel_err={row['rel_err']:.2e}\t"
                       f"{'PASS' if row['ok'] else 'FAIL'}")
    if bad:
        raise click.ClickException(f"{bad} check(s) failed")


if __name__ == "__main__":
    main()
