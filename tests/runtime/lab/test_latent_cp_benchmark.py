import pytest

from runtime.lab.latent_cp_benchmark import main


@pytest.mark.parametrize("argv", [["--cp", "1"], ["--cp", "4", "--seq-len", "2052"]])
def test_a_cp_degree_the_sequence_cannot_split_is_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "--cp" in capsys.readouterr().err
