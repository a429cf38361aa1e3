"""Command-line options derived from pydantic fields (`journeyman.app.options`): help, default and type
come from the model, values come back as the model, and a refused value names its option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
import typer
from journeyman.app.options import Fields, with_fields
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
