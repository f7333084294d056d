"""``run.py plan``'s flags: a bad one is one ``error:`` line naming it and the valid values, as train's are (argparse's
usage block is not printed)."""

from __future__ import annotations

import pytest

from runtime.commands import plan as plan_command


@pytest.mark.parametrize(("flags", "line"), [
    (["--fp8", "bogus"], "error: argument --fp8: invalid choice: 'bogus' (choose from 'tensorwise', 'rowwise', "
                         "'blockwise', 'any') (see run.py plan --help)"),
    (["--world", "8", "--bogus"], "error: unrecognized arguments: --bogus (see run.py plan --help)"),
])
def test_a_bad_flag_is_one_error_line(run_main, flags, line):
    printed = run_main(plan_command.main, flags)
    assert printed.code == 2 and printed.err.splitlines() == [line] and not printed.out, printed.err
