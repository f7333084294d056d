"""Hybrid-parallel LLM training on a (dp, pp, mp) mesh: the command line.

    torchrun --nproc_per_node=8 run.py --dp 2 --pp 2 --mp 2 --model tiny --precision fp16   # train
    python run.py eval | export | generate | tokenize | plan ...                             # users' tools
    python run.py study | calibrate | validate | data-benchmark | sft-benchmark ...         # the lab

Training reads in run order in runtime/commands/train.py. Users' subcommands are modules of runtime/commands/,
the lab's of runtime/lab/, each with its own --help; a subcommand's module is imported only when it runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

# torch.export's pytree emits a FutureWarning per traced module on 2.13; it says nothing about our code.
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)

TRAIN = "runtime.commands.train"
SUBCOMMANDS = {"eval": "runtime.commands.eval", "export": "runtime.commands.export",
               "generate": "runtime.commands.generate", "tokenize": "runtime.commands.tokenize",
               "plan": "runtime.commands.plan", "study": "runtime.lab.study.cli", "calibrate": "runtime.lab.calibrate",
               "validate": "runtime.lab.validate", "data-benchmark": "runtime.lab.data_benchmark",
               "sft-benchmark": "runtime.lab.sft_benchmark"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    return importlib.import_module(TRAIN).main(argv)


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
