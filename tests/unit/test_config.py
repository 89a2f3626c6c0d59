"""The server's command line, built from the config dataclasses."""

from __future__ import annotations

import pytest

from minisgl.config import ServerArgs, parse_server_args


def test_full_flag_names_parse() -> None:
    args = parse_server_args(["--model", "m", "--tp-size", "2", "--host=0.0.0.0"])
    assert (args.tp_size, args.host, args.port) == (2, "0.0.0.0", ServerArgs.port)


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--hos", "0.0.0.0"], ["--max-prefill", "8"]])
def test_abbreviations_are_errors_not_other_flags(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_server_args(["--model", "m", *argv])
    assert "unrecognized arguments" in capsys.readouterr().err
