"""On-disk cache of hosted factors (the truncated SVD is the expensive part of hosting).

One safetensors file per layer and configuration, named by sha256 of a signature: format version, model
identity (the caller's `model_id`, else a hash of the layer's own stored tensors), the layer, every
contribution's tensor content hash, family, rows, strength and scale, and the host rank. Factors are stored
int8 rowwise (row amax/127) and every fresh compute goes through the same round trip before use, so a replay
is bit-identical to a fresh apply. Entries whose format or signature do not match, or that fail to load, are
recomputed, never trusted. Writes are atomic (temp file, then os.replace); a byte budget evicts
least-recently-used files; budget 0 writes nothing."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...resolve.planner import PlannedPart
from ...resolve.stacking import Contribution
from ..quantized.hosted import Truncation

log = logging.getLogger("loraweave")

FORMAT = "1"
SUFFIX = ".safetensors"


def _hash_tensor(h: hashlib._Hash, t: torch.Tensor) -> None:
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    t = t.detach().cpu().contiguous().reshape(-1)  # 1-D: 0-d tensors cannot be viewed as bytes
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def layer_fingerprint(module: torch.nn.Module) -> str | None:
    """sha256 of every plain tensor a layer stores; None when it holds tensor subclasses we cannot read
    bytewise."""
    h = hashlib.sha256(type(module).__name__.encode())
    tensors = {
        **module._parameters,
        **module._buffers,
        **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)},
    }
    for name in sorted(tensors):
        t = tensors[name]
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
            return None  # an unknown identity disables caching rather than risking a wrong replay
        h.update(name.encode())
        _hash_tensor(h, t)
    return h.hexdigest()


def _quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.abs().amax(dim=1, keepdim=True).float() / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(t.float() / safe).clamp_(-127, 127).to(torch.int8), scale


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


class FactorCache:
    """Hosted-factor cache in `root`, at most `budget_bytes` on disk (0: off)."""

    def __init__(
        self, root: str | os.PathLike[str], budget_bytes: int = 8 << 30, model_id: str | None = None
    ) -> None:
        self.root = Path(root)
        self.budget = int(budget_bytes)
        self.model_id = model_id
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _part_hash(pp: PlannedPart) -> str:
        """Content hash of the part's own tensors (not memoised: object ids are reused after collection)."""
        h = hashlib.sha256()
        for key in sorted(pp.part.keys):
            h.update(key.encode())
            _hash_tensor(h, pp.adapter.tensor(key))
        return h.hexdigest()

    def signature(
        self, module: torch.nn.Module, layer: str, contributions: list[Contribution], host_rank: int
    ) -> str | None:
        identity = self.model_id if self.model_id is not None else layer_fingerprint(module)
        if identity is None:
            return None
        parts = [
            [
                self._part_hash(pp),
                pp.part.family,
                pp.part.path,
                piece.src_start,
                piece.dst_start,
                piece.length,
                repr(float(pp.strength)),
                repr(float(pp.scale)),
            ]
            for pp, piece in contributions
        ]
        return json.dumps(
            {"fmt": FORMAT, "model": identity, "layer": layer, "host_rank": host_rank, "parts": parts},
            sort_keys=True,
        )

    def _path(self, sig: str) -> Path:
        return self.root / f"{hashlib.sha256(sig.encode()).hexdigest()[:32]}{SUFFIX}"

    def load(self, sig: str) -> Truncation | None:
        """The stored factors for `sig`, or None (absent, other format, other signature, unreadable)."""
        path = self._path(sig)
        if self.budget <= 0 or not path.is_file():
            self.misses += 1
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("fmt") != FORMAT or meta.get("sig") != sig:
                raise ValueError(f"format {meta.get('fmt')!r} or signature mismatch")
            t = load_file(str(path))
            up = _dequantize_rows(t["up_q"], t["up_s"])
            down = _dequantize_rows(t["down_q"], t["down_s"])
            energy = float(t["energy"])
            if up.shape[1] != down.shape[0] or not (torch.isfinite(up).all() and torch.isfinite(down).all()):
                raise ValueError("factor shapes or values are inconsistent")
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is recomputed, never trusted
            log.info("factor_cache entry=%s status=recompute reason=%r", path.name, str(exc))
            self.misses += 1
            return None
        os.utime(path)  # LRU: a hit is a use
        self.hits += 1
        return Truncation(down, up, energy)

    def store(self, sig: str, trunc: Truncation) -> Truncation:
        """Write `trunc` (if the budget allows) and return its int8 round trip: what every apply uses."""
        up_q, up_s = _quantize_rows(trunc.up)
        down_q, down_s = _quantize_rows(trunc.down)
        stored = Truncation(_dequantize_rows(down_q, down_s), _dequantize_rows(up_q, up_s), trunc.energy)
        if self.budget <= 0:
            return stored
        self.root.mkdir(parents=True, exist_ok=True)
        tensors = {
            "up_q": up_q,
            "up_s": up_s,
            "down_q": down_q,
            "down_s": down_s,
            "energy": torch.tensor(trunc.energy, dtype=torch.float64),
        }
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"fmt": FORMAT, "sig": sig})
            os.replace(tmp, self._path(sig))  # atomic: readers see the old entry or the whole new one
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self._evict()
        return stored

    def _evict(self) -> None:
        files = sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.budget:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            log.info("factor_cache evicted=%s", p.name)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else 0
