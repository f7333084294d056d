"""Hybrid-parallel GPT training on a (dp, pp, mp) mesh: the command line.

    torchrun --nproc_per_node=8 run.py --dp 2 --pp 2 --mp 2 --model tiny --precision fp16   # train
    python run.py study | plan | calibrate | export ...                                     # the tools

Training reads in run order in runtime/commands/train.py; each subcommand is a module of
runtime/commands/ with its own --help.
"""

from __future__ import annotations

import sys
import warnings

from runtime.commands import calibrate, export, plan, train
from runtime.commands.study import cli as study

# torch.export's pytree emits a FutureWarning per traced module on 2.13; it says nothing about our code.
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)

SUBCOMMANDS = {"study": study.main, "plan": plan.main, "calibrate": calibrate.main, "export": export.main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
