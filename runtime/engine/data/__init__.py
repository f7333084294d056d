"""Token data: text, token files and seeded random tokens, as batches that are pure functions of (seed, step).

    build.py        --data / --val-data -> DataSources (training and validation batches), checked up front
    detect.py       what a path is: text, nanoGPT .bin, llm.c shards, Megatron .bin/.idx
    text.py         byte-level text (builtin, .txt) written once per machine to a token file
    token_files.py  token dtypes, memory-mapping, the one-pass vocabulary / document scan
    llmc.py megatron.py   the two formats with headers
    corpus.py       windows of memory-mapped spans; positions within documents
    sampling.py     epochs without replacement (a seeded bijection), mixtures by share
    batches.py      a global batch's rows for one rank; synthetic tokens
    cache.py        the per-machine cache, prepared by one rank under a file lock
    documents.py    documents streamed from text and JSON-lines corpora, long ones in exact segments
    tokenize.py     documents -> ids on worker processes (run.py tokenize, the text cache)
    writers.py      nanoGPT / llm.c / Megatron files written streaming
    tokenized_text.py  --data text --tokenizer FOLDER: a Megatron dataset in the cache
"""

from runtime.engine.data.batches import CorpusBatches, SyntheticBatches, inputs_and_targets, replica_rows
from runtime.engine.data.build import DataSources, build_data, build_data_from_config, evaluation_corpus, parse_mixture
from runtime.engine.data.corpus import DataError, restart_at_window
from runtime.engine.data.detect import DATA_FORMATS
from runtime.engine.data.text import BYTE_VOCAB
from runtime.engine.data.token_files import TOKEN_DTYPES

__all__ = ["BYTE_VOCAB", "DATA_FORMATS", "TOKEN_DTYPES", "CorpusBatches", "DataError", "DataSources", "SyntheticBatches",
           "build_data", "build_data_from_config", "evaluation_corpus", "inputs_and_targets", "parse_mixture",
           "replica_rows", "restart_at_window"]
