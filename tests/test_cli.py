"""Argument checks of the main job's command line (no training here)."""

import pytest

from keras_geosam import cli


@pytest.mark.parametrize("argv", [
    ["--batch-sizes", "0"], ["--batch-sizes", "16,-4"], ["--batch-sizes", "x"], ["--batch-sizes", ","],
    ["--epochs", "0"], ["--probe-size", "0"], ["--num-probes", "-1"], ["--log-every", "0"], ["--lr", "0"],
])
def test_invalid_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli._parse(argv)
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_defaults_parse():
    args = cli._parse([])
    assert args.batch_sizes == [16, 256] and args.epochs == 20 and args.num_probes == 20
    assert cli._parse(["--batch-sizes", "8, 32"]).batch_sizes == [8, 32]
