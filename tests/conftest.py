import json
import sys
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where torch finds none (CI here)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not the tests/gpu folder's name
            item.add_marker(skip)


class Printed(NamedTuple):
    """A command's exit code and what it printed (``code, out, err = run_main(...)``)."""

    code: int
    out: str
    err: str

    def last_json(self) -> dict:
        """The JSON object a command prints as its last line of stdout (``generate``'s result)."""
        return json.loads(self.out.strip().splitlines()[-1])


@pytest.fixture
def run_main(capsys) -> Callable[..., Printed]:
    """``run_main(command.main, argv)``: call a command's ``main`` in this process on ``argv`` (each argument as a
    string) and return its exit code and what that call printed."""

    def run(main: Callable[[list[str]], int], argv: list) -> Printed:
        capsys.readouterr()  # what came before is not this call's
        code = main([str(a) for a in argv])
        printed = capsys.readouterr()
        return Printed(code, printed.out, printed.err)

    return run
