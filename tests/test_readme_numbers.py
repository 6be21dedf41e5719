"""The README's measured numbers are copies of what their commands wrote (scripts/readme_numbers.py lists every block,
its source file and the command that writes it): a number typed by hand, or a source re-measured without copying,
fails here."""

from __future__ import annotations

import subprocess

import pytest

from scripts.readme_numbers import BLOCKS, README, block_names, read_block


def test_every_block_in_the_readme_has_a_source_and_a_command():
    listed = {b.name for b in BLOCKS}
    assert set(block_names(README.read_text())) == listed, "list the block in scripts/readme_numbers.py BLOCKS"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_the_readme_block_is_its_sources_copy(block):
    assert block.source.is_file(), f"{block.source} is missing: run `{block.command}`"
    assert read_block(README.read_text(), block.name) == block.render(block.source), (
        f"README block {block.name} differs from {block.source}: run `python scripts/readme_numbers.py`")


PATCHES = sorted((README.parent / "benchmarks" / "patches").glob("*.patch"))


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_the_readmes_knockout_patches_still_apply(patch):
    """The README's A/B numbers of the gateway's stages come from these patches (benchmarks/bench_ceiling_ab.py
    --b-patch); one the code has moved away from could not measure them again."""
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=README.parent, capture_output=True, text=True)
    assert check.returncode == 0, f"{patch.name} no longer applies: {check.stderr}"
