"""The install routes the README and docs name: an extra set, then the examples that route leads to.

Each route is installed alone into a fresh virtual environment by ``routes_check.py`` (``make test-install``, run
by CI) and its examples are run there as a user runs them, so an example importing something its route does not
install fails CI. ``tests/test_install_routes_documented.py`` (in ``make test``) checks that every install command
the README, the Makefile and ``docs/`` print is one of these routes, or an extra checked by a CI step of its own.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ExampleRun:
    """One example script run inside a route's environment, from an empty working directory.

    Parameters
    ----------
    script
        Path of the example, relative to the repository root.
    args
        Command-line arguments: short runs, except the Keras 3 tutorial's (`make run`'s job), whose full checks
        live here; tests/test_examples.py runs the others at length in the test venv.
    env
        Extra environment variables (``KERAS_BACKEND``).
    expect
        Regular expressions the script's output must match.
    check
        Further checks of the output and the working directory.
    """

    script: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    expect: tuple[str, ...] = ()
    check: Callable[[str, pathlib.Path], None] | None = None


@dataclasses.dataclass(frozen=True)
class Route:
    """An install route: ``pip install -e ".[<extras>]"`` into a fresh venv, then its examples."""

    name: str
    extras: tuple[str, ...]
    runs: tuple[ExampleRun, ...]

    @property
    def requirement(self) -> str:
        """The argument given to ``pip install -e``."""
        return f".[{','.join(self.extras)}]" if self.extras else "."


def keras3_tutorial_checks(output: str, workdir: pathlib.Path) -> None:
    """The Keras 3 tutorial checkpointed every epoch, saved a model, and reloading it evaluates the same."""
    assert len(re.findall(r"epoch +\d+: loss [\d.]+ +accuracy [\d.]+", output)) == 6, output[-2000:]
    match = re.search(r"Eval accuracy: (0\.\d+)", output)
    assert match, output[-2000:]
    evaluated = float(match.group(1))
    reloaded = [float(a) for a in re.findall(r"eval accuracy (0\.\d+)", output)]
    assert evaluated >= 0.9 and reloaded == [evaluated, evaluated], output[-2000:]  # reloaded without, with scope
    assert sorted((workdir / "training_checkpoints").iterdir())[0].name == "ckpt_1.weights.h5"
    assert any((workdir / "logs").iterdir()) and (workdir / "model.keras").exists()


def keras3_reload_checks(output: str, workdir: pathlib.Path) -> None:
    """The tutorial saved a model and checkpoints, and the reloaded model evaluates as the trained one."""
    match = re.search(r"Eval accuracy: (0\.\d+)", output)
    assert match, output[-2000:]
    evaluated = float(match.group(1))
    reloaded = [float(a) for a in re.findall(r"eval accuracy (0\.\d+)", output)]
    assert reloaded == [evaluated, evaluated], output[-2000:]  # reloaded without, with the scope
    assert (workdir / "model.keras").exists() and any((workdir / "training_checkpoints").iterdir())


ROUTES: tuple[Route, ...] = (
    Route("base", (), (ExampleRun("examples/quickstart.py", expect=("OK: strategy closed",)),)),
    # `make run-builtin`: the built-in tf.keras-like layers, no framework
    Route("examples", ("examples",), (
        ExampleRun("examples/mnist_mirrored.py", ("--epochs", "1", "--replicas", "2", "--target", "0.5"),
                   expect=("OK: test accuracy",)),
        ExampleRun("examples/dataframe_regression.py", ("--epochs", "5"),
                   expect=("mean squared error on held-out rows",)),
    )),
    # `make run`: the tutorial with real Keras 3 on its torch backend
    Route("keras", ("keras", "examples"), (
        ExampleRun("examples/keras3_mnist.py", ("--epochs", "6", "--replicas", "2", "--target", "0.9"),
                   (("KERAS_BACKEND", "torch"),),
                   expect=(r"Number of devices: 2 \(Keras backend: torch\)", "Learning rate for epoch 6 is 0.003000",
                           "OK: test accuracy"),
                   check=keras3_tutorial_checks),
    )),
    Route("jax", ("jax", "examples"), (
        ExampleRun("examples/keras3_mnist.py", ("--epochs", "2", "--replicas", "2", "--target", "0.5"),
                   (("KERAS_BACKEND", "jax"),), expect=(r"Number of devices: 2 \(Keras backend: jax\)", "OK: test accuracy"),
                   check=keras3_reload_checks),
    )),
    Route("torch", ("torch", "examples"), (
        ExampleRun("examples/torch_ddp.py", ("--epochs", "1"), expect=("2 replicas, test accuracy",)),
        ExampleRun("examples/pytorch_plugin.py", ("--epochs", "1"), expect=("replicas, test accuracy",)),
    )),
)

# extras the README or docs may name that a CI step of their own checks, not a fresh-venv route here:
# `ucx` by `make test-ucx`, `gpu` by `make gpu-check` (a GPU machine), `test` by `make test` itself, `bench` by
# `make bench`; `dataframe` is inside `examples` (the dataframe example runs in that route)
CHECKED_ELSEWHERE = frozenset({"ucx", "gpu", "test", "bench", "dataframe"})
