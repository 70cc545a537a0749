"""Per-component alias table built from the live module tree: every spelling a file may use -> pieces."""

from __future__ import annotations

import torch

from ..formats.keys import underscore_form
from .registry import arch_tables
from .spec import (
    ArchTable,
    Columns,
    ModelInput,
    Piece,
    apply_renames,
    expand_alias,
    expand_column_split,
    expand_interleaved_rows,
    expand_param_alias,
    expand_unmapped,
    expand_variant_only,
    module_shape,
    out_rows,
)

AMBIGUOUS = "ambiguous"
# Files name CLIP layers under `text_model.`; recent transformers releases dropped that level from the tree.
PATH_PREFIX_ALIASES: dict[str, str] = {
    "CLIPTextModel": "text_model.",
    "CLIPTextModelWithProjection": "text_model.",
}


# Wrapper levels of LLM text encoders: (prefix in the live tree, prefix files use instead). kohya/ComfyUI
# write paths under the decoder (`lora_te_layers_0_...`); ForCausalLM adds `model.`; transformers >= 4.52
# nests the Qwen2.5-VL decoder and vision tower under `model.language_model.` / `model.visual.` (older files
# lack that level).
WRAPPER_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("model.language_model.", "language_model."),
    ("model.language_model.", ""),
    ("model.visual.", "visual."),
    ("model.", ""),
)


def original_names(
    module: torch.nn.Module,
    modules: dict[str, torch.nn.Module],
    runtime_fusions: bool = False,
    trait: str | None = None,
) -> dict[str, tuple[Piece, ...]]:
    """Original names of the tables for this class; `trait`: only the aliases for files with that trait."""
    cls = type(module).__name__
    out: dict[str, tuple[Piece, ...]] = {}
    for table in arch_tables():
        if cls in table.classes:
            for alias in table.runtime_fusions if runtime_fusions else table.aliases:
                if alias.when_file == trait:
                    out.update(expand_alias(alias, modules))
    if runtime_fusions or trait is not None:
        return out
    if cls == "UNet2DConditionModel":
        from .unet_original import unet_original_names

        for original, path in unet_original_names(module).items():
            rows = out_rows(modules[path]) if path in modules else None
            if rows is not None:
                out[original] = (Piece(path, 0, 0, rows, True),)
    return out


def bare_parameters(module: torch.nn.Module, cls: str, modules: dict) -> dict[str, tuple[str, bool]]:
    """Parameters that are not a module's weight/bias (modulation tables), by live and original name."""
    live = {
        name: p
        for name, p in module.named_parameters()
        if name.rpartition(".")[0] not in modules or name.rpartition(".")[2] not in ("weight", "bias")
    }
    out: dict[str, tuple[str, bool]] = {name: (name, False) for name in live}
    for table in arch_tables():
        if cls in table.classes:
            for alias in table.parameters:
                out.update(expand_param_alias(alias, live))
    return out


def _variant_only(cls: str, every: dict[str, torch.nn.Module], exact: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for table in arch_tables():
        if cls in table.classes:
            for entry in table.variant_only:
                out.update({k: v for k, v in expand_variant_only(entry, every).items() if k not in exact})
    return out


# diffusers `fuse_qkv_projections()` adds a fused module and makes forward use it instead of the separate
# ones: after that, keys for the separate projections must land on rows of the fused module, or they do
# nothing.
FUSED_PROJECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("to_qkv", ("to_q", "to_k", "to_v")),
    ("to_kv", ("to_k", "to_v")),
    ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
)


def _live_fusions(every: dict[str, torch.nn.Module]) -> dict[str, tuple[Piece, ...]]:
    out: dict[str, tuple[Piece, ...]] = {}
    for path, module in every.items():
        if not getattr(module, "fused_projections", False):
            continue
        for fused, parts in FUSED_PROJECTIONS:
            names = [f"{path}.{p}" if path else p for p in parts]
            target = f"{path}.{fused}" if path else fused
            if target not in every or not all(n in every for n in names):
                continue
            start = 0
            for name in names:
                rows = out_rows(every[name])
                out[name] = (Piece(target, 0, start, rows, False),)
                start += rows
    return out


# cloneofsimo positions count Linears in the child order of the diffusers and transformers classes its
# trainer walked, by class name; a host that registers the same children in another order is walked in
# this one, so a position names the same layer on every tree.
CANONICAL_CHILD_ORDER: dict[str, tuple[str, ...]] = {
    "BasicTransformerBlock": ("attn1", "ff", "attn2"),  # diffusers releases of the time: ff before attn2
    "CLIPAttention": ("k_proj", "v_proj", "q_proj", "out_proj"),  # transformers; ComfyUI's holds q, k, v
    "UNetModel": ("input_blocks", "output_blocks", "middle_block"),  # ldm's UNet: diffusers' down, up, mid
}


def _canonical_named_modules(module: torch.nn.Module, prefix: str = ""):
    yield prefix, module
    children = dict(module.named_children())
    first = [c for c in CANONICAL_CHILD_ORDER.get(type(module).__name__, ()) if c in children]
    for name in (*first, *(c for c in children if c not in first)):
        yield from _canonical_named_modules(children[name], f"{prefix}.{name}" if prefix else name)


def metadata_alpha_of(module: torch.nn.Module) -> str | None:
    """The `__metadata__` field in which the trainers of this model's architecture record one network alpha
    for every module (MiniMax-H3: `alpha`); None for the rest."""
    cls = type(module).__name__
    return next((t.metadata_alpha for t in arch_tables() if cls in t.classes and t.metadata_alpha), None)


def arch_name(module: torch.nn.Module) -> str:
    cls = type(module).__name__
    return next((t.name for t in arch_tables() if cls in t.classes), cls)


class AliasTable:
    """Resolve a file's module path (dotted, underscored, original or diffusers) to pieces of live modules."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.root = module
        tables = _tables_of(module)
        every = dict(module.named_modules())
        self.modules = {name: mod for name, mod in every.items() if out_rows(mod) is not None}
        self.model_inputs = {i.module: i for t in tables for i in t.model_inputs}
        self.metadata_alpha = metadata_alpha_of(module)
        self.variant_inputs = {(v.module, v.width): v.why for t in tables for v in t.variant_inputs}
        self.renames = (
            tuple(r for t in tables for r in t.renames),
            tuple(r for t in tables for r in t.prefix_renames),
        )
        self.exact, self.fusion_names = _exact_names(module, every, self.modules)
        self.underscored = _underscored_names(self.exact)
        # Names whose rows some producers order differently: {trait: {name in both spellings: pieces}}.
        self.by_trait = _trait_names(module, every, tables)
        self.params = _parameter_names(module, self.modules)
        self.absent = _absent_names(module, every, self.exact)
        self.unmapped = _unmapped_names(tables, every)
        self.column_splits = _column_split_names(tables, every)
        self.interleaved = {
            k: v
            for t in tables
            for e in t.interleaved_rows
            for k, v in expand_interleaved_rows(e, every).items()
        }
        self._positional: dict[tuple[str, ...], list[str]] = {}

    def param(self, path: str) -> tuple[str, bool] | None:
        """(live parameter path, reshape) for a bare parameter named `path` in any spelling; None when
        none."""
        if path in self.exact:
            return None
        found = self.params.get(path) or self.params.get(underscore_form(path))
        if found is None and any(self.renames):
            found = self.params.get(apply_renames(path, *self.renames))
        return found

    def expected_absent(self, path: str) -> str | None:
        """Why `path` names a module only a sibling variant of this architecture has; None when it does
        not."""
        return self.absent.get(path) or self.absent.get(underscore_form(path))

    def unmapped_why(self, path: str, pieces: tuple[Piece, ...] = ()) -> str | None:
        """Why `path`, or a module its `pieces` land on, is held in a layout no key maps onto exactly (the
        table's `unmapped`); None when it is not."""
        found = self.unmapped.get(path) or self.unmapped.get(underscore_form(path))
        return found or next((self.unmapped[p.module] for p in pieces if p.module in self.unmapped), None)

    def column_split(self, path: str) -> tuple[Columns, ...] | None:
        """The live modules and input columns of a layer the runtime splits by columns; None when `path` is
        no such layer."""
        return self.column_splits.get(path) or self.column_splits.get(underscore_form(path))

    def row_chunks(self, module: str) -> int | None:
        """How many output chunks the runtime interleaves per unit in live `module`; None when it does not."""
        return self.interleaved.get(module)

    def variant_input(self, module: str, width: int | None) -> str | None:
        """Why an adapter trained on `width` input columns of `module` belongs to a sibling variant; None if
        not."""
        live = module_shape(self.modules[module]) if module in self.modules else None
        if width is None or live is None or len(live) != 2 or live[1] == width:
            return None
        return self.variant_inputs.get((module, width))

    def latent_width(self, model_input: ModelInput) -> int | None:
        """The latent width `model_input` starts from (its latents module's output rows); None if absent."""
        module = self.modules.get(model_input.latents)
        return out_rows(module) if module is not None else None

    def positional(self, ancestor_classes: tuple[str, ...]) -> list[str]:
        """Linear layers in cloneofsimo's enumeration order: each ancestor of the named classes, then its
        Linears, children walked in CANONICAL_CHILD_ORDER whatever order this tree registered them in."""
        if ancestor_classes not in self._positional:
            found = []
            for name, ancestor in _canonical_named_modules(self.root):
                if type(ancestor).__name__ in ancestor_classes:
                    for sub, mod in _canonical_named_modules(ancestor):
                        if isinstance(mod, torch.nn.Linear):
                            found.append(f"{name}.{sub}" if name else sub)
            self._positional[ancestor_classes] = found
        return self._positional[ancestor_classes]

    def lookup(self, path: str, traits: frozenset[str] = frozenset()) -> tuple[Piece, ...] | str | None:
        """Pieces for `path`, AMBIGUOUS when underscores cannot tell two modules apart, None when absent.

        traits: the file's (formats.adapter.FILE_TRAITS); a name some of them map otherwise is looked up
        there."""
        for trait in traits & self.by_trait.keys():
            found = self.by_trait[trait].get(path) or self.by_trait[trait].get(underscore_form(path))
            if found is not None:
                return found
        if path in self.exact:
            return self.exact[path]
        found = self.underscored.get(underscore_form(path))
        if found is None and any(self.renames):  # original names that differ by the converter's renames
            renamed = apply_renames(path, *self.renames)
            found = self.exact.get(renamed) or self.underscored.get(underscore_form(renamed))
            if found is None:
                found = self.underscored.get(apply_renames(underscore_form(path), *self.renames, sep="_"))
        return found


# The steps of AliasTable.__init__, each deriving one of its maps.


def _tables_of(module: torch.nn.Module) -> list[ArchTable]:
    """The architecture tables that describe this module's class."""
    cls = type(module).__name__
    return [t for t in arch_tables() if cls in t.classes]


def _add_missing(exact: dict[str, tuple[Piece, ...]], names: dict[str, tuple[Piece, ...]]) -> None:
    """Add the names `exact` does not hold yet; a name it holds keeps its pieces."""
    exact.update({k: v for k, v in names.items() if k not in exact})


def _live_names(modules: dict[str, torch.nn.Module]) -> dict[str, tuple[Piece, ...]]:
    """Every live module with output rows, under its own path: one piece spanning all of it."""
    return {name: (Piece(name, 0, 0, out_rows(mod), True),) for name, mod in modules.items()}


def missing_file_prefix(module: torch.nn.Module) -> str:
    """The level (PATH_PREFIX_ALIASES) files write above this tree's paths and the tree lacks; "" when none:
    what a writer puts back so trainers and UIs that expect it (kohya, diffusers, ComfyUI) read the names."""
    prefix = PATH_PREFIX_ALIASES.get(type(module).__name__)
    if not prefix or any(name.startswith(prefix) for name, _ in module.named_modules()):
        return ""
    return prefix


def _path_prefix_names(
    module: torch.nn.Module, modules: dict[str, torch.nn.Module], exact: dict[str, tuple[Piece, ...]]
) -> dict[str, tuple[Piece, ...]]:
    """Names under the level (PATH_PREFIX_ALIASES) files write and this release's tree lacks; {} when it has
    it."""
    prefix = PATH_PREFIX_ALIASES.get(type(module).__name__)
    if not prefix or any(name.startswith(prefix) for name in modules):
        return {}
    return {prefix + k: v for k, v in exact.items()}


def _add_wrapper_names(exact: dict[str, tuple[Piece, ...]]) -> None:
    """Add the names files write for the live tree's wrapper levels (WRAPPER_PREFIXES), in their order."""
    live = list(exact.items())
    for live_prefix, file_prefix in WRAPPER_PREFIXES:
        cut = len(live_prefix)
        _add_missing(exact, {file_prefix + k[cut:]: v for k, v in live if k.startswith(live_prefix)})


def _exact_names(
    module: torch.nn.Module, every: dict[str, torch.nn.Module], modules: dict[str, torch.nn.Module]
) -> tuple[dict[str, tuple[Piece, ...]], set[str]]:
    """(every exact spelling -> pieces, the names only runtime fusions give). Live paths come first; original
    names, then runtime-fusion names, fill what they leave; live fusions override; prefixed spellings
    follow."""
    exact = _live_names(modules)
    _add_missing(exact, original_names(module, every))
    runtime = original_names(module, every, runtime_fusions=True)
    fusion_names = set(runtime) - set(exact)
    _add_missing(exact, runtime)
    exact.update(_live_fusions(every))  # overrides: the separate modules are no longer used
    _add_missing(exact, _path_prefix_names(module, modules, exact))
    _add_wrapper_names(exact)
    return exact, fusion_names


def _underscored_names(exact: dict[str, tuple[Piece, ...]]) -> dict[str, tuple[Piece, ...] | str]:
    """Exact names with '.' written '_'; AMBIGUOUS where two names with different pieces meet."""
    out: dict[str, tuple[Piece, ...] | str] = {}
    for name, pieces in exact.items():
        key = underscore_form(name)
        previous = out.get(key)
        out[key] = AMBIGUOUS if previous is not None and previous != pieces else pieces
    return out


def _trait_names(
    module: torch.nn.Module, every: dict[str, torch.nn.Module], tables: list[ArchTable]
) -> dict[str, dict[str, tuple[Piece, ...]]]:
    """{file trait: {original name in both spellings: pieces}} for the aliases only files with that trait
    use."""
    traits = {a.when_file for t in tables for a in t.aliases if a.when_file}
    return {
        trait: {
            form: pieces
            for name, pieces in original_names(module, every, trait=trait).items()
            for form in (name, underscore_form(name))
        }
        for trait in traits
    }


def _parameter_names(
    module: torch.nn.Module, modules: dict[str, torch.nn.Module]
) -> dict[str, tuple[str, bool]]:
    """Bare parameters by live and original name, plus the underscored spellings no other name holds."""
    params = bare_parameters(module, type(module).__name__, modules)
    params.update(
        {underscore_form(k): v for k, v in list(params.items()) if underscore_form(k) not in params}
    )
    return params


def _unmapped_names(tables: list[ArchTable], every: dict[str, torch.nn.Module]) -> dict[str, str]:
    """Names held in a layout no key maps onto exactly -> why, in both spellings."""
    out = {k: v for t in tables for entry in t.unmapped for k, v in expand_unmapped(entry, every).items()}
    out.update({underscore_form(k): v for k, v in list(out.items())})
    return out


def _column_split_names(
    tables: list[ArchTable], every: dict[str, torch.nn.Module]
) -> dict[str, tuple[Columns, ...]]:
    """Layers split by input columns -> their targets' columns, in both spellings."""
    out = {
        k: v
        for t in tables
        for split in t.column_splits
        for k, v in expand_column_split(split, every).items()
    }
    out.update({underscore_form(k): v for k, v in list(out.items())})
    return out


def _absent_names(
    module: torch.nn.Module, every: dict[str, torch.nn.Module], exact: dict[str, tuple[Piece, ...]]
) -> dict[str, str]:
    """Names only a sibling variant has -> why, in both spellings (the underscored one wins a clash)."""
    absent = _variant_only(type(module).__name__, every, exact)
    absent.update({underscore_form(k): v for k, v in list(absent.items())})
    return absent
