"""The server's command line, built from the config dataclasses."""

from __future__ import annotations

import pytest

from minisgl.config import ServerArgs, parse_server_args, to_cli_args


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


def test_help_lists_every_flag_even_with_a_percent_in_its_text() -> None:
    """`--help` renders (argparse expands %-formats in help texts: a literal % broke it) and
    names every field's flag."""
    import dataclasses

    from minisgl.config import _f, build_parser, flag_name

    @dataclasses.dataclass(frozen=True)
    class WithPercent:
        share: float = _f(0.5, "a share of the cores, e.g. 50% of them")

    assert "50% of them" in build_parser(WithPercent).format_help()
    text = build_parser().format_help()
    for f in dataclasses.fields(ServerArgs):
        assert flag_name(f.name) in text, f.name
    # --cpu-quantized-activations, and its old name --cpu-int4-activations, one field
    assert "--cpu-quantized-activations {int16,int8}, --cpu-int4-activations {int16,int8}" in text
    for flag in ("--cpu-quantized-activations", "--cpu-int4-activations"):
        args = parse_server_args(["--model", "m", flag, "int8"])
        assert args.cpu_quantized_activations == "int8"
        assert to_cli_args(args)[-2:] == ["--cpu-quantized-activations", "int8"]
    assert parse_server_args(["--model", "m"]).cpu_quantized_activations == "int16"
    with pytest.raises(SystemExit):
        parse_server_args(["--model", "m", "--cpu-int4-activations", "int4"])
