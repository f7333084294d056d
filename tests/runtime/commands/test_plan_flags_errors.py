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


@pytest.mark.parametrize(("flags", "start"), [
    (["--cluster", "a100-80gb", "--model", "deepseek-v3", "--world", "64", "--fp8", "blockwise"], "error: --fp8: "),
    (["--cluster", "h100-80gb", "--model", "llama3-8b", "--world", "8", "--cp-gather", "latent"],
     "error: --cp-gather latent needs multi-head latent attention"),
])
def test_a_plan_no_search_can_hold_is_one_error_line_before_any_output(run_main, flags, start):
    printed = run_main(plan_command.main, flags)
    assert printed.code == 2 and not printed.out, printed.out
    assert len(printed.err.splitlines()) == 1 and printed.err.startswith(start), printed.err
