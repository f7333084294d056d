"""``run.py study``'s command line and run list (study/cli.py), without running anything."""

import pytest

from runtime.lab.study import cli, plan


@pytest.mark.parametrize("argv,flag", [
    (["--sections", "throughput,speed"], "--sections: unknown speed"),
    (["--world", "3"], "--world must be 1, 2, 4 or 8, got 3"),
    (["--mem-budget-gb", "0"], "--mem-budget-gb must be positive"),
])
def test_bad_input_names_its_flag(argv, flag, run_main):
    with pytest.raises(ValueError, match=flag):
        cli.parse_options(argv)
    code, _, err = run_main(cli.main, argv)
    assert code == 2 and flag in err


def test_options_carry_the_modes_settings_with_the_budget_given(tmp_path):
    o = cli.parse_options(["--smoke", "--world", "2", "--mem-budget-gb", "0.5", "--out", str(tmp_path),
                           "--sections", "memory, overhead"])
    assert o.mode == "smoke" and o.sections == ("memory", "overhead") and o.out == tmp_path
    assert o.settings.memory_budget_gb == 0.5 and o.settings.model == plan.SMOKE.model and o.memory_search
    assert cli.parse_options(["--quick"]).settings == plan.QUICK


def test_only_the_asked_sections_the_world_allows_get_runs(tmp_path):
    one_rank = cli.build_specs(cli.parse_options(["--world", "1", "--out", str(tmp_path)]))
    assert list(one_rank) == list(cli.SECTIONS)
    assert {name for name, specs in one_rank.items() if specs} == {"scaling", "overhead"}
    assert not cli.parse_options(["--world", "1"]).memory_search
    some = cli.build_specs(cli.parse_options(["--smoke", "--world", "2", "--sections", "split,throughput"]))
    assert list(some) == ["throughput", "split"] and all(some.values())
    # scaling's 1x2x1 run is throughput's pp=2 interleaved run: counted once.
    both = cli.build_specs(cli.parse_options(["--smoke", "--world", "2", "--sections", "throughput,scaling"]))
    assert cli.distinct_runs(both) == len(both["throughput"]) + len(both["scaling"]) - 1


def test_results_start_with_the_settings_and_the_models_sizes(tmp_path):
    o = cli.parse_options(["--smoke", "--world", "2", "--out", str(tmp_path)])
    header = cli.results_header(["--smoke"], o)
    assert header["command"] == "python run.py study --smoke" and header["commands"] == []
    assert header["settings"]["model"] == plan.model_summary(plan.SMOKE.model)
    assert header["settings"]["model"]["layers"] == 8 and header["settings"]["sections"] == list(cli.SECTIONS)
