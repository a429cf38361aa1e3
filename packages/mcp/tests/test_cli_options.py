"""`mcp-rl`'s options are McpRlSettings' fields (and its nested configs'): the same names, help and
defaults, and the flags the README and the tests use build the same settings. No server, no model."""

from __future__ import annotations

from typing import Any

import journeyman as jm
import pytest
from journeyman_mcp import cli
from journeyman_mcp.rollout import RolloutConfig
from journeyman_mcp.server import ServerSpec
from journeyman_mcp.train import McpRlSettings
from typer.testing import CliRunner

WIDE = {"COLUMNS": "200"}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The arguments `_run` would have run (nothing is connected or loaded)."""
    got: list[Any] = []

    def fake_run(fn: Any, *args: Any) -> Any:
        got.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_run", fake_run)
    return got


def test_train_flags_build_the_settings(captured: list[Any]) -> None:
    flags = ["--steps", "2", "--learning-rate", "5e-4", "--no-scale-rewards", "--max-turns", "2"]
    flags += ["--sft-epochs", "3", "--tools", "echo, get-sum", "--judge", "none"]
    out = CliRunner().invoke(cli.app, ["train", *flags, "--", "mcp-server-time"], env=WIDE)
    assert out.exit_code == 0, out.output
    ((settings, _echo),) = captured
    want = McpRlSettings(
        server=ServerSpec.parse(["mcp-server-time"]),
        steps=2,
        tools=["echo", "get-sum"],
        judge="none",
        rollout=RolloutConfig(max_turns=2),
        train=jm.TrainConfig(learning_rate=5e-4, scale_rewards=False, min_reward_spread=0.05),
        sft=jm.SFTConfig(epochs=3, learning_rate=2e-4),
    )
    assert settings == want
    # no flags: the library's defaults, MCP·RL's own for the nested training and warm-up settings
    captured.clear()
    out = CliRunner().invoke(cli.app, ["train", "http://127.0.0.1:9/mcp"], env=WIDE)
    assert out.exit_code == 0, out.output
    assert captured[0][0] == McpRlSettings(server=ServerSpec.parse(["http://127.0.0.1:9/mcp"]))


def test_old_flat_training_settings_still_build() -> None:
    s = McpRlSettings.model_validate({"server": ServerSpec.parse(["x"]), "learning_rate": 5e-4})
    assert s.train.learning_rate == 5e-4 and s.train.min_reward_spread == 0.05 and not s.train.scale_rewards


def test_help_comes_from_the_fields_and_bad_values_name_their_option(captured: list[Any]) -> None:
    out = CliRunner().invoke(cli.app, ["train", "--help"], env=WIDE)
    assert out.exit_code == 0
    for name, info in McpRlSettings.model_fields.items():
        if name not in ("server", "tools", "rollout", "train", "sft"):
            assert info.description and "--" + name.replace("_", "-") in out.output, name
    judge = McpRlSettings.model_fields["judge"].description or "?"
    assert judge in " ".join(out.output.replace("│", " ").split())
    out = CliRunner().invoke(cli.app, ["train", "--group-size", "1", "--", "x"], env=WIDE)
    assert out.exit_code == 2 and "--group-size" in out.output and not captured, out.output
    out = CliRunner().invoke(cli.app, ["train", "--loss", "gspo", "--", "x"], env=WIDE)  # eps too wide
    assert out.exit_code == 2 and "--eps" in out.output, out.output


def test_an_option_after_the_double_dash_is_refused_not_handed_to_the_server(captured: list[Any]) -> None:
    args = ["scenarios", "--", "python", "my_server.py", "-o", "scenarios.json"]  # README's, before issue 54
    out = CliRunner().invoke(cli.app, args, prog_name="mcp-rl")
    first = out.output.splitlines()[0]
    assert out.exit_code == 2 and not captured and first.startswith("mcp-rl scenarios: "), out.output
    assert "-o after '--' would go to the server: put mcp-rl's options before '--'" in first
    out = CliRunner().invoke(cli.app, ["scenarios", "-o", "s.json", "--", "python", "my_server.py"])
    assert out.exit_code == 0 and len(captured) == 1, out.output  # the README's command now
    out = CliRunner().invoke(cli.app, ["scenarios", "stdio:python my_server.py -o x"])  # the server's own -o
    assert out.exit_code == 0 and len(captured) == 2, out.output


def test_every_help_shows_whole_option_names_at_80_columns() -> None:
    import typer

    group = typer.main.get_command(cli.app)
    for name, command in getattr(group, "commands", {}).items():
        shown = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
        asked = "--help-all" if "--help-all" in shown else "--help"  # every option, the advanced too
        out = CliRunner().invoke(cli.app, [name, asked], env={"COLUMNS": "80"})
        missing = [o for o in shown if o not in out.output]
        assert out.exit_code == 0 and not missing and "…" not in out.output, (name, missing)
        assert max(map(len, out.output.splitlines())) <= 80, name
