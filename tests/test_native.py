"""Native kernels against their pure fzero.optim twins.

Tolerance: rtol 3e-7 (about 2 float32 ulps), not bitwise, and why: the C code does
the same float32 operations in the same order as the torch path, with an FMA where
ATen's vectorised kernels use one (lerp, add with alpha). But torch itself does not
round one way: its scalar tail (the elements after the last full vector of each
chunk) is compiled with FMA contraction where the vector body is not (addcmul), and
the reverse for lerp. So whichever rule the kernel follows, some elements differ from
torch by one rounding; measured here, m and v are bitwise on torch's vector body and
the updated parameter differs on about 0.05% of elements, by 1-2 ulps.

The twin tests run twice (`kernels`): through the C kernels, and through the CUDA
kernels' source compiled for the host (`tests/_cuda_host.py`: same arithmetic, same
argument lists as a CUDA launch, checked against the kernels' prototypes), so the CUDA
arithmetic is held to the same twins on a machine without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fzero import native
from fzero.optim import (
    adagrad,
    adam,
    adamw,
    bf16_stochastic,
    lamb,
    lamb_apply_,
    lamb_direction_,
    lamb_step_hparams,
    lion,
    segment_sq_sums,
    sgd,
)

pytestmark = pytest.mark.skipif(not native.available(), reason=native.why())

SIZES = [0, 1, 15, 16, 17, 1000, 65_537]


@pytest.fixture(params=["c", "cuda_source"])
def kernels(request, monkeypatch):
    """Which kernels the wrappers call: the C build, or the CUDA source built for the host."""
    if request.param == "cuda_source":
        from tests._cuda_host import host_kernels

        monkeypatch.setattr(native, "_run", host_kernels().run)
    return request.param


def _data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def assert_near(native_p, ref_p):
    # atol: 1e-6 of the step size (lr 1e-3) for elements whose value is near zero
    torch.testing.assert_close(native_p, ref_p, rtol=3e-7, atol=1e-9)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("decoupled", "bias_correction", "grad_scale"),
    [(True, True, 1.0), (False, True, 1.0), (True, False, 0.25), (False, False, 0.5)],
)
def test_adam_matches_pure(kernels, n, threads, decoupled, bias_correction, grad_scale):
    torch.set_num_threads(threads)
    make = adamw if decoupled else adam
    opt = make(lr=1e-3, weight_decay=0.01, bias_correction=bias_correction)
    p, g = _data(n)
    ref_p, nat_p = p.clone(), p.clone()
    ref, nat = opt.init(p), opt.init(p)
    for step in range(1, 4):
        g = _data(n, seed=step)[1]
        ref = opt.update_(g * grad_scale, ref, ref_p)
        native.adam_(
            nat_p, g, nat.exp_avg, nat.exp_avg_sq, step=step, lr=1e-3, betas=(0.9, 0.999),
            eps=1e-8, weight_decay=0.01, decoupled=decoupled, bias_correction=bias_correction,
            grad_scale=grad_scale,
        )  # fmt: skip
        assert_near(nat.exp_avg, ref.exp_avg)
        assert_near(nat.exp_avg_sq, ref.exp_avg_sq)
        assert_near(nat_p, ref_p)
        nat_p.copy_(ref_p)  # compare one step at a time from equal inputs
        nat.exp_avg.copy_(ref.exp_avg)
        nat.exp_avg_sq.copy_(ref.exp_avg_sq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("skew", [0, 3])
def test_copy_out_is_the_rounded_parameter(kernels, dtype, n, skew):
    """Also into a buffer `skew` elements past a 16-byte boundary: the kernel streams the
    copy out in aligned blocks and stores the head and tail directly."""
    p, g = _data(n)
    m, v = torch.zeros(n), torch.zeros(n)
    p[:3] = torch.tensor([70000.0, -1e-8, float("inf")])[: min(3, n)]  # overflow, subnormal
    out = torch.empty(n + skew, dtype=dtype)[skew:]
    native.adam_(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, decoupled=True, out=out)  # fmt: skip
    assert torch.equal(out, p.to(dtype))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    ("momentum", "nesterov", "weight_decay"),
    [(0.0, False, 0.0), (0.9, False, 1e-2), (0.9, True, 0.0)],
)
def test_sgd_matches_pure(kernels, n, momentum, nesterov, weight_decay):
    opt = sgd(lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    p, _ = _data(n)
    ref_p, nat_p = p.clone(), p.clone()
    ref, buf = opt.init(p), torch.zeros(n)
    for step in range(3):
        g = _data(n, seed=step + 1)[1]
        ref = opt.update_(g, ref, ref_p)
        native.sgd_(nat_p, g, buf, first=step == 0, lr=0.1, momentum=momentum, dampening=0.0,
                    weight_decay=weight_decay, nesterov=nesterov)  # fmt: skip
        if momentum:
            assert_near(buf, ref.momentum_buffer)
            buf.copy_(ref.momentum_buffer)
        assert_near(nat_p, ref_p)
        nat_p.copy_(ref_p)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("lr_decay", "weight_decay", "initial", "grad_scale"),
    [(0.0, 0.0, 0.0, 1.0), (0.01, 0.01, 0.1, 1.0), (0.0, 0.01, 0.0, 0.25)],
)
def test_adagrad_matches_pure(kernels, n, threads, lr_decay, weight_decay, initial, grad_scale):
    torch.set_num_threads(threads)
    opt = adagrad(lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay,
                  initial_accumulator_value=initial)  # fmt: skip
    p, _ = _data(n)
    ref_p, nat_p = p.clone(), p.clone()
    ref, nat = opt.init(p), opt.init(p)
    for step in range(1, 4):
        g = _data(n, seed=step)[1]
        ref = opt.update_(g * grad_scale, ref, ref_p)
        native.adagrad_(
            nat_p, g, nat.sum, lr=1e-2 / (1 + (step - 1) * lr_decay), eps=1e-10,
            weight_decay=weight_decay, grad_scale=grad_scale,
        )  # fmt: skip
        assert_near(nat.sum, ref.sum)
        assert_near(nat_p, ref_p)
        nat_p.copy_(ref_p)  # compare one step at a time from equal inputs
        nat.sum.copy_(ref.sum)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("betas", "weight_decay", "grad_scale"),
    [((0.9, 0.99), 0.0, 1.0), ((0.9, 0.999), 0.1, 1.0), ((0.95, 0.98), 0.01, 0.5)],
)
def test_lion_matches_pure(kernels, n, threads, betas, weight_decay, grad_scale):
    torch.set_num_threads(threads)
    opt = lion(lr=1e-3, betas=betas, weight_decay=weight_decay)
    p, _ = _data(n)
    ref_p, nat_p = p.clone(), p.clone()
    ref, nat = opt.init(p), opt.init(p)
    for step in range(1, 4):
        g = _data(n, seed=step)[1]
        ref = opt.update_(g * grad_scale, ref, ref_p)
        native.lion_(nat_p, g, nat.exp_avg, lr=1e-3, betas=betas, weight_decay=weight_decay,
                     grad_scale=grad_scale)  # fmt: skip
        assert_near(nat.exp_avg, ref.exp_avg)
        assert_near(nat_p, ref_p)
        nat_p.copy_(ref_p)
        nat.exp_avg.copy_(ref.exp_avg)


def test_lion_sign_of_zero_and_nan_is_the_papers(kernels):
    """An exactly zero interpolation (+0 or -0) does not move its element; NaN reaches the
    parameter. torch.sign itself disagrees on -0 between its vector body and scalar tail,
    so the pure path spells the sign out (`fzero.optim.lion_sign`)."""
    n = 37
    g = torch.zeros(n)
    g[1], g[2], g[3] = -0.0, float("nan"), 1.0
    p, m = torch.ones(n), torch.zeros(n)
    m[1] = -0.0
    ref_p, ref = p.clone(), lion(lr=0.5).init(p)
    ref.exp_avg.copy_(m)
    lion(lr=0.5).update_(g, ref, ref_p)
    native.lion_(p, g, m, lr=0.5, betas=(0.9, 0.999), weight_decay=0.0)
    want = torch.ones(n)
    want[2], want[3] = float("nan"), 0.5
    assert torch.equal(ref_p.isnan(), want.isnan()) and torch.equal(p.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(ref_p[finite], want[finite]) and torch.equal(p[finite], want[finite])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adagrad_and_lion_copy_out_the_rounded_parameter(kernels, dtype):
    n = 1000
    p, g = _data(n)
    out = torch.empty(n, dtype=dtype)
    native.adagrad_(p, g, torch.zeros(n), lr=1e-2, eps=1e-10, weight_decay=0.0, out=out)
    assert torch.equal(out, p.to(dtype))
    native.lion_(p, g, torch.zeros(n), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, out=out)
    assert torch.equal(out, p.to(dtype))


@pytest.mark.parametrize("n", [1, 17, 1000])
def test_lamb_matches_pure(kernels, n):
    opt = lamb(lr=1e-2, weight_decay=0.01)
    p, g = _data(n)
    segments = [(0, n // 3), (n // 3, n)]
    ref_p, nat_p = p.clone(), p.clone()
    ref, nat = opt.init(p), opt.init(p)
    update = torch.empty(n)
    ref_update = lamb_direction_(g, ref, ref_p, opt.hparams)
    hp = opt.hparams
    native.lamb_direction_(
        nat_p, g, nat.exp_avg, nat.exp_avg_sq, update, step=1, betas=hp.betas, eps=hp.eps,
        weight_decay=0.01, bias_correction=False,  # fzero corrects in the step size
    )  # fmt: skip
    assert_near(nat.exp_avg, ref.exp_avg)
    assert_near(nat.exp_avg_sq, ref.exp_avg_sq)
    torch.testing.assert_close(update, ref_update, rtol=3e-7, atol=0)
    p_norms = segment_sq_sums(ref_p, segments).sqrt().tolist()
    u_norms = segment_sq_sums(ref_update, segments).sqrt().tolist()
    second = lamb_step_hparams(opt.hparams, ref._replace(step=1))
    lamb_apply_(ref_p, ref_update, segments, p_norms, u_norms, second)
    from fzero.optim import trust_ratio

    scales = [-second.lr * trust_ratio(a, b, second) for a, b in zip(p_norms, u_norms)]
    native.lamb_apply_(nat_p, ref_update, segments, scales)
    assert_near(nat_p, ref_p)


@pytest.mark.parametrize("n", SIZES)
def test_segment_sq_sums_match_pure(n):
    values = _data(n)[0] * 1e3
    spans = [(0, n), (0, n // 3), (n // 3, n), (n // 2, n // 2)]
    got = native.segment_sq_sums(values, spans)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, segment_sq_sums(values, spans), rtol=1e-12, atol=1e-12)
    assert native.segment_sq_sums(values, []).numel() == 0
    with pytest.raises(ValueError, match=r"segment \(0, \d+\) is outside"):
        native.segment_sq_sums(values, [(0, n + 1)])


@pytest.mark.parametrize("n", SIZES)
def test_sq_sum_and_nonfinite_flag(n):
    _, g = _data(n)
    total, bad = native.sq_sum(g)
    assert not bad
    assert total == pytest.approx(g.double().square().sum().item(), rel=1e-12, abs=1e-12)
    if n:
        g[n // 2] = float("nan")
        assert native.sq_sum(g)[1]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
def test_bf16_stochastic_matches_pure_bit_for_bit(kernels, n, seed):
    """The same random bits and carries as `fzero.optim.bf16_stochastic`; non-finite
    values round to nearest (NaN's payload aside)."""
    x = _data(n, seed=3)[0] * 1e3
    if n > 10:
        x[3], x[5], x[7], x[9] = float("inf"), -float("inf"), float("nan"), 3.3e38
    out = torch.empty(n, dtype=torch.bfloat16)
    got, want = native.bf16_stochastic_(x, out, seed), bf16_stochastic(x, seed)
    nan = torch.isnan(x)
    assert got is out and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    with pytest.raises(ValueError, match=r"out has dtype torch\.float16"):
        native.bf16_stochastic_(x, torch.empty(n, dtype=torch.float16), seed)


QUANT_SIZES = [1, 255, 256, 257, 1000, 65_537]


@pytest.mark.parametrize("n", QUANT_SIZES)
@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_int8_matches_pure_bit_for_bit(n, threads):
    """Codes and scales of `fzero.core.quantize.quantize`, ties and an all-zero block
    included; NaN gives its block a NaN scale and a 0 code (the CUDA kernel's
    block-wide max needs a block of threads: benchmarks/gpu_check.py checks it)."""
    from fzero.core.quantize import quantize

    torch.set_num_threads(threads)
    x = _data(n, seed=5)[0] * torch.logspace(-4, 3, n)
    if n > 600:
        x[256:512] = 0.0
        x[512], x[520], x[521] = 127.0, 2.5, -3.5  # scale 1: exact ties, to even
        x[700] = float("nan")
    blocks = -(-n // 256)
    codes = torch.empty(blocks * 256, dtype=torch.int8)
    scales = torch.empty(blocks)
    native.quantize_int8_(x, codes, scales)
    want_codes, want_scales = quantize(x)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.isnan(), want_scales.isnan())
    finite = ~scales.isnan()
    assert torch.equal(scales[finite], want_scales[finite])


@pytest.mark.parametrize("n", QUANT_SIZES)
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_int8_matches_pure_bit_for_bit(kernels, n, parts, dtype):
    from fzero.core.quantize import dequantize_, dequantize_mean_, quantize

    rows = [quantize(_data(n, seed=r)[0] * (r + 1)) for r in range(parts)]
    codes = torch.cat([c for c, _ in rows])
    scales = torch.cat([s for _, s in rows])
    out = torch.empty(parts * n, dtype=dtype)
    native.dequantize_int8_(codes, scales, out, parts)
    for r, (c, s) in enumerate(rows):
        want = dequantize_(torch.empty(n, dtype=dtype), c, s)
        assert torch.equal(out[r * n : (r + 1) * n].view(torch.uint8), want.view(torch.uint8))
    mean = torch.empty(n)
    native.dequantize_mean_int8_(codes, scales, mean, parts)
    assert torch.equal(mean, dequantize_mean_(torch.empty(n), codes, scales, parts))
    with pytest.raises(ValueError, match=r"expected 2 rows of whole 256-blocks"):
        native.dequantize_int8_(codes[:-1], scales, out, 2)


def _quant_input(n):
    """Values over seven decades, with (past 600 elements) an all-zero block, exact ties
    at scale 1 and a NaN."""
    x = _data(n, seed=5)[0] * torch.logspace(-4, 3, n)
    if n > 600:
        x[256:512] = 0.0
        x[512], x[520], x[521], x[522] = 7.0, 2.5, -3.5, -0.5  # scale 1: ties, to even
        x[700] = float("nan")
    return x


@pytest.mark.parametrize("n", QUANT_SIZES)
@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_int4_matches_pure_bit_for_bit(n, threads):
    """Packed int4 codes and scales of `fzero.core.quantize.quantize(bits=4)`, odd sizes
    (a last byte half padding) included; the CUDA kernel packs pairs across threads of a
    block: benchmarks/gpu_check.py checks it on a GPU."""
    from fzero.core.quantize import quantize

    torch.set_num_threads(threads)
    x = _quant_input(n)
    blocks = -(-n // 256)
    codes = torch.empty(blocks * 128, dtype=torch.uint8)
    scales = torch.empty(blocks)
    native.quantize_int4_(x, codes, scales)
    want_codes, want_scales = quantize(x, bits=4)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.isnan(), want_scales.isnan())
    finite = ~scales.isnan()
    assert torch.equal(scales[finite], want_scales[finite])
    with pytest.raises(ValueError, match=r"codes has dtype torch\.int8; expected torch\.uint8"):
        native.quantize_int4_(x, codes.view(torch.int8), scales)


@pytest.mark.parametrize("n", QUANT_SIZES)
@pytest.mark.parametrize("parts", [1, 3])
def test_dequantize_mean_int4_matches_pure_bit_for_bit(kernels, n, parts):
    from fzero.core.quantize import dequantize_mean_, quantize

    rows = [quantize(_data(n, seed=r)[0] * (r + 1), bits=4) for r in range(parts)]
    codes = torch.cat([c for c, _ in rows])
    scales = torch.cat([s for _, s in rows])
    mean = torch.empty(n)
    native.dequantize_mean_int4_(codes, scales, mean, parts)
    assert torch.equal(mean, dequantize_mean_(torch.empty(n), codes, scales, parts, bits=4))
    with pytest.raises(ValueError, match=r"expected 2 rows of whole 256-blocks of int4"):
        native.dequantize_mean_int4_(codes[:-1], scales, mean, 2)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"grad": torch.zeros(4, dtype=torch.float64)}, "grad has dtype torch.float64"),
        ({"grad": torch.zeros(8)[::2]}, "grad is not contiguous"),
        ({"exp_avg": torch.zeros(5)}, "exp_avg has 5 elements; expected 4"),
        ({"exp_avg_sq": "x"}, "exp_avg_sq must be a torch.Tensor"),
        ({"out": torch.zeros(4, dtype=torch.int32)}, "out has dtype torch.int32"),
    ],
)
def test_bad_arguments_are_named(arguments, message):
    tensors = {
        "param": torch.zeros(4),
        "grad": torch.zeros(4),
        "exp_avg": torch.zeros(4),
        "exp_avg_sq": torch.zeros(4),
    }
    tensors.update(arguments)
    out = tensors.pop("out", None)
    with pytest.raises(ValueError, match=message):
        native.adam_(*tensors.values(), step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=0.0, decoupled=True, out=out)  # fmt: skip


def test_adagrad_and_lion_name_bad_arguments():
    four = torch.zeros(4)
    with pytest.raises(ValueError, match="state_sum has 5 elements; expected 4"):
        native.adagrad_(four, four.clone(), torch.zeros(5), lr=1e-2, eps=1e-10, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"grad has dtype torch\.float16"):
        native.lion_(four, four.half(), four.clone(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    with pytest.raises(ValueError, match="exp_avg is not contiguous"):
        native.lion_(four, four.clone(), torch.zeros(8)[::2], lr=1e-3, betas=(0.9, 0.99),
                     weight_decay=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="param and state_sum overlap"):
        native.adagrad_(four, torch.zeros(4), four, lr=1e-2, eps=1e-10, weight_decay=0.0)


def test_aliasing_is_refused():
    buffer = torch.zeros(8)
    with pytest.raises(ValueError, match="param and exp_avg overlap"):
        native.adam_(buffer[:4], torch.zeros(4), buffer[2:6], torch.zeros(4), step=1, lr=1e-3,
                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=True)  # fmt: skip


def test_fzero_native_0_switches_the_kernels_off():
    code = "import fzero.native as n; print(n.available(), n.why())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "FZERO_NATIVE": "0"}, check=True)  # fmt: skip
    assert run.stdout.startswith("False") and "FZERO_NATIVE=0" in run.stdout


def test_engine_trains_the_same_with_native_kernels_on_and_off(monkeypatch):
    """Every stage, fp32 and bf16, with clipping and accumulation (the parity cases):
    losses and weights agree within the kernels' tolerance (see the module docstring)."""
    from tests._dist import run_world
    from tests.test_engine_parity import train_cases

    cases = [
        (stage, precision, 2, 0.05, "flat_even")
        for stage in range(4)
        for precision in ("fp32", "bf16")
    ]
    native_results = run_world(train_cases, 2, cases)
    monkeypatch.setenv("FZERO_NATIVE", "0")
    torch_results = run_world(train_cases, 2, cases)
    for case in cases:
        losses, state = native_results[case]
        ref_losses, ref_state = torch_results[case]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7, msg=str(case))
        for name, value in ref_state.items():
            torch.testing.assert_close(
                state[name], value, rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
            )


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_lamb_is_the_same_with_native_kernels_on_and_off(monkeypatch, stage):
    from tests._dist import run_world
    from tests.test_engine_features import lamb_config_case

    native_state, _ = run_world(lamb_config_case, 2, stage, 1)
    monkeypatch.setenv("FZERO_NATIVE", "0")
    torch_state, _ = run_world(lamb_config_case, 2, stage, 1)
    for name, value in torch_state.items():
        torch.testing.assert_close(native_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
