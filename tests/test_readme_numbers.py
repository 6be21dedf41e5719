"""The documentation's measured numbers (README.md, docs/*.md) are copies of what their commands wrote
(scripts/readme_numbers.py lists every block, its source file and the command that writes it): a number typed by hand,
or a source re-measured without copying, fails here."""

from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest

from scripts.readme_numbers import BLOCKS, REPO, block_names, page_of, pages, read_block


def test_every_block_in_the_pages_has_a_source_and_a_command_and_one_page():
    found = Counter(name for page in pages() for name in block_names(page.read_text()))
    assert set(found) == {b.name for b in BLOCKS}, "list the block in scripts/readme_numbers.py BLOCKS"
    assert [n for n, k in found.items() if k > 1] == [], "a block stands on one page only"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_the_block_is_its_sources_copy(block):
    assert block.source.is_file(), f"{block.source} is missing: run `{block.command}`"
    page = page_of(block.name)
    assert read_block(page.read_text(), block.name) == block.render(block.source), (
        f"{page.relative_to(REPO)} block {block.name} differs from {block.source}: run "
        "`python scripts/readme_numbers.py`")


def test_the_documents_the_readme_links_exist():
    """The README's index and the pages' links to one another point at pages that are there."""
    for page in pages():
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page.relative_to(REPO)} links {target}, not there"


PATCHES = sorted((REPO / "benchmarks" / "patches").glob("*.patch"))


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_the_readmes_knockout_patches_still_apply(patch):
    """The documented A/B numbers of the gateway's stages come from these patches (benchmarks/gateway/bench_ceiling_ab.py
    --b-patch); one the code has moved away from could not measure them again."""
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, f"{patch.name} no longer applies: {check.stderr}"
