"""Command implementations behind `loraweave <command>`: library code, no printing."""
