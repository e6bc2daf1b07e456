"""GPU tests of the block-scaled quantization kernel (templates/blockscale_quant.py): compiled on a
CPU machine (`python3 tools/check_blockscale.py --build DB`), loaded from the database by the
runtime, compared byte for byte with the torch reference moe_aot.blockscale (values and scales,
every row) on fresh inputs of several distributions, outputs poisoned twice with different bytes.
Skipped without a GPU, without a database, or for a format and K whose kernel is not in it."""
from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

from moe_aot.blockscale import FORMATS  # noqa: E402
from moe_aot.harness import blockscale as H  # noqa: E402
from moe_aot.runtime import blockscale as rt  # noqa: E402
from moe_aot.runtime.library import KernelArgumentError  # noqa: E402
from moe_aot.runtime.store import KernelMissingError  # noqa: E402

DEV = torch.device("cuda")


def _launcher(store, fmt, k):
    try:
        rt.quantize_kernel(fmt, k, DEV, store)
    except KernelMissingError as exc:
        pytest.skip(f"{fmt} K={k} not in the database: {exc}")
    return lambda x, f, g, out: rt.quantize(x, f, g, out, store=store)


@pytest.mark.parametrize("fmt,k", [(f, k) for f in FORMATS for k in H.KS[f]])
@pytest.mark.parametrize("rows", [1, 37, 1000])
@pytest.mark.parametrize("dist", H.DISTRIBUTIONS)
def test_kernel_is_bit_exact_against_the_reference(store, fmt, k, rows, dist):
    quantize = _launcher(store, fmt, k)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt} {k} {rows} {dist}".encode()))
    x, gamax = H.make_input(dist, rows, k, fmt, gen)
    row = H.check(fmt, x, gamax, quantize, DEV)
    assert row["ok"], row


def test_launcher_refuses_bad_input(store):
    _launcher(store, "mxfp8", H.KS["mxfp8"][0])
    x = torch.zeros(4, H.KS["mxfp8"][0], dtype=torch.bfloat16, device=DEV)
    with pytest.raises(KernelArgumentError, match="bf16"):
        rt.quantize(x.float(), "mxfp8", store=store)
    with pytest.raises(KernelArgumentError, match="needed by nvfp4"):
        rt.quantize(x, "mxfp8", torch.ones(1, device=DEV), store=store)
    empty = rt.quantize(x[:0], "mxfp8", store=store)
    assert empty.values.shape == (0, H.KS["mxfp8"][0]) and empty.scales.shape == (0, H.KS["mxfp8"][0] // 32)
    with pytest.raises(KernelArgumentError, match="must have x's 4 rows"):
        small = rt.quantize(x[:2], "mxfp8", store=store)
        rt.quantize(x, "mxfp8", out=small, store=store)
