"""Regional adapters (Handle.set_region): per token on a DiT (tiny Flux: image stream, [text; image]
single-stream blocks), per pixel of every feature map on a UNet (attention tokens at each resolution and conv
outputs).

Per layer, the output must be base + Σ_a w_a(token)·Δ_a, with Δ_a the adapter's plain runtime term on that
layer's actual input and w_a the mask at the token's position — computed here from the token's grid cell
centre, not by the library's resize; non-image tokens take the mask's peak (documented rule). Model-level: all
ones == plain runtime, all zeros == base."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.common import rel_err
from helpers.persample_adapters import adapter
from helpers.tiny_models import flux_forward, tiny_flux, tiny_sdxl_unet, unet_forward

import loraweave
from loraweave.errors import RegionError

LEFT = lambda u, v: float(u < 0.5)  # noqa: E731
TOP = lambda u, v: float(v < 0.5)  # noqa: E731
SIZE = 64  # mask pixels per side (square models)


def mask(fn) -> torch.Tensor:
    c = (torch.arange(SIZE) + 0.5) / SIZE
    return torch.tensor([[fn(float(u), float(v)) for u in c] for v in c])


def with_convs(model, sd: dict, seed: int) -> dict:
    """Add a LoRA on every Conv2d (kernel kept in down, 1x1 up)."""
    g = torch.Generator().manual_seed(seed)
    for path, m in model.named_modules():
        if type(m) is torch.nn.Conv2d:
            p = f"base_model.model.{path}."
            sd[p + "lora_down.weight"] = torch.randn(2, m.in_channels, *m.kernel_size, generator=g)
            sd[p + "lora_up.weight"] = torch.randn(m.out_channels, 2, 1, 1, generator=g) * 0.1
            sd[p + "alpha"] = torch.tensor(1.0)
    return sd


def token_weight(fn, shape, channels_first: bool, text: int) -> torch.Tensor | float:
    """The expected weight of each output position (independent of region.py's resize)."""
    if channels_first:
        h, w = shape[-2:]
        return torch.tensor([[fn((j + 0.5) / w, (i + 0.5) / h) for j in range(w)] for i in range(h)])
    if len(shape) < 3:
        return 1.0
    tokens = shape[-2]
    image = tokens - text if tokens > text and math.isqrt(tokens - text) ** 2 == tokens - text else tokens
    side = math.isqrt(image)
    if side * side != image or image <= text:  # text stream or conditioning: the peak
        return 1.0
    w = torch.tensor([fn((t % side + 0.5) / side, (t // side + 0.5) / side) for t in range(image)])
    return torch.cat([torch.ones(tokens - image), w]).view(tokens, 1)


def layer_errors(
    model, handle, forward, masks: dict, text: int, expected: dict | None = None
) -> tuple[float, int]:
    """Largest rel. error of any layer against base + Σ w·Δ (w from `expected`, default `masks`), and how many
    layers had both weighted and free tokens."""
    seen = []
    hooks = [
        rp.module.register_forward_hook(
            lambda m, a, out, rp=rp: seen.append((rp, a[0], out.detach().clone()))
        )
        for rp in handle.runtime_paths
    ]
    for name, fn in masks.items():
        handle.set_region(name, mask(fn))
    forward(model)
    for h in hooks:
        h.remove()
    for name in masks:
        handle.clear_region(name)
    worst, mixed = 0.0, 0
    for rp, x, got in seen:
        base = type(rp.module).forward(rp.module, x)
        want = base.clone()
        for name in rp.adapters:
            others = [n for n in rp.adapters if n != name]
            for n in others:
                rp.gates[n] = 0.0
            rp.refresh_scales()
            delta = rp.add_path(x, base.clone()) - base
            for n in others:
                rp.gates.pop(n)
            rp.refresh_scales()
            fn = (masks if expected is None else expected).get(name)
            w = 1.0 if fn is None else token_weight(fn, tuple(got.shape), rp.channels_first, text)
            want += delta * w
            mixed += isinstance(w, torch.Tensor) and bool(
                (w == 0).any() and (w == 1).any() and delta.abs().max() > 0
            )
        worst = max(worst, rel_err(got, want))
    return worst, mixed


@pytest.fixture(scope="module")
def flux():
    base = tiny_flux()
    ads = {"a": adapter(base, "lora", 1), "b": adapter(base, "lokr", 2)}
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model, [loraweave.AdapterSpec(sd, name=n) for n, sd in ads.items()], mode="runtime"
    )
    return base, ads, model, handle


def test_dit_half_and_overlapping_masks_per_token(flux):
    _, _, model, handle = flux
    err, mixed = layer_errors(model, handle, flux_forward, {"a": LEFT}, text=5)
    assert err <= 1e-5 and mixed > 10, (err, mixed)
    err, mixed = layer_errors(model, handle, flux_forward, {"a": LEFT, "b": TOP}, text=5)
    assert err <= 1e-5 and mixed > 10, (err, mixed)
    # negative control: a library following the other half would fail this check
    wrong, _ = layer_errors(
        model, handle, flux_forward, {"a": lambda u, v: 1.0 - LEFT(u, v)}, text=5, expected={"a": LEFT}
    )
    assert wrong > 1e-2


def test_dit_all_ones_is_plain_and_all_zeros_is_base(flux):
    base, ads, model, handle = flux
    plain = flux_forward(model)
    handle.set_region("a", torch.ones(SIZE, SIZE))
    handle.set_region("b", torch.ones(8, 8))
    assert rel_err(flux_forward(model), plain) <= 1e-6
    handle.set_region("a", torch.zeros(SIZE, SIZE))
    only_b = copy.deepcopy(base)
    ref = loraweave.apply(only_b, [loraweave.AdapterSpec(ads["b"], name="b")], mode="runtime")
    assert rel_err(flux_forward(model), flux_forward(only_b)) <= 1e-6
    handle.set_region("b", torch.zeros(4, 4))
    assert rel_err(flux_forward(model), flux_forward(base)) <= 1e-6
    assert rel_err(flux_forward(model), plain) > 1e-2  # negative control
    handle.clear_region("a")
    handle.clear_region("b")
    assert torch.equal(flux_forward(model), plain) and all(rp.mix is None for rp in handle.runtime_paths)
    ref.remove()


def test_unet_half_mask_per_feature_map_pixel():
    base = tiny_sdxl_unet()
    sd = with_convs(base, adapter(base, "lora", 1), 3)
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [loraweave.AdapterSpec(sd, name="a")], mode="runtime", strict=True)
    err, mixed = layer_errors(model, handle, unet_forward, {"a": LEFT}, text=0)
    assert err <= 1e-5 and mixed > 20, (err, mixed)
    convs = {id(rp) for rp in handle.runtime_paths if rp.conv is not None}
    assert len(convs) > 5
    handle.set_region("a", torch.zeros(16, 16))
    assert rel_err(unet_forward(model), unet_forward(base)) <= 1e-6
    handle.remove()


def test_region_refusals(flux):
    base, ads, model, handle = flux
    for bad, message in [
        (torch.ones(3), "2-D"),
        (torch.full((4, 4), 1.5), "within"),
        (torch.full((4, 4), float("nan")), "finite"),
        ("mask", "H×W tensor"),
    ]:
        with pytest.raises(RegionError, match=message):
            handle.set_region("a", bad)
    with pytest.raises(RegionError, match="no adapter named"):
        handle.set_region("zzz", torch.ones(4, 4))
    handle.set_region("a", torch.ones(SIZE, 2 * SIZE))  # 16 tokens cannot be a 1:2 grid
    with pytest.raises(RegionError, match="do not form a grid"):
        flux_forward(model)
    handle.clear_region("a")
    merged = loraweave.apply(copy.deepcopy(base), [loraweave.AdapterSpec(ads["a"], name="a")], mode="merge")
    with pytest.raises(RegionError, match="merged into"):
        merged.set_region("a", torch.ones(4, 4))


def test_region_inside_a_per_sample_batch(flux):
    """Regions apply to every sample of a batch: each row equals that sample alone with the region."""
    from helpers.batch_inputs import batch_inputs, run, take

    base, ads, model, handle = flux
    x, sets = batch_inputs("flux", 2), [["a"], ["a", "b"]]
    handle.set_region("a", mask(LEFT))
    with handle.batch(sets):
        got = run("flux", model, x)
    handle.clear_region("a")
    for i, names in enumerate(sets):
        alone = copy.deepcopy(base)
        h = loraweave.apply(alone, [loraweave.AdapterSpec(ads[n], name=n) for n in names], mode="runtime")
        h.set_region("a", mask(LEFT))
        assert rel_err(got[i : i + 1], run("flux", alone, take(x, [i]))) <= 1e-5


def test_region_follows_a_switch():
    base = tiny_flux()
    ads = {"a": adapter(base, "lora", 1), "b": adapter(base, "lokr", 2)}
    specs = {n: loraweave.AdapterSpec(sd, name=n) for n, sd in ads.items()}
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [specs["a"]], mode="runtime")
    handle.set_region("a", torch.zeros(4, 4))
    handle.switch([specs["a"], specs["b"]])  # b's layers are new paths: they must defer to the regions too
    only_b = copy.deepcopy(base)
    loraweave.apply(only_b, [specs["b"]], mode="runtime")
    assert rel_err(flux_forward(model), flux_forward(only_b)) <= 1e-6
    handle.switch([specs["b"]])
    handle.clear_region("a")
    handle.switch([specs["a"]])  # a's paths come back from the detached set: plain again
    assert all(rp.mix is None for rp in handle.runtime_paths)
    plain = copy.deepcopy(base)
    loraweave.apply(plain, [specs["a"]], mode="runtime")
    assert rel_err(flux_forward(model), flux_forward(plain)) <= 1e-6
