"""Layers at the shapes users load, taken from the catalog's full-size models on the meta device and
materialized one at a time with seeded values; LoRA factors for them; strided-row checks against an fp64
formula.

Nothing here calls loraweave's math: references are the formulas (W + s·B·A, Kronecker products) in fp64 on a
strided sample of rows (every 97th, plus the first and last), so a check stays cheap while the arithmetic
under test runs at full size. A weight's values are a window of one seeded pool of N(0, 1) values (POOL, a
prime count) read cyclically from a seed's offset and scaled: a fill and a check run at copy speed
(torch.randn took ~4 s per layer of 340M elements, twice per test), no two rows of a layer are equal (rows <
POOL, fan_in < POOL), and "restored bit for bit" compares the weight with the pool, without holding a second
copy of the layer.

Meta models are built once (the latest 8 kept: a catalog build takes up to a second); each caller gets its own
deep copy."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from loraweave.arch.catalog import CATALOG, build_meta
from loraweave.mechanisms.merge.undo import bits

ROW_STRIDE = 97
LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class RealLayer:
    """One layer of a full-size catalog model: where it sits and its weight's shape."""

    arch: str
    path: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def fan_in(self) -> int:
        return math.prod(self.shape[1:])

    def __str__(self) -> str:
        return f"{self.arch}:{self.path}{list(self.shape)}"


@functools.lru_cache(maxsize=8)  # the latest few: a mechanism module reuses 3, the catalog's targeted kinds 5
def _meta_denoiser(arch: str) -> nn.Module:
    return build_meta(arch, text_encoders=False)[CATALOG[arch].denoiser]


def meta_denoiser(arch: str) -> nn.Module:
    """The architecture's full-size denoiser on the meta device (no weights): the session's build,
    deep-copied."""
    return copy.deepcopy(_meta_denoiser(arch))


def largest_layers(model: nn.Module, arch: str, count: int) -> list[RealLayer]:
    """The `count` largest distinct weight shapes of Linear/Conv layers, largest first (first path of
    each)."""
    first: dict[tuple[int, ...], str] = {}
    for path, module in model.named_modules():
        if isinstance(module, LAYER_TYPES):
            first.setdefault(tuple(module.weight.shape), path)
    ordered = sorted(first, key=lambda shape: -math.prod(shape))
    return [RealLayer(arch, first[shape], shape) for shape in ordered[:count]]


def layer_at(model: nn.Module, arch: str, path: str) -> RealLayer:
    return RealLayer(arch, path, tuple(model.get_submodule(path).weight.shape))


POOL = 1_048_573  # a prime above every fan_in and row count of the tier: no two rows of a layer are equal


@functools.cache
def _pool() -> torch.Tensor:
    """POOL seeded N(0, 1) values in fp32, twice over: a window of up to POOL values from any offset is
    contiguous."""
    base = torch.randn(POOL, generator=torch.Generator().manual_seed(0))
    return torch.cat([base, base])


def _period(weight: torch.Tensor, seed: int) -> torch.Tensor:
    """The values `weight` repeats (flat element k is period[k % POOL]): POOL pool values from `seed`'s offset
    (fewer for a smaller weight), scaled to std 1/sqrt(fan_in) (0.02 for a vector) and rounded to its
    dtype."""
    std = math.prod(weight.shape[1:]) ** -0.5 if weight.dim() > 1 else 0.02
    start = (seed * 2_654_435_761 + 12_345) % POOL
    return (_pool()[start : start + min(weight.numel(), POOL)] * std).to(weight.dtype)


def fill_seeded(weight: torch.Tensor, seed: int) -> None:
    """Fill `weight` (any float dtype, fp8 included) with N(0, 1/fan_in) values: the pool from `seed`'s
    offset."""
    assert weight.is_contiguous(), "fill_seeded writes the flat storage"
    period = _period(weight, seed)
    flat = weight.detach().view(-1)
    with torch.no_grad():
        for pos in range(0, flat.numel(), POOL):
            flat[pos : pos + POOL].copy_(period[: flat.numel() - pos])


def assert_seeded(weight: torch.Tensor, seed: int, what: str) -> None:
    """`weight` holds exactly the bits `fill_seeded(weight, seed)` wrote (compared as integers: -0.0
    counts)."""
    period = bits(_period(weight, seed))
    flat = bits(weight.detach().contiguous().view(-1))
    for pos in range(0, flat.numel(), POOL):
        got = flat[pos : pos + POOL]
        want = period[: got.numel()]
        if not torch.equal(got, want):
            bad = pos + int((got != want).nonzero()[0])
            index = [int(i) for i in torch.unravel_index(torch.tensor(bad), tuple(weight.shape))]
            raise AssertionError(f"{what}: differs from the original at flat {bad} {index}")


@contextmanager
def materialized(model: nn.Module, paths: list[str], dtype: torch.dtype, seed: int) -> Iterator[None]:
    """The layers at `paths` get real storage in `dtype` with seeded values (bias too); back to meta
    afterwards."""
    try:
        for i, path in enumerate(paths):
            layer = model.get_submodule(path)
            layer.to_empty(device="cpu", recurse=False)
            layer.to(dtype)
            fill_seeded(layer.weight, seed + i)
            if layer.bias is not None:
                fill_seeded(layer.bias, seed + 1000 + i)
        yield
    finally:
        for path in paths:
            model.get_submodule(path).to("meta")


def sample_rows(n_rows: int) -> torch.Tensor:
    """Every ROW_STRIDE-th row from the first, plus the last."""
    return torch.tensor(sorted({*range(0, n_rows, ROW_STRIDE), n_rows - 1}))


@dataclass
class LoraFactors:
    """A rank-r LoRA on one layer, PEFT layout: A (r, in[, k...]), B (out, r[, 1...]); fp32."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def state_dict(self, path: str) -> dict[str, torch.Tensor]:
        return {f"{path}.lora_A.weight": self.a, f"{path}.lora_B.weight": self.b}

    def delta_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B·A, |B|·|A|) on `rows`, fp64, flattened to (len(rows), fan_in)."""
        a = self.a.reshape(self.rank, -1).double()
        b = self.b.reshape(self.b.shape[0], self.rank)[rows].double()
        return b @ a, b.abs() @ a.abs()


def lora_for(layer: RealLayer, rank: int = 16, rel: float = 0.05, seed: int = 1) -> LoraFactors:
    """‖B·A‖_F = rel·‖W‖_F for a seeded layer (‖W‖_F² ≈ rows, as fill_seeded draws N(0, 1/fan_in))."""
    g = torch.Generator().manual_seed(seed)
    kernel = layer.shape[2:]
    a = torch.randn(rank, layer.fan_in, generator=g)
    b = torch.randn(layer.shape[0], rank, generator=g)
    # ‖B·A‖_F² = trace((BᵀB)(AAᵀ)): no rows × fan_in product formed
    norm = torch.trace((b.T @ b) @ (a @ a.T)).sqrt()
    b *= rel * math.sqrt(layer.shape[0]) / norm
    return LoraFactors(a.reshape(rank, *layer.shape[1:]), b.reshape(*b.shape, *(1,) * len(kernel)))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (subnormal spacing below its smallest normal), in fp64."""
    fi = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(fi.tiny)))
    return torch.exp2(exponent) * fi.eps


def assert_rows_match(
    got: torch.Tensor,
    expect: torch.Tensor,
    magnitude: torch.Tensor,
    dtype: torch.dtype,
    rank: int,
    what: str,
) -> None:
    """|got − expect| ≤ one ulp of `dtype` at `expect` + (rank + 2)·2⁻²⁴·magnitude (fp32 accumulation of the
    low-rank sum, `magnitude` = Σ|terms|). `expect` is the exact fp64 value, `got` the stored one."""
    got = got.reshape(expect.shape).double()
    tol = ulp(expect, dtype) + (rank + 2) * 2.0**-24 * magnitude
    err = (got - expect).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (
        f"{what}: |err| {float(err.flatten()[worst]):.3g} > tol {float(tol.flatten()[worst]):.3g} at flat "
        f"{worst}"
    )


def assert_merged(
    weight: torch.Tensor,
    rows: torch.Tensor,
    original: torch.Tensor,
    lora: LoraFactors,
    strength: float,
    what: str,
) -> None:
    """Rows `rows` of the merged `weight` hold W + strength·B·A (fp64 formula), and the adapter moved them by
    more than the tolerance on most elements (so the check could fail)."""
    delta, magnitude = lora.delta_rows(rows)
    expect = original.reshape(len(rows), -1).double() + strength * delta
    dtype = weight.dtype
    assert_rows_match(weight.detach()[rows], expect, abs(strength) * magnitude, dtype, lora.rank, what)
    moved = (strength * delta).abs() > 2 * ulp(expect, dtype)
    assert float(moved.double().mean()) > 0.5, (
        f"{what}: the adapter is below the tolerance; the check is void"
    )


class Holder(nn.Module):
    """A root around one real-size layer (taken from its meta model): the runtime and per-sample paths read
    the batch from a root's input."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def holder(layer: RealLayer) -> Holder:
    return Holder(copy.deepcopy(_meta_denoiser(layer.arch).get_submodule(layer.path)))


def layer_input(layer: RealLayer, dtype: torch.dtype, seed: int, samples: int = 2) -> torch.Tensor:
    """`samples` inputs: 3 tokens each for a Linear, a 4x4 map for a conv; N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    if len(layer.shape) == 2:
        return torch.randn(samples, 3, layer.shape[1], generator=g).to(dtype)
    return torch.randn(samples, layer.shape[1], 4, 4, generator=g).to(dtype)


def forward64(layer: RealLayer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The layer's forward in fp64 (the formula: x·Wᵀ + b, or the convolution with its padding of 1 for
    3x3)."""
    x, weight = x.double(), weight.double()
    bias = None if bias is None else bias.double()
    if len(layer.shape) == 2:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.conv2d(x, weight, bias, padding=layer.shape[-1] // 2)


def lora_term64(layer: RealLayer, x: torch.Tensor, lora: LoraFactors, absolute: bool = False) -> torch.Tensor:
    """B·(A·x) in fp64 (with `absolute`: |B|·(|A|·|x|), the magnitude its rounding errors scale with)."""
    pick = torch.abs if absolute else (lambda t: t)
    a, b, x = pick(lora.a.double()), pick(lora.b.double()), pick(x.double())
    if len(layer.shape) == 2:
        return x @ a.T @ b.T
    inner = torch.nn.functional.conv2d(x, a, padding=layer.shape[-1] // 2)
    return torch.nn.functional.conv2d(inner, b)
