"""Nunchaku's real Python on CPU: a plain-torch stand-in for the compiled `nunchaku._C` extension.

`import_nunchaku()` registers `nunchaku._C` (with `ops` and `utils`) in `sys.modules`, puts
../shared/quantized/nunchaku on `sys.path` and imports the real package, so tests build and run Nunchaku's own
`SVDQW4A4Linear`, `AWQW4A16Linear` and transformers. The ops follow the kernels' semantics (src/Linear.cpp,
src/kernels/zgemm/gemm_w4a4.cuh, lora.cuh), written here from reading them:

- `quantize_w4a4_act_fuse_lora`: the low-rank branch takes the RAW input, `lora_act = x @ downᵀ` (fp32
  accumulate); the 4-bit path takes `x / smooth` (divided in 16-bit), quantised per row in groups of 64 with
  scale = max|·| · (1/7) (fp32; stored 16-bit), q = round-half-even(v / scale) in [-8, 7].
- `gemm_w4a4`: `out = 16bit(Σ_g q_a q_w · s_a s_w) + 16bit(lora_act · lora_scale) @ upᵀ + bias`, the main
  product rounded to the 16-bit dtype before the low-rank add (the kernel's fpsum is 16-bit), fp32 add,
  one final 16-bit rounding.
- `gemv_awq`: `x @ (q · wscales + wzeros)ᵀ`, TinyChat's 4-bit packing (nunchaku's `tinychat_utils.pack_w4`).

Weights, scales, smooth factor, bias and the low-rank pair are read in the layouts nunchaku's
`NunchakuWeightPacker` writes (the unpackers here invert its permutations, checked by round trips).
The quantised activations (`act`, `ascales`) pass only between these two ops, so they use a plain layout:
two's-complement nibbles, channel 2i in the low nibble of byte i, scales as (K/64, M_pad) [group, row].

`CALLS` counts every op call (the "same number of GEMM calls" check); `build_svdq_linear` and
`build_awq_linear` quantise a float weight into real layers with nunchaku's own packers.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections import Counter
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
NUNCHAKU_ROOT = REPO_ROOT.parent / "shared" / "quantized" / "nunchaku"
GROUP = 64  # int4 group size of SVDQW4A4Linear (nvfp4's 16 is not emulated)
TILE = 16  # the low-rank pair's pack tile (16 x 16 per MMA fragment)
CALLS: Counter[str] = Counter()


# ---------------------------------------------------------------- unpackers (inverses of nunchaku's packer)


def unpack_lowrank(packed: torch.Tensor, down: bool) -> torch.Tensor:
    """Packed `proj_down` (K, R) -> (R, K), or packed `proj_up` (N, R) -> (N, R), in the stored dtype."""
    c, r = packed.shape
    # packed memory: (c/16, r/16) fragments, each (n_lanes 8, k_lanes 4, n_pack 2, k_pack 2, reg_k 2)
    tiles = packed.reshape(c // TILE, r // TILE, 8, 4, 2, 2, 2)
    # back to (n_pack 2, n_lanes 8) x (k_pack 2, k_lanes 4, reg_k 2) = a 16 x 16 row-major fragment
    tiles = tiles.permute(0, 1, 4, 2, 5, 3, 6).reshape(c // TILE, r // TILE, TILE, TILE)
    if down:  # fragment rows run over the rank, columns over the input channels
        return tiles.permute(1, 2, 0, 3).reshape(r, c)
    return tiles.permute(0, 2, 1, 3).reshape(c, r)


_WEIGHT_PERM = (0, 5, 6, 1, 3, 8, 2, 7, 4, 9)  # NunchakuWeightPacker.pack_weight's permute (bits=4)


def unpack_weight(qweight: torch.Tensor) -> torch.Tensor:
    """Packed int4 `qweight` (N, K/2) int8 -> (N, K) int32 in [-8, 7]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    words = qweight.contiguous().view(torch.int32).reshape(n // 128, k // 64, 1, 8, 8, 4, 2, 2, 1, 1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words >> shifts) & 0xF  # last dim: the 8 values of one 32-bit register
    nibbles = nibbles - ((nibbles & 0x8) << 1)  # two's complement sign
    inverse = [_WEIGHT_PERM.index(d) for d in range(10)]
    return nibbles.permute(*inverse).reshape(n, k)


def unpack_scale(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Packed per-group scales (G, N) -> (N, G); a packed vector (smooth factor, bias) of n -> (n,)."""
    groups = packed.numel() // n
    # pack_scale, warp_n=128: (n/128, 1, 8, 2, 4, 2, G) -> (n/128, G, s_packs, lanes/4, 4, s_pack/2, 2)
    grid = packed.reshape(n // 128, groups, 1, 8, 4, 2, 2).permute(0, 2, 3, 5, 4, 6, 1)
    out = grid.reshape(n, groups)
    return out.reshape(n) if packed.dim() == 1 else out


def unpack_awq(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """AWQW4A16Linear `qweight` (N/4, K/2) int32 -> (N, K) int32 in [0, 15] (inverse of tinychat pack_w4)."""
    halves = qweight.contiguous().view(torch.int16).reshape(n // 4, k // 64, 4, 16)
    rows = halves.permute(0, 2, 1, 3).reshape(n, k // 32, 8).to(torch.int32)
    shifts = torch.tensor([0, 4, 8, 12], dtype=torch.int32).view(1, 1, 4, 1)
    return ((rows.unsqueeze(2) >> shifts) & 0xF).reshape(n, k)


# ---------------------------------------------------------------- the emulated ops


def _quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) 16-bit -> q (M, K) int32 in [-8, 7], 16-bit scales (M, K/64); the kernel's rounding."""
    m, k = values.shape
    groups = values.reshape(m, k // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1).float() * (1.0 / 7.0)  # kernel: maxvalue * RECPI_QVALUE_MAX in fp32
    rscale = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(groups.float() * rscale.unsqueeze(-1)).clamp_(-8, 7).to(torch.int32)
    return q.reshape(m, k), scale.to(values.dtype)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    low, high = (q[:, 0::2] & 0xF), (q[:, 1::2] & 0xF)
    return (low | (high << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    bytes_ = packed.to(torch.int32)
    low, high = bytes_ & 0xF, (bytes_ >> 4) & 0xF
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)
    return q - ((q & 0x8) << 1)


def quantize_w4a4_act_fuse_lora(input, output, oscales, lora_down, lora_act_out, smooth, fuse_glu, fp4):
    CALLS["quantize_w4a4_act_fuse_lora"] += 1
    if fuse_glu or fp4:
        raise NotImplementedError("the CPU stand-in emulates int4 without fused GLU only")
    m, k = input.shape
    down = unpack_lowrank(lora_down, down=True)[:, :k]  # (R, K)
    lora_act_out.zero_()
    lora_act_out[:m] = input.float() @ down.float().T
    smoothed = input / unpack_scale(smooth, k).to(input.dtype)  # 16-bit division (the kernel's h2div)
    q, scale = _quantize_rows(smoothed)
    output.zero_()
    output[:m] = _pack_nibbles(q)
    oscales.zero_()
    oscales[:, :m] = scale.T


def gemm_w4a4(
    act,
    wgt,
    out,
    qout,
    ascales,
    wscales,
    oscales,
    poolout,
    lora_act_in,
    lora_up,
    lora_down,
    lora_act_out,
    norm_q,
    norm_k,
    rotary_emb,
    bias,
    smooth_factor,
    out_vk,
    out_linearattn,
    act_unsigned,
    lora_scales,
    fuse_silu,
    fp4,
    alpha,
    wcscales,
    out_q,
    out_k,
    out_v,
    attn_tokens,
):
    CALLS["gemm_w4a4"] += 1
    unsupported = (qout, norm_q, norm_k, rotary_emb, out_vk, out_linearattn, out_q, out_k, out_v, poolout)
    if any(t is not None for t in unsupported) or fuse_silu or fp4 or act_unsigned:
        raise NotImplementedError("the CPU stand-in emulates the plain int4 GEMM epilogue only")
    m, n = out.shape
    dtype = out.dtype
    act_q = _unpack_nibbles(act[:m]).float() * ascales[:, :m].T.float().repeat_interleave(GROUP, dim=1)
    w_q = unpack_weight(wgt).float() * unpack_scale(wscales, n).float().repeat_interleave(GROUP, dim=1)
    main = (act_q @ w_q.T).to(dtype).float()
    rank = lora_up.shape[1]
    gains = torch.tensor(lora_scales, dtype=torch.float32).repeat_interleave(TILE)[:rank]
    lora_act = (lora_act_in[:m, :rank] * gains).to(dtype).float()
    total = main + lora_act @ unpack_lowrank(lora_up, down=False).float().T
    if bias is not None:
        total = total + unpack_scale(bias, n).float()
    out.copy_(total.to(dtype))


def gemv_awq(in_feats, kernel, scaling_factors, zeros, m, n, k, group_size):
    CALLS["gemv_awq"] += 1
    q = unpack_awq(kernel, n, k).float()
    scale = scaling_factors[: k // group_size].T.float().repeat_interleave(group_size, dim=1)
    zero = zeros[: k // group_size].T.float().repeat_interleave(group_size, dim=1)
    weight = q * scale + zero
    flat = in_feats.reshape(-1, k).float() @ weight.T
    return flat.to(in_feats.dtype).reshape(*in_feats.shape[:-1], n)


def _not_emulated(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"nunchaku._C {name} is not emulated on CPU")

    return call


def register_stand_in() -> None:
    """Put the stand-in `nunchaku._C` into sys.modules (idempotent)."""
    if "nunchaku._C" in sys.modules:
        return
    compiled = types.ModuleType("nunchaku._C")
    ops = types.ModuleType("nunchaku._C.ops")
    utils = types.ModuleType("nunchaku._C.utils")
    ops.quantize_w4a4_act_fuse_lora = quantize_w4a4_act_fuse_lora
    ops.gemm_w4a4 = gemm_w4a4
    ops.gemv_awq = gemv_awq
    for name in ("gemm_awq", "attention_fp16"):
        setattr(ops, name, _not_emulated(name))
    for name in ("set_log_level", "set_cuda_stack_limit", "disable_memory_auto_release", "trim_memory"):
        setattr(utils, name, _not_emulated(name))
    compiled.ops, compiled.utils = ops, utils
    for name in ("QuantizedFluxModel", "QuantizedSanaModel", "QuantizedGEMM", "QuantizedGEMM88"):
        setattr(compiled, name, type(name, (), {}))
    sys.modules.update({"nunchaku._C": compiled, "nunchaku._C.ops": ops, "nunchaku._C.utils": utils})


def import_nunchaku(module: str = "nunchaku.models.linear") -> types.ModuleType:
    """Import one of nunchaku's modules, the real source in place, on the CPU stand-in."""
    if not NUNCHAKU_ROOT.is_dir():
        raise FileNotFoundError(f"Nunchaku's source is missing: {NUNCHAKU_ROOT}")
    if str(NUNCHAKU_ROOT) not in sys.path:
        sys.path.insert(0, str(NUNCHAKU_ROOT))
    register_stand_in()
    return importlib.import_module(module)


# ---------------------------------------------------------------- building real layers from a float weight


def packer():
    return import_nunchaku("nunchaku.lora.flux.packer").NunchakuWeightPacker(bits=4)


def build_svdq_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rank: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    smooth: torch.Tensor | None = None,
):
    """A real `SVDQW4A4Linear` holding `weight` (N, K): SVDQuant's split W = up·down + residual, the residual
    smoothed (W·diag(s)) and quantised to int4 groups of 64 (scale = max/7), everything packed by nunchaku."""
    linear_mod = import_nunchaku("nunchaku.models.linear")
    pack = packer()
    n, k = weight.shape
    if n % 128 or k % 128:
        raise ValueError("Nunchaku's packer needs both widths a multiple of 128")
    w = weight.double()
    s = torch.ones(k, dtype=torch.float64) if smooth is None else smooth.double()
    s = s.to(dtype).double()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # a sketched SVD (full size would take minutes): any good split will do
        u, sv, v = torch.svd_lowrank((w * s).float(), q=min(rank + 16, n, k), niter=4)
    root = sv[:rank].double().sqrt()
    up = (u[:, :rank].double() * root).to(dtype)
    # the branch takes the raw x: x·downᵀ = (x/s)·(s·down)ᵀ
    down = (root[:, None] * v[:, :rank].double().T / s).to(dtype)
    residual = ((w - up.double() @ down.double()) * s).reshape(n, k // GROUP, GROUP)
    scale = (residual.abs().amax(dim=-1) / 7.0).to(dtype)
    safe = torch.where(scale.double() > 0, scale.double(), torch.ones_like(scale, dtype=torch.float64))
    q = torch.round(residual / safe.unsqueeze(-1)).clamp(-8, 7).to(torch.int32).reshape(n, k)
    layer = linear_mod.SVDQW4A4Linear(k, n, rank=rank, bias=bias is not None, torch_dtype=dtype)
    with torch.no_grad():
        layer.qweight.copy_(pack.pack_weight(q))
        layer.wscales.copy_(pack.pack_scale(scale, group_size=GROUP))
        layer.smooth_factor.copy_(pack.pack_scale(s.to(dtype), group_size=-1))
        layer.smooth_factor_orig.copy_(layer.smooth_factor)
        layer.proj_down.copy_(pack.pack_lowrank_weight(down, down=True))
        layer.proj_up.copy_(pack.pack_lowrank_weight(up, down=False))
        if bias is not None:
            layer.bias.copy_(pack.pack_scale(bias.to(dtype), group_size=-1))
    return layer


def svdq_parts(layer) -> dict[str, torch.Tensor]:
    """The layer's stored tensors unpacked, fp64: down (R, K), up (N, R), q (N, K), wscales (N, G), smooth,
    bias (or zeros); read with this module's unpackers (independent of the library's)."""
    n, k = layer.out_features, layer.in_features
    return {
        "down": unpack_lowrank(layer.proj_down.detach(), down=True).double(),
        "up": unpack_lowrank(layer.proj_up.detach(), down=False).double(),
        "q": unpack_weight(layer.qweight).double(),
        "wscales": unpack_scale(layer.wscales, n).double(),
        "smooth": unpack_scale(layer.smooth_factor, k).double(),
        "bias": torch.zeros(n, dtype=torch.float64)
        if layer.bias is None
        else unpack_scale(layer.bias.detach(), n).double(),
    }


def svdq_weight(layer) -> torch.Tensor:
    """The float weight the layer stands for, fp64: dequant(W4)·diag(1/smooth) + up·down."""
    p = svdq_parts(layer)
    residual = p["q"] * p["wscales"].repeat_interleave(GROUP, dim=1)
    return residual / p["smooth"] + p["up"] @ p["down"]


def svdq_error_bound(layer, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |layer(x) - x·svdq_weight(layer)ᵀ - bias| for the int4 path and 16-bit roundings.

    With v = x/s (16-bit), v̂ its int4 value (scale s_a), R the smoothed residual, R̂ its grid value
    (|R̂ - R| = 0 by construction: the layer's weight IS its grid), the 4-bit product differs from v·Rᵀ by
    Σ_k |R_k| (s_a/2 + 8u·s_a + u|v_k|) (activation rounding, stored-scale rounding, the 16-bit division),
    plus u|main| (main to 16-bit), u·Σ_r|act_r||up_r| (branch input to 16-bit), u|out| (final) and fp32
    accumulation; u = 2^-8 (bf16) or 2^-11 (fp16).
    """
    p = svdq_parts(layer)
    unit = 2.0**-8 if layer.proj_up.dtype == torch.bfloat16 else 2.0**-11
    flat = x.reshape(-1, layer.in_features).double()
    v = flat / p["smooth"]
    r_abs = (p["q"] * p["wscales"].repeat_interleave(GROUP, dim=1)).abs()
    a_scale = v.reshape(v.shape[0], -1, GROUP).abs().amax(-1) / 7.0
    per_channel = a_scale.repeat_interleave(GROUP, dim=1) * (0.5 + 8 * unit) + unit * v.abs()
    act_term = per_channel @ r_abs.T
    main = v.abs() @ r_abs.T
    act = flat @ p["down"].T
    branch = act.abs() @ p["up"].abs().T
    out = (flat @ svdq_weight(layer).T).abs() + p["bias"].abs()
    bound = act_term + unit * (main + act_term) + unit * branch + unit * (out + act_term + branch)
    return (bound * (1 + 1e-3) + 1e-6).reshape(*x.shape[:-1], layer.out_features)


def build_awq_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 64, dtype=torch.bfloat16
):
    """A real `AWQW4A16Linear` holding `weight` (N, K): asymmetric uint4 per (row, group), w = q·scale + zero,
    packed with nunchaku's TinyChat `pack_w4`."""
    linear_mod = import_nunchaku("nunchaku.models.linear")
    pack_w4 = import_nunchaku("nunchaku.models.text_encoders.tinychat_utils").pack_w4
    n, k = weight.shape
    groups = weight.double().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(dtype)
    zero_point = torch.round(-lo / scale.double()).clamp(0, 15)
    wzeros = (-zero_point * scale.double()).to(dtype)
    q = torch.round(groups / scale.double().unsqueeze(-1) + zero_point.unsqueeze(-1)).clamp(0, 15)
    layer = linear_mod.AWQW4A16Linear(k, n, bias=bias is not None, group_size=group_size, torch_dtype=dtype)
    with torch.no_grad():
        layer.qweight.copy_(
            pack_w4(q.reshape(n, k).to(torch.int32)).view(torch.int32).reshape(n // 4, k // 2)
        )
        layer.wscales.copy_(scale.T)
        layer.wzeros.copy_(wzeros.T)
        if bias is not None:
            layer.bias.copy_(bias.to(dtype))
    return layer


def awq_weight(layer) -> torch.Tensor:
    """The float weight an AWQW4A16Linear stands for, fp64: q·wscales + wzeros."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    q = unpack_awq(layer.qweight, n, k).double()
    scale = layer.wscales.T.double().repeat_interleave(g, dim=1)
    return q * scale + layer.wzeros.T.double().repeat_interleave(g, dim=1)


def tiny_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """Two real SVDQW4A4Linear layers (a: 256 -> 256, b: 256 -> 384, rank 32, smoothed, with bias) and one
    AWQW4A16Linear (c: 256 -> 128), built from seeded float weights."""
    g = torch.Generator().manual_seed(seed)
    root = torch.nn.Module()
    for name, (out, inp) in {"a": (256, 256), "b": (384, 256)}.items():
        low = torch.randn(out, 8, generator=g) @ torch.randn(8, inp, generator=g) / 8
        weight = low + 0.02 * torch.randn(out, inp, generator=g)
        smooth = torch.exp(0.4 * torch.randn(inp, generator=g))
        bias = 0.1 * torch.randn(out, generator=g)
        setattr(root, name, build_svdq_linear(weight, bias=bias, rank=32, dtype=dtype, smooth=smooth))
    awq = 0.1 * torch.randn(128, 256, generator=g)
    root.c = build_awq_linear(awq, bias=0.1 * torch.randn(128, generator=g), dtype=dtype)
    return root


def storage(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter/buffer: (the object, a byte copy); removal must put back the same objects, bytes."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t, t.detach().reshape(-1).view(torch.uint8).clone())
    for name, m in model.named_modules():
        if hasattr(m, "rank"):
            out[f"{name}.rank"] = (m.rank, torch.empty(0))
    return out


def assert_storage(model: torch.nn.Module, before: dict) -> None:
    now = dict([*model.named_parameters(), *model.named_buffers()])
    ranks = {f"{n}.rank": m.rank for n, m in model.named_modules() if hasattr(m, "rank")}
    assert set(now) | set(ranks) == set(before), sorted(set(now) ^ set(before))
    for name, (obj, data) in before.items():
        if name.endswith(".rank"):
            assert ranks[name] == obj, name
            continue
        assert now[name] is obj, f"{name} is not the original object"
        assert torch.equal(now[name].detach().reshape(-1).view(torch.uint8), data), f"{name} bytes changed"
    for name, m in model.named_modules():
        assert not m._forward_hooks and "forward" not in m.__dict__, name
