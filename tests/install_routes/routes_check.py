"""Every install route, as a new user takes it: a fresh virtual environment, one extra set, then its examples.

Run by ``make test-install`` (CI's step after ``make test``). Each route costs a venv and a ``pip install`` (about
30-40 s here: pip takes torch's CPU build and the other wheels from the machine's local wheel store) and its
examples' runs.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import venv

import pytest

from tests.install_routes.routes import ROUTES, Route

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(900)


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without what would let the fresh venv see another environment's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def install(route: Route, where: pathlib.Path) -> pathlib.Path:
    """A fresh venv at ``where`` with ``pip install -e "<repo>[extras]"``; returns its python."""
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-e", route.requirement],
                          cwd=REPO, capture_output=True, text=True, env=clean_environment({}), timeout=600)
    assert done.returncode == 0, f"pip install -e {route.requirement!r} failed:\n{done.stderr[-4000:]}"
    return python


@pytest.mark.parametrize("route", ROUTES, ids=[r.name for r in ROUTES])
def test_route_installs_and_runs_its_examples(route: Route, tmp_path: pathlib.Path) -> None:
    python = install(route, tmp_path / "venv")
    for run in route.runs:
        workdir = tmp_path / pathlib.Path(run.script).stem
        workdir.mkdir()
        done = subprocess.run([str(python), str(REPO / run.script), *run.args], cwd=workdir, capture_output=True,
                              text=True, env=clean_environment(dict(run.env)), timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{run.script} in route {route.name!r} failed:\n{output[-4000:]}"
        for pattern in run.expect:
            assert re.search(pattern, output), f"{run.script} printed nothing matching {pattern!r}:\n{output[-3000:]}"
        if run.check is not None:
            run.check(output, workdir)
