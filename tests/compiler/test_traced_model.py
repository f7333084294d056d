import torch

import compiler.traced_model as traced_model_module
from compiler.traced_model import traced_model
from models import named_config

CFG = named_config("tiny", n_layers=4, d_model=32, n_heads=2, seq_len=16)


def _counting_traces(monkeypatch) -> list:
    calls = []
    real = traced_model_module.trace_pipeline

    def counted(*args, **kwargs):
        calls.append(kwargs["blocks_per_stage"])
        return real(*args, **kwargs)

    monkeypatch.setattr(traced_model_module, "trace_pipeline", counted)
    monkeypatch.setattr(traced_model_module, "_KEPT", type(traced_model_module._KEPT)())
    return calls


def _build(blocks_per_stage=(2, 2), **kwargs):
    return traced_model(CFG, micro_batch_size=2, local_seq_len=16, model_inputs=1, blocks_per_stage=list(blocks_per_stage),
                        hidden_output=False, **kwargs)


def test_a_second_build_of_the_same_trace_is_a_copy_of_its_own(monkeypatch):
    calls = _counting_traces(monkeypatch)
    model, pipe = _build()
    first = pipe.get_stage_module(1)
    first.get_submodule("layers.2").attn.qkv.weight = torch.nn.Parameter(torch.empty(1, device="meta"))  # as TP would
    again_model, again = _build()
    assert calls == [[2, 2]]  # traced once
    second = again.get_stage_module(1)
    assert second is not first and again_model is not model
    assert second.get_submodule("layers.2").attn.qkv.weight.shape == model.layers["2"].attn.qkv.weight.shape
    assert [n.op for n in second.graph.nodes] == [n.op for n in first.graph.nodes]


def test_another_split_or_a_model_changed_before_tracing_is_traced_again(monkeypatch):
    calls = _counting_traces(monkeypatch)
    _build()
    _build(blocks_per_stage=(1, 3))
    changed = []
    _build(before_trace=changed.append)
    _build(before_trace=changed.append)
    assert calls == [[2, 2], [1, 3], [2, 2], [2, 2]]
    assert len(changed) == 2 and changed[0] is not changed[1]
