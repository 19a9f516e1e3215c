"""``python -m kvjax``: subcommands are registered and bad input is refused clearly."""

import pytest

from kvjax.__main__ import main


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve-everything"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'serve-everything'" in capsys.readouterr().err
