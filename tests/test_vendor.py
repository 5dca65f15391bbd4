"""Vendor libraries as candidates: the ``vendor`` kind, ``DLCORE_DISABLE_IMPLS``, and selection
between the vendor's library and a Triton kernel.

The cpu backend declines vendor implementations, so the selection tests run on a registry of their
own whose backend runs them on CPU tensors (torch's CPU library standing in for cuBLAS), beside a
deliberately slow Triton implementation of ``matmul`` (the real kernel, in the interpreter, after
a 20 ms sleep): the outcome does not hang on how fast the machine is.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import dlblas_kernels.kernels.ffn as ffn_kernel
import dlblas_kernels.kernels.matmul as matmul_kernel
import pytest
import torch
from dlblas_kernels import vendor
from torch.nn.attention import SDPBackend

import dlcore
from dlcore.backends.cpu import CpuBackend
from dlcore.cli import main
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import TritonImplementation, VendorImplementation
from dlcore.declarations.signature import Signature, TensorSpec
from dlcore.dispatch.dispatcher import Dispatcher, disabled_implementations
from dlcore.errors import InvalidOptionError, NoKernelError
from dlcore.plugins.discovery import PluginRecord, PluginSet, PluginStatus, PluginWarning, new_manager
from dlcore.plugins.registry import Registry, registry
from dlcore.testing import assert_close, strided_like
from dlcore.tuning.selection import How

SLOW_SECONDS = 0.02


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(len(request.node.nodeid))


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# -- the kind ----------------------------------------------------------------------------------------


def test_the_vendor_implementations_are_registered_for_matmul_and_ffn():
    for op in ("matmul", "ffn"):
        impl = next(i for i in registry().implementations_of(op) if i.kind == "vendor")
        assert isinstance(impl, VendorImplementation) and impl.name == "torch"
        assert impl.plugin == f"dlcore.kernels:vendor_{op}"
        assert impl.describe().startswith("vendor: ") and "cuBLAS" in impl.library
        # never the oracle: the op's reference stays its own
        assert registry().op(op).reference is not vendor.matmul and registry().op(op).reference is not vendor.ffn
    backends = {name for name, b in registry().backends.items() if "vendor" in b.kinds}
    assert {"cuda", "npu", "mlu"} <= backends and "cpu" not in backends


def test_the_cpu_backend_declines_vendor_implementations(gen):
    a, b = randn(gen, 5, 16), randn(gen, 16, 8)
    bound = dlcore.get_op("matmul", (a, b))
    assert bound.impl.kind != "vendor"
    assert "cpu backend does not run vendor libraries" in bound.selection.declined["torch"]
    # asked for by name, it is declined all the same, and says why
    with pytest.raises(NoKernelError, match="does not run vendor libraries"):
        dlcore.get_op("matmul", (a, b), impl="torch")


def test_the_source_hash_covers_the_module_and_the_torch_version(monkeypatch):
    same = VendorImplementation("matmul", "again", vendor.matmul, library="x")
    assert same.source_hash() == vendor.MATMUL.source_hash()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert VendorImplementation("matmul", "again", vendor.matmul, library="x").source_hash() != same.source_hash()


# -- what the vendor functions compute -------------------------------------------------------------


ACTIVATIONS = {None: lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu,
               "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["row-major", "linear-weight"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_against_the_float64_reference(gen, dtype, layout, activation, bias):
    a = strided_like(randn(gen, 3, 37, 53, dtype=dtype), "pad")  # batched, padded rows
    if layout == "row-major":
        b = randn(gen, 53, 41, dtype=dtype, scale=53**-0.5)
    else:
        b = randn(gen, 41, 53, dtype=dtype, scale=53**-0.5).T  # an nn.Linear weight's view: strides (1, K)
    c = randn(gen, 41, dtype=dtype) if bias else None
    out = vendor.matmul(a, b, c, activation)
    product = a.double() @ b.double() + (c.double() if bias else 0)
    assert_close(out, ACTIVATIONS[activation](product), dtype, reduce_dim=53)
    assert out.shape == (3, 37, 41)


def test_matmul_under_autograd_matches_the_float64_gradients(gen):
    a, b, c = randn(gen, 9, 24), randn(gen, 24, 11, scale=0.2), randn(gen, 11)
    inputs = [t.clone().requires_grad_() for t in (a, b, c)]
    grad = randn(gen, 9, 11)
    torch.autograd.backward(vendor.matmul(*inputs, "silu"), grad)
    wide = [t.double().requires_grad_() for t in (a, b, c)]
    torch.autograd.backward(torch.nn.functional.silu(wide[0] @ wide[1] + wide[2]), grad.double())
    for mine, ref in zip(inputs, wide):
        assert_close(mine.grad, ref.grad, torch.float32, reduce_dim=24)


def test_matmul_rejects_an_unknown_activation(gen):
    with pytest.raises(dlcore.InvalidInputError, match="activation"):
        vendor.matmul(randn(gen, 2, 3), randn(gen, 3, 4), None, "tanh")


def test_allow_tf32_is_scoped_to_the_call(gen, monkeypatch):
    """float32 on CUDA: torch's flag is set for the GEMM only, to what was asked, and put back,
    whatever the process had set (checked on CPU tensors: the flag is the process's)."""
    flags = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(flags, "fp32_precision") else "allow_tf32"
    seen = []
    monkeypatch.setattr(vendor, "_product", lambda a, b, bias: seen.append(getattr(flags, name)) or a @ b)
    a, b = randn(gen, 4, 8), randn(gen, 8, 4)
    default = torch.get_float32_matmul_precision()
    try:
        for process in ("highest", "high"):
            torch.set_float32_matmul_precision(process)
            before = getattr(flags, name)
            for allow in (False, True):
                vendor._product_fp32_cuda(a, b, None, allow)
                assert getattr(flags, name) == before
                assert torch.get_float32_matmul_precision() == process
            torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - reading it raises if the two APIs were mixed
    finally:
        torch.set_float32_matmul_precision(default)
    exact, tf32 = ("ieee", "tf32") if name == "fp32_precision" else (False, True)
    assert seen == [exact, tf32, exact, tf32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", ["w1-w3", "w13"])
def test_ffn_against_the_float64_reference(gen, dtype, form):
    hidden, inter = 72, 45
    x = strided_like(randn(gen, 2, 19, hidden, dtype=dtype), "pad")
    w1 = strided_like(randn(gen, inter, hidden, dtype=dtype, scale=hidden**-0.5), "transpose")
    w3 = randn(gen, inter, hidden, dtype=dtype, scale=hidden**-0.5)
    rms_w = 1 + 0.2 * randn(gen, hidden, dtype=dtype)
    if form == "w13":
        out = vendor.ffn(x, None, None, rms_w, 1e-5, torch.cat([w1, w3]))
    else:
        out = vendor.ffn(x, w1, w3, rms_w, 1e-5)
    reference = ffn_kernel.ffn_reference(*(t.double() for t in (x, w1, w3, rms_w)), 1e-5)
    assert out.is_contiguous()
    assert_close(out, reference, dtype, reduce_dim=hidden)


def test_ffn_under_autograd_matches_the_float64_gradients(gen):
    hidden, inter = 32, 20
    tensors = (randn(gen, 7, hidden), randn(gen, inter, hidden, scale=0.2), randn(gen, inter, hidden, scale=0.2),
               1 + 0.2 * randn(gen, hidden))
    grad = randn(gen, 7, inter)
    mine = [t.clone().requires_grad_() for t in tensors]
    torch.autograd.backward(vendor.ffn(*mine), grad)
    wide = [t.double().requires_grad_() for t in tensors]
    torch.autograd.backward(ffn_kernel.ffn_reference(*wide), grad.double())
    for got, ref in zip(mine, wide):
        assert_close(got.grad, ref.grad, torch.float32, reduce_dim=hidden)


# -- SDPA candidates for flash_attention_v2 ----------------------------------------------------------


H200 = DeviceProfile(backend="cuda", vendor="nvidia", name="NVIDIA H200", arch="sm_90", cores=132)
SDPA = {"sdpa_flash": vendor.SDPA_FLASH, "sdpa_cudnn": vendor.SDPA_CUDNN}


def attention_signature(dtype=torch.bfloat16, d=128, sq=8192, sk=8192, causal=False, return_lse=False,
                        device="cuda", padded=False) -> Signature:
    """A flash_attention_v2 signature as make_signature gives it (B and S rounded up to powers of two);
    ``padded``: with a ``kv_start`` (left padding)."""
    def spec(s, h):
        return TensorSpec(dtype, (2, s, h, d), "contiguous", True)

    bounds = (("kv_start", TensorSpec(torch.int32, (2,), "contiguous", True)),) if padded else ()
    return Signature("flash_attention_v2", device,
                     (("q", spec(sq, 16)), ("k", spec(sk, 8)), ("v", spec(sk, 8)), *bounds),
                     (("causal", causal), ("softmax_scale", "NoneType"), ("return_lse", return_lse)),
                     ("kv_end",) if padded else ("kv_start", "kv_end"))


@pytest.mark.parametrize("name", list(SDPA))
def test_sdpa_candidates_are_vendor_implementations_of_flash_attention(name):
    impl = SDPA[name]
    assert isinstance(impl, VendorImplementation) and impl.op == "flash_attention_v2" and impl.name == name
    assert "scaled_dot_product_attention" in impl.library
    assert getattr(vendor, f"{name}_plugin").dlcore_implementations() == [impl]
    if "flash_attention_v2" in registry().ops:  # declared by its own kernel plugin
        assert impl.name in {i.name for i in registry().implementations_of("flash_attention_v2")}


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sdpa_candidates_take_what_sdpa_runs(d, dtype):
    for causal in (False, True):
        sig = attention_signature(dtype, d, causal=causal)
        assert vendor.SDPA_FLASH.supports(sig, H200) is None and vendor.SDPA_CUDNN.supports(sig, H200) is None
    sig = attention_signature(dtype, d, sq=1, sk=65536)  # decode, not causal
    assert vendor.SDPA_CUDNN.supports(sig, H200) is None


@pytest.mark.parametrize("case, flash, cudnn", [
    ("float32", "dtype float32", "dtype float32"),
    ("return_lse", "no log-sum-exp", "no log-sum-exp"),
    ("key padding", "no key padding", "no key padding"),
    ("head dim 100", "multiples of 8", "multiples of 8"),
    ("head dim 512", "up to 256", "up to 256"),
    ("cpu", "NVIDIA GPUs from sm_80", "NVIDIA GPUs from sm_80"),
    ("sm_75", "NVIDIA GPUs from sm_80", "NVIDIA GPUs from sm_80"),
    ("amd", "NVIDIA GPUs", "NVIDIA GPUs"),
    ("causal, Sq != Sk", None, "no bottom-right causal mask"),
])
def test_sdpa_candidates_decline_what_their_backend_refuses(case, flash, cudnn):
    sig, profile = attention_signature(), H200
    if case == "float32":
        sig = attention_signature(torch.float32)
    elif case == "return_lse":
        sig = attention_signature(return_lse=True)
    elif case == "key padding":
        sig = attention_signature(padded=True)
    elif case.startswith("head dim"):
        sig = attention_signature(d=int(case.split()[-1]))
    elif case == "cpu":
        sig, profile = attention_signature(device="cpu"), CpuBackend().profile(torch.device("cpu"))
    elif case == "sm_75":
        profile = dataclasses.replace(H200, arch="sm_75")
    elif case == "amd":
        profile = dataclasses.replace(H200, vendor="amd", arch="gfx942")
    else:
        sig = attention_signature(sq=1, sk=4096, causal=True)
    for impl, expected in ((vendor.SDPA_FLASH, flash), (vendor.SDPA_CUDNN, cudnn)):
        reason = impl.supports(sig, profile)
        assert (reason is None) if expected is None else (expected in reason), (impl.name, reason)


def attention_reference(q, k, v, causal, scale=None):
    """softmax(scale q k^T) v in float64, GQA by repeating k and v, the causal mask bottom-right; a row
    that sees no key is 0."""
    q, k, v = (t.double() for t in (q, k, v))
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or q.shape[-1] ** -0.5)
    if causal:
        scores = scores.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), -float("inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1).nan_to_num(0.0), v)


@pytest.mark.parametrize("sq, sk", [(13, 13), (5, 21), (1, 17), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_attention_layout_and_masks_against_the_float64_reference(sq, sk, causal, heads, gen):
    """The BSHD views, GQA and the bottom-right mask, with SDPA's math backend standing in on the CPU
    for the flash and cuDNN kernels (the GPU run checks those)."""
    (hq, hk), d = heads, 16
    q, k, v = randn(gen, 2, sq, hq, d), randn(gen, 2, sk, hk, d), randn(gen, 2, sk, hk, d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # causal_lower_right warns of rows with no key (Sq > Sk)
        out = vendor.sdpa_attention(q, k, v, causal, None, SDPBackend.MATH)
    assert out.shape == q.shape
    assert_close(out, attention_reference(q, k, v, causal), torch.float32, reduce_dim=sk)


def test_sdpa_attention_reads_strided_views(gen):
    """q, k and v sliced out of a packed qkv projection (no copy), then a head dimension of stride 2
    (copied: SDPA's kernels read rows of stride 1); a given scale."""
    qkv = randn(gen, 2, 11, 8 + 2 + 2, 32)
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
    out = vendor.sdpa_attention(q, k, v, True, 0.3, SDPBackend.MATH)
    assert_close(out, attention_reference(q, k, v, True, 0.3), torch.float32, reduce_dim=11)
    wide = randn(gen, 2, 11, 4, 64)
    q = wide[..., ::2]
    out = vendor.sdpa_attention(q, q, q, False, None, SDPBackend.MATH)
    assert_close(out, attention_reference(q, q, q, False), torch.float32, reduce_dim=11)


@pytest.mark.parametrize("sq, sk, causal, backend", [
    (8, 8, True, "CUDNN_ATTENTION"), (1, 8, False, "CUDNN_ATTENTION"), (1, 8, True, "FLASH_ATTENTION"),
    (9, 8, True, "FLASH_ATTENTION"),
])
def test_sdpa_functions_pick_their_backend(sq, sk, causal, backend, monkeypatch, gen):
    """cuDNN has no bottom-right causal mask: a causal call with Sq != Sk goes to the flash backend
    (lengths within one bucket of the signature reach the function); the flash one is always flash."""
    seen = []
    monkeypatch.setattr(vendor, "sdpa_attention", lambda q, k, v, causal, scale, chosen: seen.append(chosen))
    q, kv = randn(gen, 1, sq, 2, 8), randn(gen, 1, sk, 2, 8)
    vendor.sdpa_cudnn(q, kv, kv, causal)
    vendor.sdpa_flash(q, kv, kv, causal)
    assert seen == [getattr(SDPBackend, backend), SDPBackend.FLASH_ATTENTION]


@pytest.mark.parametrize("fn", [vendor.sdpa_flash, vendor.sdpa_cudnn])
def test_sdpa_functions_refuse_return_lse(fn, gen):
    q = randn(gen, 1, 4, 2, 8)
    with pytest.raises(dlcore.InvalidInputError, match="return_lse"):
        fn(q, q, q, False, None, True)
    with pytest.raises(dlcore.InvalidInputError, match="kv_end"):
        fn(q, q, q, False, None, False, None, torch.tensor([3], dtype=torch.int32))


# -- DLCORE_DISABLE_IMPLS ----------------------------------------------------------------------------


def test_disable_impls_parses_op_impl_pairs():
    assert disabled_implementations("") == frozenset()
    assert disabled_implementations(" matmul:torch , ffn:triton,") == {("matmul", "torch"), ("ffn", "triton")}


@pytest.mark.parametrize("value", ["matmul", "matmul:", ":torch", "matmul:torch:x", "matmul:torch,ffn"])
def test_a_malformed_disable_impls_names_the_variable(value, monkeypatch, gen):
    with pytest.raises(InvalidOptionError, match="DLCORE_DISABLE_IMPLS=.*is not OP:IMPLEMENTATION"):
        disabled_implementations(value)
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", value)
    with pytest.raises(InvalidOptionError, match="DLCORE_DISABLE_IMPLS"):
        dlcore.get_op("rms_norm", (randn(gen, 4, 32), randn(gen, 32)))


def test_disable_impls_rejects_an_implementation_the_op_lacks(monkeypatch, gen):
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", "rms_norm:tritn,matmul:nothing")
    with pytest.raises(InvalidOptionError, match="names rms_norm:tritn, but rms_norm has no such implementation; "
                                                 "it has: reference, triton"):
        dlcore.get_op("rms_norm", (randn(gen, 4, 32), randn(gen, 32)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors: interpreter only")
def test_disable_impls_leaves_an_implementation_out(monkeypatch, gen):
    x, w = randn(gen, 4, 32), randn(gen, 32)
    dispatcher = Dispatcher()
    chosen = dispatcher.get_op("rms_norm", (x, w))
    assert chosen.impl.name == "triton"
    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", "rms_norm:triton,matmul:torch")
    fallback = dispatcher.get_op("rms_norm", (x, w))  # the memo sees the variable change
    assert fallback.impl.name == "reference" and fallback.cache_key != chosen.cache_key
    assert fallback.selection.declined["triton"] == "disabled by DLCORE_DISABLE_IMPLS"
    assert "declined  triton: disabled by DLCORE_DISABLE_IMPLS" in fallback.explain()
    # the argument wins over the environment, as tune= does over DLCORE_TUNE
    assert dispatcher.get_op("rms_norm", (x, w), impl="triton").impl.name == "triton"
    monkeypatch.delenv("DLCORE_DISABLE_IMPLS")
    assert dispatcher.get_op("rms_norm", (x, w)) is chosen


# -- selection between the vendor's library and a Triton kernel --------------------------------------


class VendorOnCpu(CpuBackend):
    """The cpu backend, except that it runs vendor implementations: torch's CPU library stands in
    for cuBLAS."""

    kinds = (*CpuBackend.kinds, "vendor")

    def accepts(self, impl, signature):
        return None if impl.kind == "vendor" else super().accepts(impl, signature)


class SelectionPlugin:
    """The test backend, the matmul op (not its Triton kernel) and a deliberately slow Triton
    implementation: the real kernel, after a sleep."""

    @dlcore.hookimpl
    def dlcore_backends(self):
        return [VendorOnCpu()]

    @dlcore.hookimpl
    def dlcore_ops(self):
        return [matmul_kernel.OP]

    @dlcore.hookimpl
    def dlcore_implementations(self):
        kernel = matmul_kernel.KERNEL.implementation

        def plan(args, config, profile):
            time.sleep(SLOW_SECONDS)
            return kernel.plan(args, config, profile)

        return [TritonImplementation("matmul", "slow", plan=plan, kernels=kernel.kernels,
                                     default_config=kernel.default_config)]


def selection_registry() -> Registry:
    manager, records = new_manager(), []
    for group, name, plugin in (("dlcore.backends", "selection", SelectionPlugin()),
                                ("dlcore.kernels", "vendor_matmul", vendor.matmul_plugin)):
        record = PluginRecord(group, name, "tests")
        record.status = PluginStatus.LOADED
        records.append(record)
        manager.register(plugin, name=record.id)
    return Registry(PluginSet(manager, records))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors: interpreter only")
def test_get_op_picks_the_vendor_library_over_a_slow_kernel_and_falls_back_when_it_is_disabled(
        monkeypatch, gen, tmp_path):
    reg = selection_registry()
    assert "vendor" in reg.backends["cpu"].kinds
    dispatcher = Dispatcher(lambda: reg, tmp_path)
    a, b = randn(gen, 5, 16), randn(gen, 16, 8, scale=0.25)
    reference = a.double() @ b.double()

    bound = dispatcher.get_op("matmul", (a, b))
    assert bound.impl.name == "torch" and bound.impl.kind == "vendor", bound.explain()
    s = bound.selection
    assert s.how is How.MEASURED and set(s.measured) == {"torch", "slow"}
    assert s.measured["slow"] >= SLOW_SECONDS * 1e3 > s.measured["torch"]
    text = bound.explain()
    for expected in ("chosen:    torch (vendor: torch.matmul", "declined  reference",
                     f"measured  torch: {s.measured['torch']:.4f} ms (vendor:",
                     f"measured  slow: {s.measured['slow']:.4f} ms (triton)"):
        assert expected in text, text
    assert_close(bound(a, b), reference, torch.float32, reduce_dim=16)

    monkeypatch.setenv("DLCORE_DISABLE_IMPLS", "matmul:torch")
    fallback = dispatcher.get_op("matmul", (a, b))
    assert fallback.impl.name == "slow" and fallback.impl.kind == "triton", fallback.explain()
    assert fallback.selection.how is How.ONLY_CANDIDATE
    assert "declined  torch: disabled by DLCORE_DISABLE_IMPLS" in fallback.explain()
    out = fallback(a, b)
    assert_close(out, reference, torch.float32, reduce_dim=16)

    # the choice kept on disk is the measured one, under its own key: a new dispatcher reads it back
    monkeypatch.delenv("DLCORE_DISABLE_IMPLS")
    again = Dispatcher(lambda: reg, tmp_path).get_op("matmul", (a, b))
    assert again.impl.name == "torch" and again.selection == bound.selection


# -- discovery when an op's own plugin is missing -----------------------------------------------------


def test_a_vendor_implementation_of_a_disabled_op_is_left_out_quietly(monkeypatch, capsys):
    monkeypatch.setenv("DLCORE_DISABLE_PLUGINS", "ffn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        reg = registry()
        ops = reg.ops
    assert "ffn" not in ops and "matmul" in ops
    assert "torch" in {i.name for i in reg.implementations_of("matmul")}
    record = reg.plugins.record("dlcore.kernels:vendor_ffn")
    assert record.status is PluginStatus.LOADED and not record.error
    assert record.ignored == ["ffn.torch: op 'ffn' is declared by no loaded plugin"]
    # what it would provide is remembered, so that a later process without the variable loads it for ffn
    assert reg.index.entries["dlcore.kernels:vendor_ffn"].ops == ["ffn"]
    assert main(["plugins"]) == 0
    assert "loaded (ignored ffn.torch: op 'ffn' is declared by no loaded plugin)" in capsys.readouterr().out
