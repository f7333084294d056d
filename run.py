"""Hybrid-parallel GPT training on a (dp, pp, mp) mesh: the command line.

    torchrun --nproc_per_node=8 run.py --dp 2 --pp 2 --mp 2 --model tiny --precision fp16   # train
    python run.py study | plan | calibrate | export | eval | generate | tokenize ...        # the tools

Training reads in run order in runtime/commands/train.py; each subcommand is a module of
runtime/commands/ with its own --help.
"""

from __future__ import annotations

import os
import sys
import warnings

from runtime.commands import calibrate, data_benchmark, export, generate, plan, tokenize, train
from runtime.commands import eval as eval_command
from runtime.commands.study import cli as study

# torch.export's pytree emits a FutureWarning per traced module on 2.13; it says nothing about our code.
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)

SUBCOMMANDS = {"study": study.main, "plan": plan.main, "calibrate": calibrate.main, "export": export.main,
               "eval": eval_command.main, "data-benchmark": data_benchmark.main, "generate": generate.main,
               "tokenize": tokenize.main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return train.main(argv)


def exit_rank(code: int) -> None:
    """End a torchrun rank without interpreter finalization. Its process group is destroyed and its files
    are closed by now, but gloo's worker threads can still hold tensors, and releasing them while the
    interpreter is torn down aborts the process now and then (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch PR 179291), failing a finished job. Exceptions still take the normal path."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_rank(code)
    sys.exit(code)
