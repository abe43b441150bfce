"""Every install command the README, the Makefile and docs/ print is a route that CI installs and runs.

``make test-install`` (tests/install_routes/routes_check.py) installs each route of
``tests/install_routes/routes.py`` into a fresh venv and runs its examples; this cheap check fails when a page
names an extra set that no route installs, so the next "the README's command misses a package" is caught in CI.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

from tests.install_routes.routes import CHECKED_ELSEWHERE, ROUTES

REPO = pathlib.Path(__file__).resolve().parent.parent

# `pip install -e ".[a,b]"` (a clone, leading to its examples), `pip install 'daskdist[a]'` (the library, for the
# user's own code)
EXTRAS_IN_COMMAND = re.compile(r"""pip install[^\n`]*?(daskdist|-e\s+["']?\.?)\[([a-z0-9_,\s-]+)\]""")


def documented_extra_sets(kind: str) -> dict[frozenset[str], list[str]]:
    """Each extra set that an install command of ``kind`` ("clone": ``-e .[...]``, "library": ``daskdist[...]``) in
    the README, the Makefile or docs/ names, with where it is named."""
    pages = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    found: dict[frozenset[str], list[str]] = {}
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in EXTRAS_IN_COMMAND.finditer(line):
                if (match.group(1) == "daskdist") != (kind == "library"):
                    continue
                extras = frozenset(e.strip() for e in match.group(2).split(",") if e.strip())
                found.setdefault(extras, []).append(f"{page.relative_to(REPO)}:{number}")
    return found


def test_the_scan_finds_the_install_commands_the_pages_print():
    clones = documented_extra_sets("clone")
    assert frozenset({"keras", "examples"}) in clones  # the README's Keras 3 route (`make run`)
    assert frozenset({"test", "examples"}) in clones  # the Makefile's test install
    assert frozenset({"keras"}) in documented_extra_sets("library")  # docs/keras3.md


def test_every_clone_install_a_page_prints_is_exactly_a_route_ci_installs_and_runs():
    routes = {frozenset(route.extras) for route in ROUTES}
    untested = {tuple(sorted(extras)): where for extras, where in documented_extra_sets("clone").items()
                if extras not in routes and not extras & CHECKED_ELSEWHERE}
    assert not untested, f"install commands no route installs and runs (add a route or fix the page): {untested}"


def test_every_library_extra_a_page_names_is_inside_a_route():
    routes = {frozenset(route.extras) for route in ROUTES}
    untested = {tuple(sorted(extras)): where for extras, where in documented_extra_sets("library").items()
                if not any(extras - CHECKED_ELSEWHERE <= r for r in routes)}
    assert not untested, f"extras no route installs (add a route or fix the page): {untested}"


def test_routes_use_only_declared_extras_and_every_user_extra_has_a_route():
    declared = set(importlib.metadata.metadata("daskdist").get_all("Provides-Extra") or ())
    assert {"keras", "examples"} <= declared
    in_routes = {extra for route in ROUTES for extra in route.extras}
    assert in_routes <= declared
    assert declared - in_routes <= CHECKED_ELSEWHERE, declared - in_routes - CHECKED_ELSEWHERE
