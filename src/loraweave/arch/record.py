"""One declarative record per architecture: every fact the package keeps about it, each facet None (or empty)
where it does not apply. Records live in their architecture's module (arch/<x>.py); arch/registry.py lists
them once, and detection (arch/detect.py), the catalog, the block maps and scripts/support_matrix.py iterate
that list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .spec import ArchTable


@dataclass(frozen=True)
class Widths:
    """Names told apart by an input width: the first part whose underscore path matches `pattern` and whose
    `down` factor has one of `names`' input widths names the release. `same_width`: a second pattern whose
    parts must read the same width (else no release is named)."""

    pattern: str
    names: dict[int, str]
    same_width: str | None = None


@dataclass(frozen=True)
class Skeleton:
    """A full-size skeleton on the meta device: a diffusers class and the config numbers of its shapes."""

    denoiser: str  # component name diffusers pipelines use ("unet" / "transformer")
    cls: str  # diffusers class
    config: dict
    text_encoders: dict[str, tuple[str, dict]] = field(default_factory=dict)  # component -> (cls, cfg)
    source: str = ""
    # Other diffusers components the file's denoiser keys may target (Anima's LLM adapter): component -> (cls,
    # cfg).
    components: dict[str, tuple[str, dict]] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockMap:
    """Block-weight slots. `key`: the name block weights take (`zimage`, `qwen_image`: their historical
    spellings). DiTs: `chains`, (slot prefix, module chain, default length) in execution order. UNets: `unet`,
    (down blocks, the A1111 LBW short layout, (last shallow input index, first shallow output index) for the
    presets)."""

    key: str
    chains: tuple[tuple[str, str, int], ...] = ()
    unet: tuple[int, tuple[str, ...], tuple[int, int]] | None = None


@dataclass(frozen=True)
class Layouts:
    """A row of docs/support-matrix.md's original-name layouts: (heading, layouts, checked against, tests)."""

    heading: str
    layouts: str
    checked_against: str
    tests: str


@dataclass(frozen=True)
class Release:
    """A released variant, told from its siblings by what a file shows: block count per chain (the highest
    index it names) and hidden width (its `down` factors' input)."""

    name: str
    chains: dict[str, int]
    hidden: int
    # Rows of the single block's fused `linear1` per hidden unit: q|k|v + MLP (Flux.1, HunyuanVideo: 3 + 4;
    # Flux.2: 3 + 2 * 3, SwiGLU). Tells Flux.1 from Flux.2 files that share BFL names and a 3072 width.
    single_rows: int | None = None
    catalog: str | None = None  # the full-size skeleton of exactly this variant, when the catalog has one


class ComfyConfig(Protocol):
    """ComfyUI's `unet_config` of a loaded model -> the diffusers config entries of its reference tree (the
    widths and depths the model really has), laid over the catalog skeleton's config."""

    def __call__(self, unet_config: dict, /) -> dict: ...


@dataclass(frozen=True)
class ComfyFacets:
    """How ComfyUI holds the architecture, for the node pack (comfy/): a ComfyUI model resolves adapter keys
    on the catalog skeleton's diffusers tree at the model's own widths, then writes onto ComfyUI's module
    names."""

    # ComfyUI's supported_models class names; a subclass of one maps through its nearest listed base.
    classes: tuple[str, ...]
    config: ComfyConfig | None = None  # None: the catalog's config stands as it is
    # {config key: block chain paths}: a model that differs from the shipped skeleton only in these keys gets
    # that skeleton with its chains cut or repeated.
    depths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # {config key: (module path, axis, the key whose value stands where this one is None)}: keys that set only
    # the width of one layer's weight (Flux Fill's 384 input channels); the shipped skeleton serves them
    # resized.
    widths: dict[str, tuple[str, int, str | None]] = field(default_factory=dict)
    skeleton: str | None = None  # the reference skeleton the pack ships (comfy/skeletons/<name>.json), if any


@dataclass(frozen=True)
class Depths:
    """Depth-expanded variants of one block chain (Anima 28 -> 40: a LLaMA-Pro block expansion that inserts
    new blocks between the trained ones). `path`: a regex over a denoiser part's path whose group `index` is
    its block index; `chain`: the live chain the model's depth is counted on; `known`: the released depths a
    file's highest block index is snapped up to; `inserted`: (file depth, model depth) -> the model's block
    indices that are new (a file's block i lands on the i-th index not listed). A pair not listed is
    refused."""

    chain: str
    path: str
    known: tuple[int, ...]
    inserted: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    source: str = ""  # where the inserted positions were read


MODALITIES = ("video", "audio", "cross")  # the modality names a request may scale


@dataclass(frozen=True)
class Modalities:
    """Which modules serve which modality of an audio-video model, for per-modality strengths: `rules`,
    (modality, regex matched at the start of `component.module` of the live tree), first match wins; a
    denoiser module no rule names takes `default`; text encoders are never scaled by modality."""

    rules: tuple[tuple[str, str], ...]
    default: str = "video"


@dataclass(frozen=True)
class Architecture:
    name: str  # the name detection answers and the catalog keys
    # Alias tables (original names -> live modules); the first is the architecture's own, any others (text
    # connectors, names a sibling variant adds) follow.
    tables: tuple[ArchTable, ...] = ()
    # Detection: a key-name regex over underscore paths; the registry's order is the precedence, most specific
    # first.
    signature: str | None = None
    # This record's names are shared: they count for the first of these architectures whose own names the file
    # has.
    owners: tuple[str, ...] = ()
    # Shared names no owner claimed, told apart by width (for a family: the release each width names).
    widths: Widths | None = None
    # (architecture whose names these files share, block count per chain): told apart from it by how deep the
    # file goes.
    depth: tuple[str, dict[str, int]] | None = None
    skeleton: Skeleton | None = None
    cli_names: tuple[str, ...] = ()  # other names users (and detection families) give for it
    blocks: BlockMap | None = None
    layouts: Layouts | None = None  # its row in the support matrix's original-name layouts
    not_mapped: tuple[str, str] | None = None  # (heading, state) in the support matrix's "Not mapped" table
    releases: tuple[Release, ...] = ()  # released variants inspect tells apart (block counts, width)
    comfy: ComfyFacets | None = None  # how ComfyUI's node pack finds and builds its reference tree
    label: str = ""  # what users call it ("SD1.5", "Flux"), for messages; the name where empty
    # Architectures whose files a model of this one takes as its own although detection names them apart (a
    # derived model: Chroma takes Flux LoRAs); arch/fit.py adds class siblings and shared-name owners itself.
    takes: tuple[str, ...] = ()
    depths: Depths | None = None  # depth-expanded variants and where their blocks were inserted
    modalities: Modalities | None = None  # audio-video models: which modules are audio, video, cross-modal

    @property
    def metadata_alpha(self) -> str | None:
        """The `__metadata__` field its trainers record one network alpha in (its tables say; MiniMax-H3:
        alpha)."""
        return next((t.metadata_alpha for t in self.tables if t.metadata_alpha), None)
