"""Numbered block chains in module paths (`double_blocks.3`, `single_transformer_blocks_37`, `blocks.12`): how
deep a file goes per chain. Detection (arch.detect) and variant fitting (arch.variants) both read it."""

from __future__ import annotations

import re

# Original and diffusers spellings (`.` or `_` separated). Single first: diffusers'
# `single_transformer_blocks` also ends in `_transformer_blocks`, the double chain's diffusers name.
CHAINS: dict[str, re.Pattern] = {
    "single": re.compile(r"(?:^|[._])(?:single_blocks|single_transformer_blocks)[._](\d+)(?:[._]|$)"),
    "double": re.compile(r"(?:^|[._])(?:double_blocks|transformer_blocks)[._](\d+)(?:[._]|$)"),
    "blocks": re.compile(r"^blocks[._](\d+)(?:[._]|$)"),
}


def highest_blocks(paths: list[str]) -> dict[str, tuple[int, int]]:
    """{chain: (highest block index named, position in `paths` of the first path naming it)}."""
    out: dict[str, tuple[int, int]] = {}
    for i, path in enumerate(paths):
        for chain, rx in CHAINS.items():
            m = rx.search(path)
            if m:
                if chain not in out or int(m[1]) > out[chain][0]:
                    out[chain] = (int(m[1]), i)
                break
    return out


def block_counts(paths: list[str]) -> dict[str, int]:
    """{chain: highest block index named + 1} over module paths as written in a file."""
    return {chain: top + 1 for chain, (top, _) in highest_blocks(paths).items()}


def block_indices(paths: list[str]) -> dict[str, list[int]]:
    """{chain: the block indices named, sorted}: a file touching blocks 7-20 is not a 21-block file."""
    out: dict[str, set[int]] = {}
    for path in paths:
        for chain, rx in CHAINS.items():
            m = rx.search(path)
            if m:
                out.setdefault(chain, set()).add(int(m[1]))
                break
    return {chain: sorted(found) for chain, found in out.items()}
