"""Command-line options derived from pydantic fields (`journeyman.app.options`): help, default and type
come from the model, values come back as the model, and a refused value names its option."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import typer
from journeyman.app.options import App, Fields, with_fields
from journeyman.errors import InvalidFieldError
from pydantic import BaseModel, Field
from typer.testing import CliRunner


class Inner(BaseModel):
    rate: float = Field(default=0.5, gt=0, description="how fast")
    mode: Literal["a", "b"] = Field(default="a", description="which way")


def _inner_default() -> Inner:
    return Inner(rate=0.25)


class Outer(BaseModel):
    name: str = Field(description="who")
    tags: list[str] = Field(default_factory=list, description="labels, any number")
    pick: str | Callable[[int], int] | None = Field(default=None, description="a key (or a function)")
    steps: int = Field(default=3, ge=0, description="how many")
    on: bool = Field(default=False, description="switch")
    inner: Inner = Field(default_factory=_inner_default)


OUTER = Fields(Outer, exclude={"inner"}, flags={"tags": "--tag"})
INNER = Fields.nested(Outer, "inner", prefix="inner_", panel="Inner")
seen: list[Outer] = []

app = typer.Typer()


@app.command()
@with_fields(outer=OUTER, inner=INNER)
def run(extra: int = 1, *, outer: dict[str, Any], inner: dict[str, Any]) -> None:
    seen.append(OUTER.build(outer, inner=INNER.build(inner)))


def test_options_take_help_default_and_type_from_the_fields() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    for text in ("--name", "who", "--tag", "--steps", "[default: 3]", "--on", "--no-on", "--inner-rate"):
        assert text in out.output, text
    assert "[default: 0.25]" in out.output  # the parent's default for its nested model, not Inner's 0.5
    assert "--inner-mode" in out.output and "a|b" in out.output

    seen.clear()
    out = runner.invoke(app, ["--name", "x", "--tag", "t1", "--tag", "t2", "--on", "--inner-mode", "b"])
    assert out.exit_code == 0, out.output
    (got,) = seen
    assert got == Outer(name="x", tags=["t1", "t2"], on=True, inner=Inner(rate=0.25, mode="b"))
    out = runner.invoke(app, ["--name", "y"])
    assert out.exit_code == 0 and seen[-1] == Outer(name="y"), out.output


def test_a_refused_value_is_a_usage_error_naming_its_option() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["--name", "x", "--steps", "-1"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "--steps" in out.output and "steps=-1" in out.output, out.output
    out = runner.invoke(app, ["--name", "x", "--inner-mode", "c"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "--inner-mode" in out.output and "mode='c'" in out.output, out.output
    out = runner.invoke(app, [])  # a field without a default is a required option
    assert out.exit_code == 2 and "--name" in out.output, out.output


def test_what_a_command_line_cannot_say_is_refused_when_the_command_is_made() -> None:
    class WithMap(BaseModel):
        table: dict[str, float] = Field(default_factory=dict, description="a mapping")

    with pytest.raises(TypeError, match="table"):
        with_fields(w=Fields(WithMap))(lambda *, w: None)
    with pytest.raises(TypeError, match="name"):  # an option from two places

        def clash(name: str = "", *, outer: dict[str, Any]) -> None: ...

        with_fields(outer=OUTER)(clash)
    with pytest.raises(ValueError, match="nope"):
        Fields(Outer, only=["nope"]).names()


# --- App: one dialect of errors and help for every command line (issue 54)

one = App(help="a test app")


@one.command(renamed={"--old": "--new"})
def act(new: str = "x", fail: str = "") -> None:
    """Echo --new, or fail as asked."""
    if fail == "field":
        raise InvalidFieldError("new", new, "use another value")
    if fail == "bug":
        raise RuntimeError("a bug")
    typer.echo(f"new={new}")


@one.command()
def other() -> None:
    """A second command, so the app is a group."""


def test_a_user_error_is_one_line_and_debug_shows_the_traceback() -> None:
    runner = CliRunner()
    out = runner.invoke(one, ["act", "--fail", "field"], prog_name="one")
    assert out.exit_code == 2 and out.output.splitlines() == ["one act: new='x': use another value"], (
        out.output
    )
    out = runner.invoke(one, ["act", "--fail", "field", "--debug"], prog_name="one")
    assert isinstance(out.exception, InvalidFieldError)  # raised as it is, for the traceback
    out = runner.invoke(one, ["act", "--fail", "bug"])  # a bug is not a user error: its traceback
    assert isinstance(out.exception, RuntimeError)
    out = runner.invoke(one, ["act", "--nope"], prog_name="one")  # click's usage errors: one line too
    first = out.output.splitlines()[0]
    assert out.exit_code == 2 and first.startswith("one act: No such option: --nope"), out.output


def test_a_renamed_flag_keeps_its_old_spelling_hidden_for_a_release() -> None:
    runner = CliRunner()
    out = runner.invoke(one, ["act", "--old", "y"], prog_name="one")
    assert out.exit_code == 0 and "new=y" in out.output and "--old is now --new" in out.output, out.output
    out = runner.invoke(one, ["act", "--old=z"])
    assert "new=z" in out.output, out.output
    assert "--old" not in runner.invoke(one, ["act", "--help"]).output


def _commands(group: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    subs = getattr(group, "commands", None)
    if subs is None:
        return [(path, group)]
    return [c for name, sub in subs.items() for c in _commands(sub, [*path, name])]


def test_every_journeyman_help_shows_whole_option_names_at_80_columns() -> None:
    from journeyman.app.cli import app as cli

    runner = CliRunner()
    for path, command in _commands(typer.main.get_command(cli), []):
        shown = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
        asked = "--help-all" if "--help-all" in shown else "--help"  # every option, the advanced too
        out = runner.invoke(cli, [*path, asked], env={"COLUMNS": "80"})
        missing = [o for o in shown if o not in out.output]
        assert out.exit_code == 0 and not missing and "…" not in out.output, (path, missing, out.output)
        assert max(map(len, out.output.splitlines())) <= 80, path
    sft = runner.invoke(cli, ["sft", "--help"], env={"COLUMNS": "80"})
    assert len(sft.output.splitlines()) < 60 and "--help-all lists them" in sft.output
    assert (
        "--warmup-ratio" not in sft.output
        and "--warmup-ratio" in runner.invoke(cli, ["sft", "--help-all"]).output
    )


def test_journeyman_refuses_what_cannot_work_in_one_line(tmp_path: Path) -> None:
    from journeyman.app.cli import app as cli

    runner = CliRunner()

    def said(*args: str) -> tuple[int, list[str]]:
        out = runner.invoke(cli, [*args, "--path", str(tmp_path)], prog_name="journeyman")
        return out.exit_code, out.output.splitlines()

    code, lines = said("chat", "hi", "--base-model", "not-a-model")  # was 42 s and 511 lines
    assert code == 1 and lines[0].startswith("journeyman chat: base_model='not-a-model'"), lines
    assert len(lines) == 2 and "--debug" in lines[1], lines
    code, lines = said("demo", "--steps", "0")  # was: resumed the earlier run and evaluated it
    assert code == 2 and lines == [
        "journeyman demo: steps=0: the demo trains 1 step or more (0 would only evaluate the run as it is)"
    ]
    code, lines = said("demo", "--group-size", "1", "--name", "old-spelling")  # was: 10 steps, no signal
    assert (
        code == 2
        and lines[0] == "journeyman demo: --name is now --model (the old spelling goes in a later release)"
    )
    assert lines[1].startswith("journeyman demo: group_size=1: GRPO learns from how the rollouts"), lines
    code, lines = said("token", "list")
    assert code == 0 and lines == [f"no API tokens under {tmp_path} (`journeyman token add NAME` makes one)"]


def test_report_names_the_plot_after_its_metric_and_refuses_one_no_row_has(tmp_path: Path) -> None:
    from journeyman.app.cli import app as cli

    rows = [
        {"step": 0, "split": "val", "val/reward": 0.1, "val/success": 0.0},
        {"step": 1, "train/reward": 0.3},
    ]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = CliRunner().invoke(cli, ["report", str(tmp_path), "--metric", "sucess"], prog_name="journeyman")
    assert out.exit_code == 2 and out.output.splitlines() == [
        "journeyman report: metric='sucess': no row of the history has it; recorded: reward, success"
    ]
    out = CliRunner().invoke(cli, ["report", str(tmp_path), "--metric", "success"])
    assert (
        out.exit_code == 0 and (tmp_path / "success.png").exists() and not (tmp_path / "reward.png").exists()
    )


def test_plan_advice_names_the_flags_and_the_readme_command_fits() -> None:
    from journeyman.app.cli import app as cli

    command = "plan --preset qwen3-32b --gpus 8 --trainer-ranks 8 --shard-base --engine vllm"
    command += " --tensor-parallel-size 2 --data-parallel-size 4"
    readme = " ".join((Path(__file__).parents[4] / "README.md").read_text().split())
    assert f"`journeyman {command}`" in readme
    out = CliRunner().invoke(cli, command.split())
    assert out.exit_code == 0 and "verdict: fits" in out.output, out.output
    out = CliRunner().invoke(cli, command.replace(" --trainer-ranks 8", "").split())  # the base unsharded
    assert out.exit_code == 1, out.output  # was: TrainerConfig(world_size=8) with the base sharded
    assert "change: shard the base across 8 ranks (--trainer-ranks 8 --shard-base)" in out.output, out.output
