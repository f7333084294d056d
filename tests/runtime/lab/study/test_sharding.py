"""The memory-per-configuration rows (study/sharding.py): each row's plan, the meta its runs carry, and the
table read back from those runs."""

import pytest

from runtime.commands.flags import parse_train_config
from runtime.lab.study import plan, sharding

EVERY_ROW = (*sharding.ROWS_8, *sharding.ROWS_4, *sharding.ROWS_SMOKE, sharding.LARGE, *sharding.LLAMA_ROWS,
             *sharding.LONG_ROWS)


@pytest.mark.parametrize("row", EVERY_ROW, ids=lambda r: f"{r.label} {r.plan.describe()}")
def test_a_run_record_gives_its_row_back(row):
    assert sharding.row_of_run({"section": "sharding", "name": "x", "ok": True, **row.meta()}) == row


def test_a_record_written_before_a_field_existed_takes_its_default():
    old = {"label": "ZeRO-3", "dp": 2, "pp": 1, "mp": 1, "dp_shard": None, "zero3": True, "precision": "bf16",
           "activation_checkpointing": False, "micro_batch_size": 2}  # no sequence_parallel, no microbatches
    row = sharding.row_of_run(old)
    assert row == sharding.memory_row("ZeRO-3", 2, 1, 1, zero3=True)
    assert row.plan.microbatches == 2 and not row.plan.sequence_parallel and row.plan.dp_mode == "zero3"


def test_every_run_trains_its_rows_plan():
    specs = sharding.memory_specs(8, plan.FULL.sharding_model, large=True, other_shapes=True)
    assert len(specs) == len(sharding.ROWS_8) + 1 + len(sharding.LLAMA_ROWS) + len(sharding.LONG_ROWS)
    for spec in specs:
        cfg = parse_train_config(spec.args, world_size=spec.nproc)
        assert cfg.plan.to_dict() == {**sharding.row_of_run(spec.meta).plan.to_dict(), "split": cfg.plan.split}
        model = sharding.OTHER_MODELS[spec.meta["model"]][0] if "model" in spec.meta else plan.FULL.sharding_model
        assert cfg.model == model, spec.name


def test_the_table_reads_the_runs_meta_and_divides_by_the_replicas_peak():
    specs = sharding.memory_specs(2, plan.SMOKE.sharding_model, large=False, smoke=True)
    peaks = {sharding.REPLICATION: 8e6, "ZeRO-3": 5e6}
    runs = [{"name": s.name, "ok": True, "error": None, **s.meta,
             "summary": {"peak_tensor_bytes": peaks[s.meta["label"]], "peak_bytes_per_rank": [2e7, 3e7],
                         "local_parameters_max": 10, "parameters": 20}} for s in specs]
    table = {r["label"]: r for r in sharding.memory_table(runs, plan.SMOKE.sharding_model)}
    assert table["ZeRO-3"]["reduction_vs_replication"] == pytest.approx(1.6)
    assert table["ZeRO-3"]["zero3"] and table["ZeRO-3"]["micro_batch_size"] == 2 and table["ZeRO-3"]["dp"] == 2
    assert table["ZeRO-3"]["peak_resident_bytes"] == 3e7 and table["ZeRO-3"]["predicted_bytes"] > 0
    assert table[sharding.REPLICATION]["model"] == "4 x d 64, T 64"
    assert sharding.row_label(table["ZeRO-3"]) == "ZeRO-3 (2x1x1, bf16, mbs 2)"
