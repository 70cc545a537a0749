"""`load_adapter`: read a file or state dict into per-module parts, keeping every key accounted for."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import AdapterFileError, AdapterMetadataError, ArgumentTypeError, UnsafeFormatError
from .alpha import MetadataAlpha, read_metadata_alpha
from .keys import ParsedKey, parse_key, split_stem
from .metadata import cloneofsimo_classes

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# Roles any family may carry (they name no family): alpha, a scale, a target shape to grow the module to.
GENERIC_ROLES = ("alpha", "scale", "reshape")
# When one stem carries keys of several families, the first listed here names the part.
FAMILY_PRECEDENCE = (
    "dora",
    "boft",
    "oft",
    "glora",
    "ia3",
    "tlora",
    "standin",
    "set",
    "sparse_bias",
    "loha",
    "lokr",
    "norm",
    "lora",
    "full",
)

# File-wide spellings that change where names land (arch `Alias.when_file`). "diffsynth": some key carries
# peft's `default` adapter name on lora_A/B, which is how diffusers tells DiffSynth-Studio's MiniMax-H3 files.
FILE_TRAITS: dict[str, re.Pattern] = {"diffsynth": re.compile(r"\.lora_[AB]\.default\.weight$")}


class TensorSource(Protocol):
    """What an Adapter reads its tensors through: a SafetensorsFile, an in-memory state dict."""

    def get(self, key: str) -> torch.Tensor: ...

    def shape(self, key: str) -> tuple[int, ...]: ...


class _DictSource:
    """Tensor source over an in-memory state dict (same interface as SafetensorsFile)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        import torch  # a caller holding tensors has imported it already (module level stays torch-free)

        # Detached: a handle holds the factors; a caller's autograd graph behind them must not live as long.
        self._tensors = {
            k: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v
            for k, v in tensors.items()
        }  # others kept as given: switch tells sets apart by identity

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)


class HeaderSource:
    """The names and shapes of a .safetensors file's header, no tensor: what detection reads (the LoRA
    picker's architecture marks). Asking it for a tensor is an error."""

    def __init__(self, path: Path) -> None:
        from ..io.safetensors_file import read_safetensors_header

        self.path = path
        header, self.metadata, _ = read_safetensors_header(path, names=True)
        self._shapes = {k: e[1] for k, e in header.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def get(self, key: str) -> torch.Tensor:
        raise AdapterFileError(f"{self.path}: read for its header only, tensor {key!r} was not read")

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]


@dataclass
class AdapterPart:
    """All keys of one adapter that address one module (or one fused group of rows)."""

    stem: str
    component: str
    path: str  # module path as written in the file, component prefix removed
    layout: str
    explicit_component: bool
    family: str  # "lora", "full", or a recognised-but-unsupported family name
    roles: dict[str, str] = field(default_factory=dict)  # role -> file key
    keys: list[str] = field(default_factory=list)
    extra_families: set[str] = field(default_factory=set)


@dataclass
class Adapter:
    name: str
    layout: str
    parts: list[AdapterPart]
    unparsed: list[dict]  # {key, reason}
    metadata: dict[str, str]
    source: TensorSource
    path: str | None = None
    meta_alpha: MetadataAlpha = field(default_factory=MetadataAlpha)

    @cached_property
    def traits(self) -> frozenset[str]:
        return frozenset(
            t for t, rx in FILE_TRAITS.items() if any(rx.search(k) for p in self.parts for k in p.keys)
        )

    @cached_property
    def has_alpha_tensors(self) -> bool:
        return any("alpha" in p.roles for p in self.parts)

    @property
    def families(self) -> dict[str, int]:
        return dict(Counter(p.family for p in self.parts))

    @property
    def keys_total(self) -> int:
        return sum(len(p.keys) for p in self.parts) + len(self.unparsed)

    def tensor(self, key: str) -> torch.Tensor:
        return self.source.get(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.source.shape(key))

    def __repr__(self) -> str:
        return (
            f"Adapter(name={self.name!r}, layout={self.layout!r}, parts={len(self.parts)}, "
            f"families={self.families}, unparsed={len(self.unparsed)})"
        )


def _open_source(path: Path, allow_pickle: bool, read: bool = False, header_only: bool = False):
    if header_only and path.suffix.lower() == ".safetensors":
        source = HeaderSource(path)
        return source, dict(source.metadata)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        from ..io.pickle_file import load_pickle_state_dict

        return _DictSource(load_pickle_state_dict(path, allow_pickle=allow_pickle)), {}
    if path.suffix.lower() != ".safetensors":
        raise UnsafeFormatError(
            f"{path}: only .safetensors adapters are read (pickles .pt/.ckpt/.bin/.pth only with "
            "loraweave.load_adapter(path, allow_pickle=True))",
            path=path,
        )
    from ..io.safetensors_file import SafetensorsFile

    sf = SafetensorsFile(path, read=read)
    return sf, dict(sf.metadata)


def _resolve_path(path: Path) -> tuple[Path, dict | None]:
    """A PEFT directory holds adapter_model.safetensors plus adapter_config.json (alpha lives there)."""
    if not path.is_dir():
        if not path.exists():
            raise AdapterFileError(f"{path}: no such file")
        return path, None
    for name in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors"):
        if (path / name).exists():
            config = path / "adapter_config.json"
            if not config.exists():
                return path / name, None
            try:
                return path / name, json.loads(config.read_text())
            except (ValueError, RecursionError):
                raise AdapterMetadataError(str(config), "adapter_config.json", "is not valid JSON") from None
    raise AdapterFileError(f"{path}: directory holds no adapter_model.safetensors")


def group_parts(keys: list[str]) -> tuple[list[AdapterPart], list[dict]]:
    """Group keys by stem into parts; every key lands in a part or in the unparsed list with a reason."""
    parsed: dict[str, list[ParsedKey]] = {}
    unparsed: list[dict] = []
    for key in keys:
        pk = parse_key(key)
        if isinstance(pk, str):
            unparsed.append({"key": key, "reason": pk})
        else:
            parsed.setdefault(pk.stem, []).append(pk)
    _fold_ia3_weights(parsed, unparsed)
    return [_part(stem, pks, unparsed) for stem, pks in parsed.items()], unparsed


def _fold_ia3_weights(parsed: dict[str, list[ParsedKey]], unparsed: list[dict]) -> None:
    """An IA3 `.weight` shows itself only through an `.on_input` sibling: fold such `<stem>.weight` in."""
    for item in list(unparsed):
        if item["key"].endswith(".weight") and item["key"][: -len(".weight")] in parsed:
            stem = item["key"][: -len(".weight")]
            if any(p.family == "ia3" for p in parsed[stem]):
                parsed[stem].append(ParsedKey(item["key"], stem, "ia3", "weight", None))
                unparsed.remove(item)


def _part(stem: str, pks: list[ParsedKey], unparsed: list[dict]) -> AdapterPart:
    """The part of one stem's keys; a role given twice keeps its first key, the other goes to `unparsed`."""
    # A lone `.scale` is no LoRA scale: BFL control LoRAs store norm weights as `*_norm.scale` (replacements).
    if len(pks) == 1 and pks[0].role == "scale":
        pks = [ParsedKey(pks[0].key, stem, "set", "set_weight", "bfl")]
    target = split_stem(stem)
    families = {p.family for p in pks if p.role not in GENERIC_ROLES}
    # The most specific family names the part: DoRA wraps LoRA/LoHa/LoKr, OFT's `rescale` rides along.
    family = next((f for f in FAMILY_PRECEDENCE if f in families), "lora")
    hints = [p.layout_hint for p in pks if p.layout_hint]
    layout = hints[0] if hints and target.layout in ("bare", "diffusers") else target.layout
    part = AdapterPart(stem, target.component, target.path, layout, target.explicit_component, family)
    part.extra_families = families - {family}
    for p in pks:
        part.keys.append(p.key)
        if p.role in part.roles:
            unparsed.append({"key": p.key, "reason": f"duplicate {p.role} for {stem} ({part.roles[p.role]})"})
            part.keys.remove(p.key)
            continue
        part.roles.setdefault(p.role, p.key)
    return part


def _describe_layout(parts: list[AdapterPart], unparsed: list[dict]) -> str:
    counts = Counter(p.layout for p in parts)
    if not counts:
        return "unknown"
    return "+".join(name for name, _ in counts.most_common())


def load_adapter(
    source: str | os.PathLike | Mapping[str, torch.Tensor] | Adapter,
    name: str | None = None,
    *,
    allow_pickle: bool = False,
    read: bool = False,
    header_only: bool = False,
) -> Adapter:
    """Read an adapter (path to .safetensors, PEFT directory, or state dict); tensors stay lazy, or with
    `read` a .safetensors file is read whole into memory of its own (io.safetensors_file.SafetensorsFile).
    `header_only`: a .safetensors file's names, shapes and metadata only (HeaderSource), its data never
    mapped nor read."""
    if isinstance(source, Adapter):
        return source
    if not isinstance(source, (str, os.PathLike, Mapping)):
        raise ArgumentTypeError(f"source must be a path, Adapter or state dict, got {type(source).__name__}")
    path = None
    peft_config = None
    if isinstance(source, Mapping):
        tensors = _DictSource(source)
        metadata: dict[str, str] = {}
    else:
        path, peft_config = _resolve_path(Path(source))
        tensors, metadata = _open_source(path, allow_pickle, read, header_only)
    parts, unparsed = group_parts(tensors.keys())
    for component in sorted({p.component for p in parts if p.layout == "cloneofsimo"}):
        cloneofsimo_classes(metadata, component, str(path) if path else "adapter")
    if name is None:
        name = path.stem if path is not None else "adapter"
    return Adapter(
        name=name,
        layout=_describe_layout(parts, unparsed),
        parts=parts,
        unparsed=unparsed,
        metadata=metadata,
        source=tensors,
        path=str(path) if path else None,
        meta_alpha=read_metadata_alpha(metadata, peft_config, source=str(path) if path else name),
    )
