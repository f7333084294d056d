"""Every successful study run lands in TensorBoard's HParams tab, with what it was and what it measured."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runtime.lab.study import hparams


def _results() -> dict:
    summary = {"samples_per_sec": 12.0, "tokens_per_sec": 1536.0, "mfu": 0.1, "step_time_s": 2.0, "peak_bytes": 2**30,
               "peak_tensor_bytes": None}
    throughput = {"name": "throughput_pp2_1f1b_r0", "ok": True, "summary": summary, "section": "throughput",
                  "group": "pp=2", "label": "1f1b", "schedule": "1f1b", "dp": 1, "pp": 2, "mp": 1, "v": 1, "m": 8,
                  "micro_batch_size": 4, "round": 0}
    failed = {**throughput, "name": "throughput_pp2_naive_r0", "ok": False, "summary": {}}
    plain = {"name": "overhead_plain_r0", "ok": True, "section": "overhead", "who": "plain", "round": 0,
             "summary": {"samples_per_sec": 10.0, "tokens_per_sec": 1280.0, "peak_bytes": 2**29, "precision": "fp32"}}
    trials = [{"micro_batch_size": 4, "peak_gb": 0.5, "resident_gb": 1.0, "ok": True},
              {"micro_batch_size": 8, "peak_gb": None, "resident_gb": None, "ok": False}]
    return {"throughput": {"runs": [throughput, failed]}, "overhead": {"runs": [plain]},
            "memory": {"search": {"fp16": {"trials": trials}}}}


def test_successful_runs_become_hparams_without_missing_values():
    runs = {r.name: r for r in hparams.hparam_runs(_results())}
    assert set(runs) == {"throughput/throughput_pp2_1f1b_r0", "overhead/overhead_plain_r0", "memory/fp16_mbs4"}
    tp = runs["throughput/throughput_pp2_1f1b_r0"]
    assert tp.hparams == {"section": "throughput", "precision": "fp32", "group": "pp=2", "label": "1f1b",
                          "schedule": "1f1b", "dp": 1, "pp": 2, "mp": 1, "v": 1, "m": 8, "micro_batch_size": 4, "round": 0}
    assert tp.metrics == {"samples_per_sec": 12.0, "tokens_per_sec": 1536.0, "mfu": 0.1, "step_time_s": 2.0,
                          "peak_bytes": float(2**30)}  # peak_tensor_bytes was not measured: left out
    assert runs["memory/fp16_mbs4"].hparams == {"section": "memory", "precision": "fp16", "micro_batch_size": 4}
    assert runs["memory/fp16_mbs4"].metrics == {"peak_tensor_bytes": 0.5 * 2**30, "peak_bytes": float(2**30)}


def test_hparams_are_written_as_tensorboard_runs(tmp_path):
    assert hparams.write_hparams(_results(), tmp_path) == 3
    run = tmp_path / "hparams" / "throughput" / "throughput_pp2_1f1b_r0"
    events = EventAccumulator(str(run))
    events.Reload()
    assert "samples_per_sec" in events.Tags()["scalars"]
    assert events.Scalars("samples_per_sec")[0].value == 12.0
    assert set(events.PluginTagToContent("hparams")) >= {"_hparams_/experiment", "_hparams_/session_start_info"}
    assert list((tmp_path / "hparams" / "memory" / "fp16_mbs4").glob("events.out.tfevents*"))
