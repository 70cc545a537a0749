"""The thin GEMMs of a runtime low-rank pair (x·Aᵀ with r outputs, h·Bᵀ with r inputs) on CPU fp32.

MKL's sgemm runs them at ~40% of the base GEMM's efficiency; oneDNN's matmul (the kernel torch.compile's CPU
backend emits for linear layers) runs them about twice as fast (benchmarks/bench_floor.py, "components"). It
is reached through a private op, so it is probed once against addmm and used only where it is exact to fp32
rounding; anything else (other dtypes or devices, autograd) takes F.linear as before. Under torch.compile the
op is called through a custom op (`loraweave::onednn_linear`, opaque to inductor, which would lower F.linear
to MKL's mm): only once the probe has run outside the trace (`probe()`, at attach), never from inside it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("loraweave")
_PROBED: list[
    Callable[..., torch.Tensor] | None
] = []  # [the oneDNN linear op, or None when absent or wrong], filled on first use


def _probe() -> Callable[..., torch.Tensor] | None:
    op = None
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is not None:
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((5, 40), (3, 40), (3,)))
        try:
            with torch.inference_mode():
                ok = torch.allclose(
                    op(x, w, b, "none", [], ""), torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-6
                )
        except (RuntimeError, TypeError) as exc:  # a torch build whose private op changed: stay on F.linear
            log.info("skinny_gemm onednn=unusable reason=%s", exc)
            ok = False
        op = op if ok else None
    log.info("skinny_gemm onednn=%s", op is not None)
    return op


def probe() -> bool:
    """Run the one-time probe now (outside any trace); True when the oneDNN op is usable."""
    if not _PROBED:
        _PROBED.append(_probe())
    return _PROBED[0] is not None


def _eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The probed oneDNN op (chosen only after a successful probe)."""
    op = _PROBED[0]
    assert op is not None  # _onednn picks _eager only once probe() found the op
    return op(x, weight, bias, "none", [], "")


@torch.library.custom_op("loraweave::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_eager` as one opaque call in a compiled graph."""
    return _eager(x, weight, bias)


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _plain_fp32_bias(bias: torch.Tensor) -> bool:
    """A contiguous fp32 bias that needs no gradient (the op has no autograd formula)."""
    return (
        bias.dtype == torch.float32
        and bias.is_contiguous()
        and not (torch.is_grad_enabled() and bias.requires_grad)
    )


def _onednn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """A (x, weight, bias) callable on the oneDNN op (while compiling, its custom op) when it may run this
    product, else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    if type(x) is not torch.Tensor:  # a tensor subclass expects its own F.linear (__torch_function__)
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # the op has no autograd formula
    if not (x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2):
        return None
    if bias is not None and not _plain_fp32_bias(bias):
        return None
    if torch.compiler.is_compiling():  # no probe inside a trace: its ops would be traced
        return _onednn_linear if _PROBED and _PROBED[0] is not None else None
    return _eager if probe() else None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·weightᵀ (+ bias), as F.linear, on the faster kernel where it applies (a fresh contiguous tensor)."""
    op = _onednn(x, weight, bias)
    return F.linear(x, weight, bias) if op is None else op(x, weight, bias)
