"""The README's settings table is the one ``core.settings_doc`` renders from ``core.settings``."""

from __future__ import annotations

import pytest
from pydantic import Field, SecretStr

from core.settings import Settings
from core.settings_doc import (
    BEGIN,
    END,
    SettingsDocError,
    default_text,
    main,
    settings_table,
    table_in,
    with_table,
)
from testing import ROOT

README = ROOT / "README.md"


def test_the_readme_table_is_the_generated_one():
    assert table_in(README.read_text(encoding="utf-8")) == settings_table(), (
        "README.md's settings table is out of date: run .venv/bin/python -m core.settings_doc --write README.md"
    )


def test_one_row_per_setting_in_declaration_order():
    rows = settings_table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == [f"SAOSERVE_{n.upper()}" for n in Settings.model_fields]


def test_defaults_as_an_operator_reads_them():
    assert default_text("home") == "`var`"
    # Empty defaults resolved against home, shown with the placeholder.
    assert default_text("model_dir") == "`<home>/model`"
    assert default_text("policy_dir") == "`<home>/policies`"
    assert default_text("database_url") == "`sqlite:///<home>/saoserve.db`"
    # log_url resolves to the database URL, an earlier setting: named, not repeated.
    assert default_text("log_url") == "same as `SAOSERVE_DATABASE_URL`"
    assert default_text("admin_key") == "*empty*"
    assert default_text("judge_embedding_dir") == "*unset*"
    assert default_text("enforce_eager") == "`true`"
    assert default_text("kv_cache_gib") == "`2.0`"


def test_the_table_ignores_the_environment(monkeypatch):
    before = settings_table()
    monkeypatch.setenv("SAOSERVE_HOME", "/elsewhere")
    monkeypatch.setenv("SAOSERVE_MAX_MODEL_LEN", "64")
    assert settings_table() == before


def test_a_setting_without_a_description_is_an_error_naming_it():
    class Undocumented(Settings):
        mystery_s: float = 1.0

    with pytest.raises(SettingsDocError, match="'mystery_s' has no description"):
        settings_table(Undocumented)


def test_pipes_are_escaped_and_secrets_render_like_strings():
    class Extra(Settings):
        mode: str = Field("a|b", description="either | or")
        token: SecretStr = Field(SecretStr(""), description="a secret")

    rows = settings_table(Extra).splitlines()
    assert "| `SAOSERVE_MODE` | `a\\|b` | either \\| or |" in rows
    assert "| `SAOSERVE_TOKEN` | *empty* | a secret |" in rows


def test_with_table_replaces_only_the_part_between_the_markers():
    text = f"# Title\n\n{BEGIN}\nold table\n{END}\n\nafter\n"
    new = with_table(text, "| a |\n")
    assert new == f"# Title\n\n{BEGIN}\n| a |\n{END}\n\nafter\n"
    assert table_in(new) == "| a |\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("no markers at all\n", "each marker once"),
        (f"{BEGIN}\n{BEGIN}\n{END}\n", "each marker once"),
        (f"{END}\nx\n{BEGIN}\n", "end marker comes before"),
    ],
)
def test_bad_markers_are_errors(text, message):
    with pytest.raises(SettingsDocError, match=message):
        table_in(text)
    with pytest.raises(SettingsDocError, match=message):
        with_table(text, "| a |\n")


def test_cli_check_write_and_errors(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\n| stale |\n{END}\nrest\n", encoding="utf-8")
    assert main(["--check", str(readme)]) == 1
    assert "out of date" in capsys.readouterr().out
    assert main(["--write", str(readme)]) == 0
    assert main(["--check", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8").endswith(f"{END}\nrest\n")

    (tmp_path / "plain.md").write_text("no markers\n", encoding="utf-8")
    assert main(["--write", str(tmp_path / "plain.md")]) == 2
    assert "each marker once" in capsys.readouterr().err
    assert main(["--check", str(tmp_path / "missing.md")]) == 2
    assert "missing.md" in capsys.readouterr().err


def test_cli_prints_the_table(capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == settings_table()
