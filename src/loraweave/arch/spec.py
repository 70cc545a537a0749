"""Declarative name maps: an original (fused) module name -> consecutive row ranges of live modules.

A table entry says: the rows of the file's delta for `source`, read top to bottom, land on `targets` in order.
A target is a whole live module, or `Rows(module, index, count)`: the index-th of `count` equal row chunks of
a live module. Splitting a fused key over separate modules, addressing rows of a fused live module, and
reordering chunks (BFL shift/scale vs diffusers scale/shift) are all the same mechanism. An alias may
interleave its targets in fixed-size chunks (per-head fused QKV) and may apply only to files with a trait
(DiffSynth).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tables are read without torch (inspect --no-coverage detects through them)
    import torch


@dataclass(frozen=True)
class Rows:
    module: str
    index: int
    count: int


Target = str | Rows


@dataclass(frozen=True)
class Alias:
    source: str  # original name pattern with `{i}` placeholders, e.g. "double_blocks.{i}.img_attn.qkv"
    targets: tuple[Target, ...]
    # Only where the first target's parent module is of this class (e.g. SD3's last block, whose context
    # norm is an AdaLayerNormContinuous with (scale, shift) rows instead of the other blocks' zero-norm).
    when_parent: str | None = None
    # The source interleaves its targets in chunks of this many rows (DiffSynth's MiniMax-H3 QKV, per head:
    # [head 0: q k v, head 1: q k v, ...]): chunk h of every target, in target order, for h = 0, 1, ...
    interleave: int | None = None
    # Only for files with this trait (formats.adapter.FILE_TRAITS), over the alias without it: one original
    # name whose rows two producers order differently, told apart only by the file's spelling.
    when_file: str | None = None


@dataclass(frozen=True)
class VariantOnly:
    """Module names that exist only in some variants of an architecture (Wan 2.1 I2V's image cross-attention).

    On a variant without them, keys for `names` are reported as expected absent, not as unknown modules.
    `anchor` is a module every variant has; its `{i}` values are the blocks the names are registered for."""

    names: tuple[str, ...]  # patterns with `{i}`, original and diffusers spellings
    anchor: str
    why: str


@dataclass(frozen=True)
class Unmapped:
    """Names a runtime's model holds in a layout no key maps onto exactly: rows it reorders (Nunchaku's
    modulation interleaves its shift/scale/gate chunks per hidden unit) or one original layer it splits by
    input columns (Nunchaku's single-block `proj_out`, over `attn.to_out` and `mlp_fc2`).

    A key naming them, or landing on them through an alias, is refused as unsupported with `why`, never
    applied to the wrong rows. `anchor`: a module every block has, its `{i}` values the blocks named."""

    names: tuple[str, ...]  # patterns with `{i}`: live module names and the file names of the split layer
    anchor: str
    why: str
    anchor_class: str | None = None  # only where the anchor is of this class (the runtime's own layer)


@dataclass(frozen=True)
class ColumnSplit:
    """One original layer a runtime holds as several live modules, each taking consecutive input columns
    (Nunchaku's single-block `proj_out`: `attn.to_out` the attention columns, then `mlp_fc2` the MLP ones);
    the layer's output is the sum of theirs. A key for `sources` lands on each target with its columns.

    Widths are the targets' live input widths; `targets[0]` anchors the blocks (its `{i}` values)."""

    sources: tuple[str, ...]  # patterns with `{i}`: original and diffusers names of the split layer
    targets: tuple[str, ...]  # live modules, in input-column order


@dataclass(frozen=True)
class Columns:
    """Input columns [start, start+width) of a split layer's delta go to the whole of `module`."""

    module: str
    start: int
    width: int


@dataclass(frozen=True)
class InterleavedRows:
    """Live modules a runtime stores with their `chunks` equal output chunks interleaved per unit: live row
    d·chunks + c holds the original's row c·dim + d (Nunchaku's AWQ modulation: its forward reads
    `view(-1, chunks)`). A delta in the original order lands with its rows gathered into the live order.

    `anchor_class`: only where the module is of this class (the runtime's own layer)."""

    names: tuple[str, ...]  # live module patterns with `{i}`
    chunks: int
    anchor_class: str


@dataclass(frozen=True)
class VariantInput:
    """An input width only a sibling variant's `module` has (Flux Fill's `x_embedder` takes 384 channels).

    A key for `module` trained on that width does not fit a model whose module is narrower or wider: it is
    reported as expected absent (the rest of the file applies), never grown into (that is for control
    adapters)."""

    module: str
    width: int
    why: str


@dataclass(frozen=True)
class ModelInput:
    """A model input whose width says which variant a model or an adapter is for: Flux's `x_embedder` takes
    the latents (as many columns as `proj_out` gives back: 64), Fill 384 (latents, masked-image latents,
    mask), a BFL control model 128 (latents and a control latent).

    An adapter trained on another width than the model's lands in the two relations declared here only:
    trained on the latents alone, on a wider variant (zero columns for the inputs it never saw); or a control
    adapter on a model that takes the latents alone, grown to `control` latents (zero columns for the control
    latent until the adapter lands). Any other width was trained on inputs this model is not fed (a control
    adapter's columns would meet Fill's masked image): miss kind `other_input`, which the engine refuses."""

    module: str
    latents: str  # the module whose output rows are the latent width (the denoiser's output projection)
    config_key: str  # the config entry recording the input width (updated when the input grows)
    control: int | None = None  # latents a control adapter feeds (2: latents + control latent); None: none


@dataclass(frozen=True)
class ParamAlias:
    """An original name of a bare parameter (not a module weight) -> the live parameter `target`
    (`module.name`).

    reshape: the original stores it with another shape of the same size, row-major (Krea2 flattens its (6, h)
    modulation table), so a delta is reshaped to the live shape."""

    source: str
    target: str
    reshape: bool = False


@dataclass(frozen=True)
class Piece:
    """Source rows [src_start, src_start+length) of a delta go to rows [dst_start, ...) of `module`."""

    module: str
    src_start: int
    dst_start: int
    length: int
    whole: bool  # the piece covers every row of the module


@dataclass(frozen=True)
class ArchTable:
    name: str
    classes: tuple[str, ...]  # model class names this table applies to
    aliases: tuple[Alias, ...]
    # Model inputs whose width tells a variant (Flux's `x_embedder`: 64 latents, Fill 384, a control model
    # 128): the widths an adapter may land on other than the model's own (ModelInput).
    model_inputs: tuple[ModelInput, ...] = ()
    # Spellings of projections that runtimes fuse (not checkpoint names): same mechanism, kept apart so the
    # checkpoint-layout oracle can tell them from the original names.
    runtime_fusions: tuple[Alias, ...] = ()
    # Modules only sibling variants have: their keys are expected absent on this one.
    variant_only: tuple[VariantOnly, ...] = ()
    # Input widths only sibling variants have: keys trained on them are expected absent on this one.
    variant_inputs: tuple[VariantInput, ...] = ()
    # Names held in a layout no key maps onto exactly (a runtime's reordered rows, a column split): refused.
    unmapped: tuple[Unmapped, ...] = ()
    # Original layers a runtime splits by input columns over several live modules.
    column_splits: tuple[ColumnSplit, ...] = ()
    # Live modules whose output chunks a runtime interleaves per unit.
    interleaved_rows: tuple[InterleavedRows, ...] = ()
    # Original names of bare parameters (modulation tables): full-difference keys can patch them.
    parameters: tuple[ParamAlias, ...] = ()
    # Original names that differ from the live ones by the converter's substring renames, in its order:
    # (original substring, live substring), and renames applied only at the start of a name.
    renames: tuple[tuple[str, str], ...] = ()
    prefix_renames: tuple[tuple[str, str], ...] = ()
    # A `__metadata__` entry in which this architecture's trainers record one network alpha for every module
    # (MiniMax-H3: lightx2v's `alpha`): γ = alpha / rank where the file has no `.alpha` tensor and no PEFT
    # config.
    metadata_alpha: str | None = None


def module_shape(module: torch.nn.Module) -> tuple[int, ...] | None:
    """Logical weight shape (out, in, *kernel); quantized linears pack their storage, so ask the module
    first."""
    out_features, in_features = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if isinstance(out_features, int) and isinstance(in_features, int):
        return (out_features, in_features)
    import torch  # loaded by then: only live modules reach here

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 1:
        return None
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.is_floating_point():
        from ..quant import backend_for  # packed storage (e.g. SDNQ uint4 conv): the backend knows the shape

        backend = backend_for(module)
        shape = backend.logical_shape(module) if backend is not None else None
        if shape:
            return tuple(shape)
    return tuple(weight.shape)


def out_rows(module: torch.nn.Module) -> int | None:
    shape = module_shape(module)
    return shape[0] if shape else None


def _target_module(target: Target) -> str:
    return target if isinstance(target, str) else target.module


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def _interleaved(alias: Alias, k: int, paths: list[str], rows: list[int]) -> list[Piece] | None:
    """Pieces of an interleaved alias (chunks of `k` rows): chunk h of each target in turn; None when the
    targets do not tile."""
    if any(isinstance(t, Rows) for t in alias.targets) or len(set(rows)) != 1 or rows[0] % k:
        return None
    return [
        Piece(path, (h * len(paths) + n) * k, h * k, k, False)
        for h in range(rows[0] // k)
        for n, path in enumerate(paths)
    ]


def _pieces(alias: Alias, i: str | None, modules: dict[str, torch.nn.Module]) -> list[Piece] | None:
    """One table entry at block `i`; None when this variant lacks a target or its rows do not split."""
    paths = [
        _target_module(t).replace("{i}", i) if i is not None else _target_module(t) for t in alias.targets
    ]
    found = [out_rows(modules[p]) if p in modules else None for p in paths]
    rows = [n for n in found if n is not None]
    if len(rows) < len(found):
        return None  # this variant lacks one target: the alias does not exist here
    if alias.interleave:
        return _interleaved(alias, alias.interleave, paths, rows)
    pieces, src = [], 0
    for target, path, n in zip(alias.targets, paths, rows, strict=True):
        if isinstance(target, Rows):
            if n % target.count:
                return None
            length = n // target.count
            pieces.append(Piece(path, src, target.index * length, length, False))
        else:
            length = n
            pieces.append(Piece(path, src, 0, n, True))
        src += length
    return pieces


def expand_alias(alias: Alias, modules: dict[str, torch.nn.Module]) -> dict[str, tuple[Piece, ...]]:
    # `modules` must include parameter-less containers when an alias uses `when_parent`.
    """Instantiate one table entry against the live module tree: {original name: pieces}."""
    first = _pattern_regex(_target_module(alias.targets[0]))
    indices = [m["i"] if "i" in first.groupindex else None for name in modules if (m := first.match(name))]
    out: dict[str, tuple[Piece, ...]] = {}
    for i in indices:
        if alias.when_parent is not None:
            first_path = (
                _target_module(alias.targets[0]).replace("{i}", i)
                if i is not None
                else _target_module(alias.targets[0])
            )
            parent = modules.get(first_path.rsplit(".", 1)[0]) if "." in first_path else None
            if type(parent).__name__ != alias.when_parent:
                continue
        pieces = _pieces(alias, i, modules)
        if pieces:
            out[alias.source.replace("{i}", i) if i is not None else alias.source] = tuple(pieces)
    return out


def expand_unmapped(entry: Unmapped, modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """{name: why} for every name of `entry` at every block whose anchor is of `entry.anchor_class`."""
    anchor = _pattern_regex(entry.anchor)
    indices = {
        m["i"] if "i" in anchor.groupindex else None
        for name, module in modules.items()
        if (m := anchor.match(name)) and entry.anchor_class in (None, type(module).__name__)
    }
    return {n.replace("{i}", i) if i is not None else n: entry.why for i in indices for n in entry.names}


def expand_column_split(
    split: ColumnSplit, modules: dict[str, torch.nn.Module]
) -> dict[str, tuple[Columns, ...]]:
    """{source name: columns of each target} at every block holding all the targets."""
    anchor = _pattern_regex(split.targets[0])
    out: dict[str, tuple[Columns, ...]] = {}
    for name in modules:
        m = anchor.match(name)
        if m is None:
            continue
        i = m["i"] if "i" in anchor.groupindex else None
        paths = [t.replace("{i}", i) if i is not None else t for t in split.targets]
        shapes = [module_shape(modules[p]) if p in modules else None for p in paths]
        if any(w is None or len(w) != 2 for w in shapes):
            continue
        widths = [int(w[1]) for w in shapes if w is not None]  # each target's input columns
        starts = [sum(widths[:n]) for n in range(len(widths))]
        columns = tuple(Columns(p, s, w) for p, s, w in zip(paths, starts, widths, strict=True))
        out.update({src.replace("{i}", i) if i is not None else src: columns for src in split.sources})
    return out


def expand_interleaved_rows(entry: InterleavedRows, modules: dict[str, torch.nn.Module]) -> dict[str, int]:
    """{live module: chunks} for every module `entry` names that is of its class."""
    patterns = [_pattern_regex(n) for n in entry.names]
    return {
        name: entry.chunks
        for name, module in modules.items()
        if type(module).__name__ == entry.anchor_class and any(p.match(name) for p in patterns)
    }


def expand_variant_only(entry: VariantOnly, modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """{name: why} for every name of `entry` at every block the live anchor has."""
    anchor = _pattern_regex(entry.anchor)
    indices = {m["i"] if "i" in anchor.groupindex else None for name in modules if (m := anchor.match(name))}
    return {n.replace("{i}", i) if i is not None else n: entry.why for i in indices for n in entry.names}


def expand_param_alias(alias: ParamAlias, params: dict[str, torch.Tensor]) -> dict[str, tuple[str, bool]]:
    """{original name: (live parameter path, reshape)} for every block the live model has."""
    target = _pattern_regex(alias.target)
    out = {}
    for name in params:
        m = target.match(name)
        if m:
            i = m["i"] if "i" in target.groupindex else None
            out[alias.source.replace("{i}", i) if i is not None else alias.source] = (name, alias.reshape)
    return out


def apply_renames(
    path: str,
    renames: tuple[tuple[str, str], ...],
    prefix_renames: tuple[tuple[str, str], ...],
    sep: str = ".",
) -> str:
    """An original module path -> the live one by a converter's rename rules (sep "_": kohya-flattened paths).

    Converters rename whole keys, so a rule may end in the separator that follows the module path: it is
    added."""
    path += sep
    for old, new in renames:
        path = path.replace(old.replace(".", sep), new.replace(".", sep))
    for old, new in prefix_renames:
        old, new = old.replace(".", sep), new.replace(".", sep)
        if path.startswith(old):
            path = new + path[len(old) :]
            break
    return path[: -len(sep)]
