"""Regional adapters: an image-space mask (H×W, 0..1) becomes a weight per token of each layer's output.

Where a layer's tokens sit on the image:
- channels-first outputs (convolutions of a UNet, (B, C, [F,] h, w)): the mask resized to (h, w), per pixel;
- token outputs (B, T, C) whose T is an image grid of the model's input — (ceil(H/2^k), ceil(W/2^k)) of a
  4-D/5-D latent (UNet attention at every resolution, SD3/Wan patch tokens, frames × grid for video), or the N
  tokens of a packed (B, N, C) input (Flux-family DiTs) read as a row-major grid with the mask's aspect ratio:
  per token;
- joint [text; image] sequences of Flux-family single-stream blocks (T = text + N): text first, then the
  image;
- every other token (text, conditioning, time embeddings, (B, C) modulation inputs), and every token of a
  model called with (B, T) token ids (a pipeline's text encoders), gets the mask's peak, max(mask):
  an adapter present somewhere at full strength keeps its text-side terms, and an all-zero mask removes it
  wholly.
A longer sequence in an architecture whose joint order is not known is refused rather than guessed."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...errors import RegionError
from .rows import RootCall

# Roots whose single-stream blocks see cat([text, image]) along tokens (diffusers' FluxTransformer2DModel et
# al.).
TEXT_FIRST = {"FluxTransformer2DModel", "ChromaTransformer2DModel", "Flux2Transformer2DModel"}
_LEVELS = 7  # latent /1 .. /64


def check_mask(name: str, mask: object) -> torch.Tensor:
    """A float32 CPU copy of a valid H×W mask in [0, 1]."""
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError):
            raise RegionError(
                f"region {name!r}: mask must be an H×W tensor or array, got {type(mask).__name__}"
            ) from None
    if mask.dim() != 2 or mask.shape[0] == 0 or mask.shape[1] == 0:
        raise RegionError(f"region {name!r}: mask must be 2-D (H×W), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool or not mask.is_floating_point():
        mask = mask.float()
    mask = mask.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(mask).all()) or float(mask.min()) < 0.0 or float(mask.max()) > 1.0:
        raise RegionError(f"region {name!r}: mask values must be finite and within [0, 1]")
    return mask.contiguous()


def _resize(mask: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return F.adaptive_avg_pool2d(mask[None, None], (h, w))[0, 0]  # area average (repeats when enlarging)


def _grids(call: RootCall, mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """(frames, h, w) token grids the model's input allows."""
    shape = call.shape or ()
    if len(shape) in (4, 5):
        frames = shape[2] if len(shape) == 5 else 1
        H, W = shape[-2], shape[-1]
        return [(frames, -(-H // 2**k), -(-W // 2**k)) for k in range(_LEVELS)]
    if len(shape) == 3:
        n = shape[1]
        mh, mw = mask.shape
        h = max(1, round(math.sqrt(n * mh / mw)))
        if n % h or abs(h / (n // h) - mh / mw) > 1.0 / min(h, n // h):
            raise RegionError(
                f"the model's {n} image tokens do not form a grid with the mask's aspect {mh}×{mw}"
            )
        return [(1, h, n // h)]
    raise RegionError(
        f"regions need a tensor model input (B, C, H, W), (B, C, F, H, W) or (B, N, C); got "
        f"{shape or 'a list'}"
    )


def token_weights(
    mask: torch.Tensor,
    call: RootCall | None,
    root_class: str,
    out_shape: tuple[int, ...],
    channels_first: bool,
    layer: str,
) -> torch.Tensor | float:
    """The per-token weight of one layer output, broadcastable against it (or the peak as a float)."""
    peak = float(mask.max())
    if call is None:
        raise RegionError(
            f"{layer} ran outside its model's forward: regions place tokens through the model call"
        )
    if (
        call.shape is not None and len(call.shape) == 2
    ):  # (B, T) token ids: a text encoder, every token is text
        return peak
    if channels_first:
        if len(out_shape) < 4:
            return peak
        h, w = out_shape[-2:]
        return _resize(mask, h, w).view(1, 1, *([1] * (len(out_shape) - 4)), h, w)
    if len(out_shape) < 3:
        return peak
    tokens = out_shape[-2]
    for frames, h, w in _grids(call, mask):
        if tokens == frames * h * w:
            return _resize(mask, h, w).reshape(-1).repeat(frames).view(tokens, 1)
    image = call.shape[1] if call.shape is not None and len(call.shape) == 3 else None
    if image is not None and tokens > image:
        if root_class not in TEXT_FIRST:
            raise RegionError(
                f"{layer} sees {tokens} tokens for {image} image tokens, and the order of a joint sequence "
                f"in {root_class} is not known: regions are refused there"
            )
        frames, h, w = _grids(call, mask)[0]
        img = _resize(mask, h, w).reshape(-1)
        return torch.cat([img.new_full((tokens - image,), peak), img]).view(tokens, 1)
    return peak
