"""Nunchaku (SVDQuant): `SVDQW4A4Linear` and its fused low-rank branch, `AWQW4A16Linear` at runtime.

An `SVDQW4A4Linear` computes `out = W4A4(x / smooth) + (x @ proj_downᵀ) @ proj_upᵀ + bias` in one fused
kernel pair: the low-rank branch is a side channel, so a plain LoRA is concatenated onto its rank (no hook,
no extra GEMM) and removed by putting the original tensors back. The pair is stored in the kernel's MMA
fragment layout: 16 x 16 tiles, each permuted to (n_lanes 8, k_lanes 4, n_pack 2, k_pack 2, reg_k 2) from
row-major (n_pack 2, n_lanes 8) x (k_pack 2, k_lanes 4, reg_k 2), tiles ordered (channel tile, rank tile).
Because the rank tiles of one channel tile are contiguous, appending rank is a concatenation in packed space:
only the new factors are packed (the base is never unpacked). The layout is implemented here (pure torch)
rather than imported from nunchaku's packer, which would import nunchaku's whole package and its compiled
extension; tests check it against `nunchaku.lora.flux.packer.NunchakuWeightPacker`.

Also packed, and unpacked here for `dequantize`: `qweight` (int4 MMA layout, 128 x 64 tiles), `wscales`,
`smooth_factor` and `bias` (the kernel's per-channel scale layout, 128-channel warps). nunchaku is never
imported: layers are recognised by class name."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from .backend import Capabilities, FactorSlot, QuantBackend, spare_branches

TILE = 16  # the low-rank pair's fragment (16 x 16)
WARP_N = 128  # output channels per warp: qweight tiles and the scale layout
_QWEIGHT_ORDER = (0, 5, 6, 1, 3, 8, 2, 7, 4, 9)  # packed dims: (n/128, k/64, 1, 8, 8, 4, 2, 2, 1, 8 nibbles)


class NunchakuLayer(Protocol):
    """What the backend reads and writes of Nunchaku's layers (third-party, untyped classes)."""

    in_features: int
    out_features: int
    group_size: int
    rank: int
    proj_down: torch.Tensor
    proj_up: torch.Tensor
    qweight: torch.Tensor
    wscales: torch.Tensor
    wzeros: torch.Tensor
    smooth_factor: torch.Tensor


def layer_of(module: torch.nn.Module) -> NunchakuLayer:
    """`module` read as the Nunchaku layer it is (is_svdq / is_awq checked by the caller)."""
    return cast(NunchakuLayer, module)


def _class_named(module: torch.nn.Module, name: str) -> bool:
    return any(c.__name__ == name for c in type(module).__mro__)


def is_svdq(module: torch.nn.Module) -> bool:
    return _class_named(module, "SVDQW4A4Linear") and all(
        hasattr(module, a) for a in ("proj_down", "proj_up", "qweight", "wscales", "smooth_factor")
    )


def is_awq(module: torch.nn.Module) -> bool:
    return _class_named(module, "AWQW4A16Linear") and all(
        hasattr(module, a) for a in ("qweight", "wscales", "wzeros")
    )


# ------------------------------------------------------------------ the low-rank pair's fragment layout


def _fragments(weight: torch.Tensor, down: bool) -> torch.Tensor:
    """A view of down (R, in) / up (out, R) as its packed fragments (in/16 or out/16, R/16, 8, 4, 2, 2, 2)."""
    if down:
        rank, channels = weight.shape
        tiles = weight.reshape(rank // TILE, TILE, channels // TILE, TILE).permute(2, 0, 1, 3)
    else:
        channels, rank = weight.shape
        tiles = weight.reshape(channels // TILE, TILE, rank // TILE, TILE).permute(0, 2, 1, 3)
    return tiles.reshape(channels // TILE, rank // TILE, 2, 8, 2, 4, 2).permute(0, 1, 3, 5, 2, 4, 6)


def pack_lowrank(weight: torch.Tensor, down: bool) -> torch.Tensor:
    """down (R, in) -> packed (in, R); up (out, R) -> packed (out, R). Both sizes multiples of 16."""
    frags = _fragments(weight, down)
    channels, rank = frags.shape[0] * TILE, frags.shape[1] * TILE
    return frags.contiguous().view(channels, rank)


@functools.lru_cache(maxsize=16)
def _pack_order(rows: int, cols: int, down: bool, device: torch.device) -> torch.Tensor:
    """For a (rows, cols) factor: the source index of every packed PAIR of elements. The innermost packed
    dim (reg_k, 2) is 2 consecutive source elements, so the pack is a gather of 32-bit pairs of the 16-bit
    factor: half the indices of an element gather, and ~7x faster than a strided copy of the fragment view."""
    flat = torch.arange(rows * cols, dtype=torch.int64, device=device).view(rows, cols)
    return (pack_lowrank(flat, down).reshape(-1)[0::2] // 2).to(torch.int32)


def _pack_into(tiles: torch.Tensor, factor: torch.Tensor, down: bool) -> None:
    """Write `factor` (down (r, in) / up (out, r), any float dtype) packed into `tiles` (in/16 or out/16,
    r/16, 8, 4, 2, 2, 2) of a 16-bit dtype, cast to their dtype first (exact: a cast is per element)."""
    order = _pack_order(factor.shape[0], factor.shape[1], down, factor.device)
    pairs = factor.to(tiles.dtype).contiguous().view(-1).view(torch.int32)
    tiles.view(torch.int32).copy_(pairs.index_select(0, order).view(tiles.shape[:-1] + (1,)))


def _rank_tiles(packed: torch.Tensor) -> torch.Tensor:
    """A packed pair's fragments: (channels/16, rank/16, 8, 4, 2, 2, 2), a view."""
    channels, rank = packed.shape
    return packed.view(channels // TILE, rank // TILE, 8, 4, 2, 2, 2)


def unpack_lowrank(packed: torch.Tensor, down: bool) -> torch.Tensor:
    """The inverse of `pack_lowrank`: packed (in, R) -> down (R, in); packed (out, R) -> up (out, R)."""
    channels, rank = packed.shape
    frags = packed.reshape(channels // TILE, rank // TILE, 8, 4, 2, 2, 2).permute(0, 1, 4, 2, 5, 3, 6)
    tiles = frags.reshape(channels // TILE, rank // TILE, TILE, TILE)
    if down:
        return tiles.permute(1, 2, 0, 3).reshape(rank, channels)
    return tiles.permute(0, 2, 1, 3).reshape(channels, rank)


def append_rank(packed: torch.Tensor, extra: torch.Tensor, down: bool) -> torch.Tensor:
    """`packed` with the factors `extra` (down (r, in) / up (out, r), any float dtype, r a multiple of 16)
    appended along the rank: per channel tile, the new rank tiles follow the base's. One pass per tensor:
    the base tiles are copied, the new ones packed and cast straight into place."""
    channels, base = packed.shape
    width = extra.shape[0] if down else extra.shape[1]
    joined = packed.new_empty(channels, base + width)
    tiles = _rank_tiles(joined)
    tiles[:, : base // TILE].copy_(_rank_tiles(packed))
    _pack_into(tiles[:, base // TILE :], extra, down)
    return joined


# ------------------------------------------------------------------ the int4 path's layouts (for dequantize)


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """Packed int4 weights (out, in/2) int8 -> (out, in) int32 in [-8, 7]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    words = qweight.contiguous().view(torch.int32).reshape(n // 128, k // 64, 1, 8, 8, 4, 2, 2, 1, 1)
    nibbles = (words >> torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)) & 0xF
    signed = nibbles - ((nibbles & 0x8) << 1)
    return signed.permute(*[_QWEIGHT_ORDER.index(d) for d in range(10)]).reshape(n, k)


def unpack_channel_scales(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """Packed per-channel values (groups, channels) -> (channels, groups); a packed vector -> (channels,)."""
    groups = packed.numel() // channels
    grid = packed.reshape(channels // WARP_N, groups, 1, 8, 4, 2, 2).permute(0, 2, 3, 5, 4, 6, 1)
    values = grid.reshape(channels, groups)
    return values.reshape(channels) if packed.dim() == 1 else values


def unpack_awq(qweight: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """AWQW4A16Linear's TinyChat-packed uint4 (out/4, in/2) int32 -> (out, in) int32 in [0, 15]."""
    halves = qweight.contiguous().view(torch.int16).reshape(out // 4, inp // 64, 4, 16)
    rows = halves.permute(0, 2, 1, 3).reshape(out, inp // 32, 1, 8).to(torch.int32)
    shifts = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=rows.device).view(1, 1, 4, 1)
    return ((rows >> shifts) & 0xF).reshape(out, inp)


# ------------------------------------------------------------------ appending to the branch


@dataclass
class _Spare:
    """An undone append's joined pair, left within `reused_branches` for the next append on the layer: valid
    while neither the originals nor the joined tensors were written since (their version counters)."""

    module: torch.nn.Module
    originals: tuple[torch.Tensor, torch.Tensor]
    joined: tuple[torch.nn.Parameter, torch.nn.Parameter]
    versions: tuple[int, ...]

    @staticmethod
    def versions_of(*tensors: torch.Tensor) -> tuple[int, ...]:
        return tuple(t._version for t in tensors)

    def fits(self, module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor) -> bool:
        base_down, base_up = self.originals
        joined_down, joined_up = self.joined
        return (
            self.module is module
            and layer_of(module).proj_down is base_down
            and layer_of(module).proj_up is base_up
            and self.versions == self.versions_of(base_down, base_up, joined_down, joined_up)
            and joined_down.shape[1] == base_down.shape[1] + down.shape[0]
            and joined_up.shape[1] == base_up.shape[1] + up.shape[1]
        )


class AppendedRank(FactorSlot):
    """Factors appended to one layer's low-rank branch: undo puts the original tensors (and rank) back;
    rescale rewrites the appended up tiles of the installed tensor in place. Within `reused_branches` (a
    switch), an undone append leaves its joined pair for the next: the base tiles are already there, so only
    the new factors are packed, in place."""

    def __init__(self, module: torch.nn.Module, base_rank: int) -> None:
        self.module, self.base_rank = module, base_rank
        self.saved: dict[str, Any] = {n: getattr(module, n) for n in ("proj_down", "proj_up")}
        self.saved_rank: Any = module.__dict__.get("rank")
        self.installed: tuple[torch.nn.Parameter, torch.nn.Parameter] | None = None

    def install(self, down: torch.Tensor, up: torch.Tensor) -> None:
        old_down, old_up = self.saved["proj_down"], self.saved["proj_up"]
        pool = spare_branches()
        spare = pool.pop(id(self.module), None) if pool is not None else None
        if isinstance(spare, _Spare) and spare.fits(self.module, down, up):
            new_down, new_up = spare.joined
            _pack_into(_rank_tiles(new_down.detach())[:, self.base_rank // TILE :], down, True)
            _pack_into(_rank_tiles(new_up.detach())[:, self.base_rank // TILE :], up, False)
        else:
            joined_down = append_rank(old_down.detach(), down, down=True)
            joined_up = append_rank(old_up.detach(), up, down=False)
            new_down = torch.nn.Parameter(joined_down, requires_grad=old_down.requires_grad)
            new_up = torch.nn.Parameter(joined_up, requires_grad=old_up.requires_grad)
        layer_of(self.module).proj_down, layer_of(self.module).proj_up = new_down, new_up
        self.installed = (new_down, new_up)
        if isinstance(self.saved_rank, int):
            layer_of(self.module).rank = new_up.shape[1]

    def rescale(self, up: torch.Tensor) -> bool:
        if self.installed is None or layer_of(self.module).proj_up is not self.installed[1]:
            return False  # someone replaced the tensors since: the caller rewrites from the originals
        current = self.installed[1]
        width = current.shape[1] - self.base_rank
        if up.shape[1] != width:  # the bucket / tile padding: zero columns
            up = torch.cat([up, up.new_zeros(up.shape[0], width - up.shape[1])], dim=1)
        with torch.no_grad():
            _pack_into(
                _rank_tiles(current.detach())[:, self.base_rank // TILE :], up.to(current.device), False
            )
        return True

    def __call__(self) -> None:
        installed, pool = self.installed, spare_branches()
        if pool is not None and installed is not None and layer_of(self.module).proj_up is installed[1]:
            originals = (self.saved["proj_down"], self.saved["proj_up"])
            versions = _Spare.versions_of(*originals, *installed)
            pool[id(self.module)] = _Spare(self.module, originals, installed, versions)
        for name, value in self.saved.items():
            setattr(self.module, name, value)
        if isinstance(self.saved_rank, int):
            layer_of(self.module).rank = self.saved_rank
        self.installed = None


def _padded_rank(t: torch.Tensor, dim: int) -> torch.Tensor:
    extra = -t.shape[dim] % TILE
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


class NunchakuBackend(QuantBackend):
    name = "nunchaku"

    def owns(self, module: torch.nn.Module) -> bool:
        return is_svdq(module) or is_awq(module)

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        if is_awq(module):
            return Capabilities(True, False, False, reason="AWQW4A16Linear has no low-rank branch")
        int4 = getattr(module, "precision", "int4") == "int4"
        return Capabilities(
            dequantize=int4,
            requantize=False,
            factor_channel=True,
            reason="" if int4 else "dequantize reads int4 layers only (nvfp4 not implemented)",
        )

    def bits(self, module: torch.nn.Module) -> int:
        return 4

    def logical_shape(self, module: torch.nn.Module) -> tuple[int, ...] | None:
        return (int(layer_of(module).out_features), int(layer_of(module).in_features))

    def has_checkpoint_svd(self, module: torch.nn.Module) -> bool:
        return is_svdq(module)

    def malformed(self, module: torch.nn.Module) -> str | None:
        out, inp = getattr(module, "out_features", None), getattr(module, "in_features", None)
        if not isinstance(out, int) or not isinstance(inp, int):
            return "no integer in_features/out_features"
        if is_awq(module):
            return None
        down, up = layer_of(module).proj_down, layer_of(module).proj_up
        if down.dim() != 2 or up.dim() != 2:
            return f"proj_down {tuple(down.shape)} / proj_up {tuple(up.shape)} are not matrices"
        if down.shape[1] != up.shape[1]:
            return (
                f"proj_down rank {down.shape[1]} (shape {tuple(down.shape)}) disagrees with proj_up rank "
                f"{up.shape[1]} (shape {tuple(up.shape)})"
            )
        if down.shape[0] != inp or up.shape[0] != out:
            return (
                f"proj_down {tuple(down.shape)} / proj_up {tuple(up.shape)} do not fit in_features={inp}, "
                f"out_features={out}"
            )
        if down.shape[1] % TILE or inp % WARP_N or out % WARP_N:
            return f"rank {down.shape[1]} or widths ({out}, {inp}) off the kernel's tiles"
        if down.dtype != up.dtype or down.dtype not in (torch.float16, torch.bfloat16):
            return f"proj_down {down.dtype} / proj_up {up.dtype}: the kernel reads one 16-bit dtype"
        return None

    def logical_bias(self, module: torch.nn.Module) -> torch.Tensor | None:
        bias = getattr(module, "bias", None)
        if not isinstance(bias, torch.Tensor) or not is_svdq(module):
            return super().logical_bias(module)
        return unpack_channel_scales(bias.detach(), int(layer_of(module).out_features))

    def grid_step(self, module: torch.nn.Module) -> float:
        lay = layer_of(module)
        if is_awq(module):
            return float(lay.wscales.detach().float().abs().mean())
        scales = unpack_channel_scales(lay.wscales.detach(), int(lay.out_features)).float()
        smooth = unpack_channel_scales(lay.smooth_factor.detach(), int(lay.in_features)).float()
        group = int(lay.in_features) // scales.shape[1]
        return float((scales.repeat_interleave(group, dim=1) / smooth).abs().mean())

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        lay = layer_of(module)
        out, inp = int(lay.out_features), int(lay.in_features)
        with torch.no_grad():
            if is_awq(module):
                group = int(lay.group_size)
                scale = lay.wscales.detach()[: inp // group].T.float().repeat_interleave(group, dim=1)
                zero = lay.wzeros.detach()[: inp // group].T.float().repeat_interleave(group, dim=1)
                return unpack_awq(lay.qweight.detach(), out, inp).float() * scale + zero
            if not self.capabilities(module).dequantize:
                raise NotImplementedError(self.capabilities(module).reason)
            scales = unpack_channel_scales(lay.wscales.detach(), out).float()
            smooth = unpack_channel_scales(lay.smooth_factor.detach(), inp).float()
            group = inp // scales.shape[1]
            residual = unpack_qweight(lay.qweight.detach()).float() * scales.repeat_interleave(group, 1)
            down = unpack_lowrank(lay.proj_down.detach(), down=True).float()
            up = unpack_lowrank(lay.proj_up.detach(), down=False).float()
            return residual / smooth + up @ down

    def append_factors(self, module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor) -> FactorSlot:
        proj_up = layer_of(module).proj_up
        slot = AppendedRank(module, int(proj_up.shape[1]))
        with torch.no_grad():  # cast to the branch's dtype as they are packed into place
            down = _padded_rank(down.detach().to(proj_up.device), 0)
            up = _padded_rank(up.detach().to(proj_up.device), 1)
            slot.install(down, up)
        return slot


BACKEND = NunchakuBackend()
