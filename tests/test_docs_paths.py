"""What the pages name exists: every repository path in the README, docs/ and BENCHMARKS.md, and every module.

A page names a path as ``daskdist/strategy/mirrored.py`` (from the repository root), as ``strategy/mirrored.py`` or
``mirrored.py`` inside a section about its package, as a folder (``daskdist/ps/``) or a module without its suffix
(``daskdist/group/handle``), and a module as ``daskdist.plugins.torch``. Each must exist in this checkout, so a
move or a rename that forgets a page fails here.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The pages checked: the front page, every page under docs/, the benchmark figures, and any contributor guide.
PAGES = sorted({ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("CONTRIBUTING*")})

#: The repository's top folders: a path that starts with one of them is read from the repository root.
TOP_FOLDERS = ("daskdist", "tests", "benchmarks", "examples", "docs", "scripts", "dashboards", ".ci")
#: Folders a page's shorter paths are read from (``strategy/mirrored.py`` means ``daskdist/strategy/mirrored.py``).
BASES = ("", "daskdist", "benchmarks", "tests", "docs")
SUFFIXES = ("py", "md", "toml", "yaml", "yml", "ipynb", "json", "sh", "cfg", "txt")

#: A token shaped like a path: segments joined by ``/`` or one file name with a known suffix.
PATH_TOKEN = re.compile(
    r"(?<![\w./:@~$\"'-])"
    rf"((?:\.?[A-Za-z_][\w.-]*/)+(?:[\w.-]+)?|[\w-]+\.(?:{'|'.join(SUFFIXES)}))"
    r"(?![\w/(])")
#: A module named in code quotes: ``daskdist.a.b`` (an attribute after the module is read from its source); a
#: configuration key (``daskdist.collective.timeout``, hyphens included) is told apart by ``CONFIG_KEYS``.
MODULE_TOKEN = re.compile(r"`(daskdist(?:\.[\w-]+)+)")

#: File names the pages quote from other projects (TensorFlow's sources and tests the ports follow,
#: dask-labextension's layout file).
OTHER_PROJECTS = re.compile(r"^(\w+_test\.py|distribute_lib\.py|collective_util\.py|strategy_test_lib\.py|"
                            r"individual-plots\.json)$")
#: Ratios in table headers, not paths: daskdist/TF, daskdist/gloo.
RATIO = re.compile(r"^daskdist/(TF|tf|gloo|MPI|torch|DDP)$")


@functools.cache
def _files_named(name: str) -> bool:
    return any(p for p in ROOT.rglob(name) if ".git" not in p.parts and ".venv" not in p.parts)


def path_exists(token: str, context: pathlib.Path | None = None, page_folder: pathlib.Path = ROOT) -> bool:
    """Whether ``token``, a path as a page writes it, names a file or folder of this checkout.

    A bare file name is looked for in ``context`` (the folder the paragraph is about) and the folders above it,
    or, in a paragraph about no folder, anywhere in the repository; a relative path (``nccl/engine.py``) in
    ``context`` and the folders above it first, then from the repository's roots.
    """
    token = token.rstrip(".,;:")
    if token.endswith(".md"):  # a link: from the page's folder, or the repository's root
        return (page_folder / token).exists() or (ROOT / token).exists()
    if "/" not in token and context is not None:
        return any((folder / token).exists() for folder in (context, *context.parents) if ROOT in (folder, *folder.parents))
    if context is not None and any((folder / token).exists() for folder in (context, *context.parents)
                                   if ROOT in (folder, *folder.parents)):
        return True
    first = token.split("/", 1)[0]
    bases = ("",) if first in TOP_FOLDERS else BASES
    for base in bases:
        candidate = ROOT / base / token
        if candidate.exists() or candidate.with_name(candidate.name + ".py").exists():
            return True
    if "/" not in token:  # a bare file name: somewhere in the repository
        return _files_named(token)
    return False


def folder_of(token: str) -> pathlib.Path | None:
    """The folder a package path (``daskdist/ps/``, ``daskdist/group/handle``, ``strategy/``) is about.

    Only the library's and the benchmarks' paths (folders or Python modules) set the folder a paragraph is about.
    """
    token = token.rstrip(".,;:")
    first = token.split("/", 1)[0]
    if first not in ("daskdist", "benchmarks") and not token.endswith("/"):
        return None
    if "." in token.rsplit("/", 1)[-1] and not token.endswith(".py"):
        return None
    for base in ("",) if token.split("/", 1)[0] in TOP_FOLDERS else BASES:
        candidate = ROOT / base / token.rstrip("/")
        if candidate.is_dir():
            return candidate
        if candidate.with_name(candidate.name + ".py").exists() or candidate.is_file():
            return candidate.parent
    return None


def is_path(token: str) -> bool:
    """Whether a path-shaped token is meant as a repository path (not ``samples/s``, ``A/B`` or ``float16/32``)."""
    token = token.rstrip(".,;:")
    if "/" not in token:
        return not OTHER_PROJECTS.match(token)
    if RATIO.match(token):
        return False
    first = token.split("/", 1)[0]
    if first in TOP_FOLDERS:
        return True
    return token.rsplit(".", 1)[-1] in SUFFIXES and "." in token.rsplit("/", 1)[-1] or token.endswith("/") and (
        ROOT / "daskdist" / first).is_dir()


@functools.cache
def config_keys() -> frozenset[str]:
    """Every ``daskdist.*`` configuration key of ``daskdist.yaml`` and each key's parents."""
    keys: set[str] = set()

    def walk(prefix: str, node: object) -> None:
        keys.add(prefix)
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}", value)

    for key, value in yaml.safe_load((ROOT / "daskdist" / "daskdist.yaml").read_text()).items():
        walk(key, value)
    return frozenset(keys)


def module_exists(dotted: str) -> bool:
    """Whether ``daskdist.a.b[.name]`` is a module of this checkout, a name its longest module defines, a
    configuration key (or a group of keys), or a file (``daskdist.yaml``)."""
    if dotted in config_keys() or path_exists(dotted):
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            rest = parts[cut:]
            return not rest or rest[0] in _top_level_names(source)
    return False


@functools.cache
def _top_level_names(source: pathlib.Path) -> set[str]:
    """The names a module binds at its top (and in its lazy ``__getattr__`` table, read as string constants)."""
    tree = ast.parse(source.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    if "__getattr__" in names or "__all__" in names:
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    if source.name == "__init__.py":
        names.update(p.stem for p in source.parent.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    return names


def named_paths(page: pathlib.Path) -> list[tuple[int, str, pathlib.Path | None]]:
    """``(line, path, folder)`` for every repository path ``page`` names, with the folder its paragraph is about."""
    found = []
    context = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if not line.strip():
            context = None
        for match in PATH_TOKEN.finditer(line):
            token = match.group(1)
            if is_path(token):
                found.append((number, token, context))
                context = folder_of(token) or context
    return found


def named_modules(page: pathlib.Path) -> list[tuple[int, str]]:
    return [(number, match.group(1)) for number, line in enumerate(page.read_text().splitlines(), 1)
            for match in MODULE_TOKEN.finditer(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_exists(page):
    missing = [f"{page.relative_to(ROOT)}:{number}: {token}" for number, token, context in named_paths(page)
               if not path_exists(token, context, page.parent)]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_a_page_names_exists(page):
    missing = [f"{page.relative_to(ROOT)}:{number}: {dotted}" for number, dotted in named_modules(page)
               if not module_exists(dotted)]
    assert missing == []


def test_the_scan_reads_the_shapes_pages_write_and_finds_what_is_gone(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "mirrored.py, `daskdist/strategy/mirrored.py` and strategy/mirrored.py, mirrored.py; daskdist/group/handle, `daskdist/ps/`\n"
        "store.py, mirrored.py\n\n"
        "[link](docs/elastic.md) and plugins/torch.py and daskdist/gone.py; gone_module.py\n\n"
        "samples/s, A/B, float16/32, TF's values_test.py; `daskdist.plugins.torch` `daskdist.elastic.ElasticOptions`\n"
        "`daskdist.no_such_module` `daskdist.elastic.no_such_name` `daskdist.collective.timeout` `daskdist.yaml`\n"
        "`daskdist.collective.no-such-key`\n")
    paths = [(token, context and context.relative_to(ROOT).as_posix()) for _, token, context in named_paths(page)]
    assert paths == [("mirrored.py", None), ("daskdist/strategy/mirrored.py", None),
                     ("strategy/mirrored.py", "daskdist/strategy"), ("mirrored.py", "daskdist/strategy"),
                     ("daskdist/group/handle", "daskdist/strategy"), ("daskdist/ps/", "daskdist/group"),
                     ("store.py", "daskdist/ps"), ("mirrored.py", "daskdist/ps"),  # not in ps/: missing
                     ("docs/elastic.md", None), ("plugins/torch.py", None), ("daskdist/gone.py", None),
                     ("gone_module.py", None), ("daskdist.yaml", None)]
    missing = [token for _, token, context in named_paths(page) if not path_exists(token, context)]
    assert missing == ["mirrored.py", "plugins/torch.py", "daskdist/gone.py", "gone_module.py"]
    modules = [dotted for _, dotted in named_modules(page)]
    assert [m for m in modules if not module_exists(m)] == [
        "daskdist.no_such_module", "daskdist.elastic.no_such_name", "daskdist.collective.no-such-key"]
# -- the README's examples, the Makefile's runs and the packaging -------------------------------------------



def test_readme_lists_every_example_and_says_what_an_existing_cluster_needs():
    readme = (ROOT / "README.md").read_text()
    for example in sorted((ROOT / "examples").iterdir()):
        if example.suffix in (".py", ".ipynb") and not example.name.startswith("_"):  # _digits.py: shared set-up
            assert f"examples/{example.name}" in readme, example.name
    assert "need daskdist installed" in readme
    assert 'pip install -e ".[torch,examples]"' in readme  # how torch gets installed for examples/pytorch_plugin.py
    # the learning-rate claim says which schedule the digits run uses
    assert "3e-3 -> 1e-3 -> 3e-4" in readme and "3e-3 if epoch < 6 else (1e-3 if epoch < 10 else 3e-4)" in (
        ROOT / "examples" / "mnist_mirrored.py").read_text()


def test_quickstart_does_not_call_itself_make_run():
    first_line = (ROOT / "examples" / "quickstart.py").read_text().split("\n", 1)[0]
    assert "make run" not in first_line
    makefile = (ROOT / "Makefile").read_text()
    assert "keras3_mnist.py" in makefile.split("\nrun:", 1)[1].split("\n\n", 1)[0]  # the Keras 3 tutorial
    assert "mnist_mirrored.py" in makefile.split("\nrun-builtin:", 1)[1].split("\n\n", 1)[0]


def test_pyproject_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "BSD-3-Clause"  # the table form is deprecated by setuptools >= 77
    assert "setuptools>=77" in project["build-system"]["requires"]  # PEP 639 strings need setuptools 77


# -- anchors and sizes ----------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]*?)(?:#([^)\s]+))?\)")


def heading_anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub makes of ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_to_a_section_finds_its_heading(page):
    broken = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for target, anchor in LINK.findall(line):
            if not anchor or target.startswith("http"):
                continue
            linked = page if not target else (page.parent / target)
            if linked.suffix == ".md" and linked.exists() and anchor not in heading_anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target}#{anchor}")
    assert broken == []


def test_the_front_page_and_the_figures_stay_short():
    """README is a front page (the rest lives in docs/); BENCHMARKS keeps the latest figures only."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 900


def test_every_docs_page_is_in_both_indexes():
    """docs/README.md and the front page's table list every page of docs/ (a new page is found from both)."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    index = set(re.findall(r"\]\(([\w-]+\.md)", (ROOT / "docs" / "README.md").read_text()))
    front = set(re.findall(r"\]\(docs/([\w-]+\.md)", (ROOT / "README.md").read_text()))
    assert pages - index == set()
    assert pages - front == set()
