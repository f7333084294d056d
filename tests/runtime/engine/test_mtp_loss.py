"""The training objective with multi-token prediction (runtime/engine/mtp_loss.py) on one process, against the report's
formula written out (DeepSeek-V3 sec. 2.2, eq. 21-25): each depth run on the sequence it has tokens for (h^k_{1:T-k},
no placeholder), its loss a loop over positions that skips a token in a later document (and, with
--no-loss-across-documents, a label after an end of document), divided by every position of the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models import build_model, named_config
from runtime.engine.data.inputs import document_ids, model_batch, without_loss_across_documents
from runtime.engine.mtp_loss import MtpObjective

EOD, T, B, DEPTH, WEIGHT = 0, 16, 2, 2, 0.3


def _rows_and_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) tokens of a few short documents (EOD ends each) and each input token's position in its document."""
    rows = torch.randint(1, 9, (B, T + 1), generator=torch.Generator().manual_seed(4))
    rows[0, [3, 9]] = EOD
    rows[1, [6, 7, 13]] = EOD  # a document of one token
    positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(1, T):
            positions[b, t] = 0 if rows[b, t - 1] == EOD else positions[b, t - 1] + 1
    return rows, positions


def _formula(model, rows: torch.Tensor, positions: torch.Tensor, *, eod_rule: bool) -> torch.Tensor:
    """L_main + weight * (1/D) sum_k L_k, every depth on its own shorter sequence."""
    tokens, documents = rows[:, :-1], document_ids(positions)
    hidden = model.hidden(tokens, positions, documents)
    logits = model.logits(hidden)
    main = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="none").view(B, T)
    if eod_rule:
        main = main * (tokens != EOD)
    losses, h = [], hidden
    for k in range(1, DEPTH + 1):
        layer, n = model.mtp.layers[str(k - 1)], T - k  # h^k at positions 0 .. T-k-1
        embedded = model.tok_emb(rows[:, k:k + n])  # Emb(t_{i+k})
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(h[:, :n])], dim=-1))
        h = layer.block(x, positions[:, :n], documents[:, :n])
        log_p = torch.log_softmax(model.head(layer.norm(h)), dim=-1)  # (B, n, V)
        total = torch.zeros(())
        for b in range(B):
            for i in range(n):
                if documents[b, i + k] != documents[b, i] or (eod_rule and rows[b, i + k] == EOD):
                    continue  # t_{i+k} in the next document, or an end of document before the label
                total = total - log_p[b, i, rows[b, i + k + 1]]
        losses.append(total / (B * T))
    next_token = main.mean() if not eod_rule else main.sum() / main.numel()
    return next_token + WEIGHT * torch.stack(losses).mean()


@pytest.mark.parametrize("eod_rule", [False, True])
def test_the_objective_is_the_formula_with_the_document_boundary_rule(eod_rule):
    cfg = dataclasses.replace(named_config("llama3-debug", n_layers=2, seq_len=T), mtp_depth=DEPTH)
    model = build_model(cfg, seed=6)
    rows, positions = _rows_and_positions()
    inputs, target = model_batch(rows, positions, mtp_depth=DEPTH)
    if eod_rule:
        target = without_loss_across_documents(inputs, target, EOD, mtp_depth=DEPTH)
    hidden = model.hidden(*inputs)
    objective = MtpObjective(model.mtp, model.head, depth=DEPTH, weight=WEIGHT, shard=None)
    if eod_rule:  # the mean over every position (--no-loss-across-documents)
        next_token = lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum") / t.numel()  # noqa: E731
    else:
        next_token = lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten())  # noqa: E731
    got = objective.loss((model.logits(hidden), hidden), target, next_token)
    want = _formula(model, rows, positions, eod_rule=eod_rule)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert objective.take_mean() is not None and objective.take_mean() is None  # recorded once, then forgotten
    with torch.no_grad():  # validation: the next-token loss alone
        plain = objective.loss((model.logits(hidden), hidden), target, next_token)
    torch.testing.assert_close(plain, next_token(model.logits(hidden), target[..., 0]))
    assert objective.take_mean() is None
