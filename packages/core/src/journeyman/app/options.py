"""The command lines' shared parts: options derived from a pydantic model's fields, so a CLI cannot
drift from the model, and `App`, the typer app every Journeyman command line is (`journeyman`,
`mcp-rl`), so they speak one dialect of errors and help.

Each option takes its help from the field's `description`, its default from the field's default (or
from a parent's default instance, for a nested model whose defaults the parent sets) and its type
from the annotation. Only what a command line cannot say is written by hand: a shorter flag, a
default the command wants different, the formats of a date.

    SFT = Fields(SFTConfig, panel="Fine-tuning")

    @app.command()
    @with_fields(sft=SFT)
    def sft(file: Path, *, sft: dict[str, Any]) -> None:
        config = SFT.build(sft)    # an SFTConfig; a bad value exits 2, naming its --option

`App` prints a user's error (a `JourneymanError`, a refused option, a missing file) as one line
naming the field, the value and the fix, and the traceback only with `--debug` (anywhere before a
`--`) or `JOURNEYMAN_DEBUG=1`; its help lists whole option names at any width, grouped by panel,
with the options a `Fields` marks `advanced` behind `--help-all`; `@app.command(renamed=...)` keeps
a renamed flag's old spelling working, hidden, for one release.

Public, because the integration packages' CLIs (`mcp-rl`) are built with it too.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import os
import sys
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

from journeyman.data.budget import Budget
from journeyman.errors import InvalidFieldError, JourneymanError

__all__ = ["ADVANCED", "BUDGET", "App", "Fields", "budget_of", "with_fields"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

_SEQUENCES = (list, set, frozenset, collections.abc.Sequence, collections.abc.Set)

# The fields of TrainConfig and SFTConfig a first run leaves alone (the optimizer's, the loss's,
# the memory's): `Fields(..., advanced=ADVANCED)` keeps them out of `--help`, in `--help-all`.
ADVANCED = (
    *("lr_schedule", "warmup_ratio", "min_lr_ratio", "max_grad_norm", "weight_decay", "betas", "seed"),
    *("eps", "eps_high", "scale_rewards", "advantages", "tis_cap", "min_reward_spread"),
    *("micro_batch_tokens", "long_rows", "gradient_checkpointing", "offload_activations", "packing"),
    "autocast_bf16",
)


def _is_callable(tp: Any) -> bool:
    return get_origin(tp) is collections.abc.Callable or tp is collections.abc.Callable


def _cli_type(tp: Any, where: str) -> Any:
    """The type typer parses for a field annotated `tp`: callables dropped from unions (a command line
    cannot name a function), any sequence as a repeatable `list[X]`, `X | None` kept optional, a
    `Literal` as `str` (the model refuses other values, naming the field, as it does in Python)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _cli_type(get_args(tp)[0], where)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        members = [a for a in args if a is not type(None) and not _is_callable(a)]
        sequences = [a for a in members if get_origin(a) in _SEQUENCES]
        if sequences:  # `str | Sequence[str]`: the repeatable option covers both
            inner = _cli_type(sequences[0], where)
        elif len(members) == 1:
            inner = _cli_type(members[0], where)
        else:
            raise TypeError(f"{where}: {tp} has no single command-line type; exclude it or narrow it")
        return inner | None if type(None) in args else inner
    if origin in _SEQUENCES:
        (item,) = get_args(tp) or (str,)
        return list[_cli_type(item, where)]
    if origin is Literal:
        return str
    if origin is tuple:
        return tp
    if origin is not None or (isinstance(tp, type) and issubclass(tp, BaseModel | Mapping)):
        raise TypeError(f"{where}: {tp} has no command-line form; exclude it (or give it its own Fields)")
    return tp


def _choices(tp: Any) -> list[str]:
    """The values of a `Literal` in `tp` (inside `X | None` or beside a callable), for the help."""
    if get_origin(tp) is Literal:
        return [str(v) for v in get_args(tp)]
    if get_origin(tp) in (Union, types.UnionType, Annotated):
        return [c for a in get_args(tp) for c in _choices(a)]
    return []


@dataclass(frozen=True)
class Fields(Generic[M]):
    """Some fields of `model` as typer options, `--<prefix><field>` each unless `flags` renames one.

    `defaults` replaces field defaults on the command line (a mapping, or a model instance such as
    the default a parent model gives this nested one: see `nested`); `extra` passes more
    `typer.Option` arguments per field (`formats=`, `envvar=`, `show_default=`); the fields named in
    `advanced` are left out of `--help` and listed by `--help-all` (an `App`'s commands; names
    the model lacks are ignored, so one list serves several models)."""

    model: type[M]
    only: Sequence[str] | None = None
    exclude: Collection[str] = ()
    prefix: str = ""
    flags: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] | BaseModel | None = None
    panel: str | None = None
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    advanced: Collection[str] = ()

    @classmethod
    def nested(cls, parent: type[BaseModel], name: str, **kwargs: Any) -> Fields[Any]:
        """The fields of the model in `parent.<name>`, defaulting to what `parent` defaults it to."""
        default = parent.model_fields[name].get_default(call_default_factory=True)
        if not isinstance(default, BaseModel):
            raise TypeError(f"{parent.__name__}.{name} has no model instance as its default")
        return Fields[Any](type(default), defaults=default, **kwargs)

    def names(self) -> list[str]:
        fields = self.model.model_fields
        chosen = list(self.only) if self.only is not None else list(fields)
        unknown = [n for n in [*chosen, *self.exclude, *self.flags, *self.extra] if n not in fields]
        if unknown:
            raise ValueError(f"{self.model.__name__} has no field(s) {', '.join(unknown)}")
        return [n for n in chosen if n not in self.exclude]

    def flag(self, name: str) -> str:
        """The option that sets field `name`, as `--help` and error messages show it."""
        return self.flags.get(name) or "--" + (self.prefix + name).replace("_", "-")

    def default(self, name: str) -> Any:
        """The command line's default for field `name` (PydanticUndefined: the option is required)."""
        if isinstance(self.defaults, BaseModel):
            return getattr(self.defaults, name)
        if self.defaults is not None and name in self.defaults:
            return self.defaults[name]
        info = self.model.model_fields[name]
        return info.get_default(call_default_factory=True)

    def parameters(self) -> list[inspect.Parameter]:
        """One keyword-only parameter per field, as typer reads a command's signature."""
        params = []
        for name in self.names():
            info: FieldInfo = self.model.model_fields[name]
            where = f"{self.model.__name__}.{name}"
            tp = _cli_type(info.annotation, where)
            default = self.default(name)
            if isinstance(default, list | tuple | set) and get_origin(tp) is not tuple:
                default = list(default) or None  # typer's repeatable option: None when not given
            if default is None and tp is not Any and type(None) not in get_args(tp):
                tp = tp | None
            decls = [self.flags[name]] if name in self.flags else []
            choices = _choices(info.annotation)
            more = (
                {"metavar": "|".join(choices), **self.extra.get(name, {})}
                if choices
                else self.extra.get(name, {})
            )
            panel, hidden = self.panel, name in self.advanced
            if hidden:
                panel = f"{panel or 'Options'}{_ADVANCED}"
            option = typer.Option(
                *decls, help=info.description or "", rich_help_panel=panel, hidden=hidden, **more
            )
            params.append(
                inspect.Parameter(
                    self.prefix + name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=inspect.Parameter.empty if default is PydanticUndefined else default,
                    annotation=Annotated[tp, option],
                )
            )
        return params

    def take(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """This group's values, popped from a command's keyword arguments and keyed by field name.
        An option left at None whose field defaults to something else is left out (the model's
        default applies); a nested group starts from its parent's default instance."""
        base = self.defaults.model_dump() if isinstance(self.defaults, BaseModel) else {}
        values: dict[str, Any] = {}
        for name in self.names():
            value = kwargs.pop(self.prefix + name)
            if value is None and self.default(name) is not None:
                continue
            if value == [] and not self.default(name):
                continue
            values[name] = value
        return {**base, **values}

    def build(self, values: Mapping[str, Any], **extra: Any) -> M:
        """`model(**values, **extra)`; a value the model refuses is a usage error naming its option
        (exit code 2, no traceback)."""
        try:
            return self.model(**{**values, **extra})
        except InvalidFieldError as e:
            raise typer.BadParameter(str(e), param_hint=self._hint(e.field)) from None
        except ValidationError as e:
            err = e.errors()[0]
            inner = (err.get("ctx") or {}).get("error")
            if isinstance(inner, InvalidFieldError):
                raise typer.BadParameter(str(inner), param_hint=self._hint(inner.field)) from None
            where = ".".join(str(part) for part in err["loc"])
            shown = f"{where}={err['input']!r}" if err["type"] != "missing" else where
            raise typer.BadParameter(f"{shown}: {err['msg']}", param_hint=self._hint(where)) from None

    def _hint(self, name: str) -> str:
        return f"'{self.flag(name)}'" if name in self.names() else name


def with_fields(**groups: Fields[Any]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate a typer command: its parameter `<key>` (keyword-only, never an option itself) gets
    the field values of `groups[key]` as a dict, and each field becomes an option of the command."""

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        sig = inspect.signature(fn, eval_str=True)
        missing = [k for k in groups if k not in sig.parameters]
        if missing:
            raise TypeError(f"{fn.__name__} has no parameter(s) {', '.join(missing)} to receive the fields")
        own = [p for n, p in sig.parameters.items() if n not in groups]
        made = [p for g in groups.values() for p in g.parameters()]
        names = [p.name for p in [*own, *made]]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise TypeError(f"{fn.__name__}: option(s) {', '.join(clash)} come from two places")
        keyword_only = inspect.Parameter.KEYWORD_ONLY
        params = [
            *(p for p in own if p.kind != keyword_only),
            *(p for p in own if p.kind == keyword_only),
            *made,
        ]

        if any(g.advanced for g in groups.values()):
            params.append(_HELP_ALL)

        @functools.wraps(fn)
        def command(**kwargs: Any) -> R:
            kwargs.pop(_HELP_ALL.name, None)
            for key, group in groups.items():
                kwargs[key] = group.take(kwargs)
            return fn(**kwargs)

        command.__signature__ = sig.replace(parameters=params)  # pyright: ignore[reportAttributeAccessIssue]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


# --- App: one dialect of errors and help for every Journeyman command line

_ADVANCED = ", more"  # the panel of a Fields' advanced options, which `--help` leaves out
_HELP_ALL_KEY = "journeyman.help_all"
_RENAMED = "_journeyman_renamed"  # a command function's {old flag: new flag}


def _help_all(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        ctx.meta[_HELP_ALL_KEY] = True
        typer.echo(ctx.get_help())
        raise typer.Exit()


_HELP_ALL = inspect.Parameter(
    "help_all",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool,
        typer.Option("--help-all", is_eager=True, callback=_help_all, help="Show every option and exit."),
    ],
)


def _renamed(args: list[str], renamed: Mapping[str, str], where: str) -> list[str]:
    """`args` with each old spelling of a renamed flag (before any `--`) replaced, and said so."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        old, eq, value = arg.partition("=")
        if old in renamed:
            typer.secho(
                f"{where}: {old} is now {renamed[old]} (the old spelling goes in a later release)", err=True
            )
            arg = renamed[old] + eq + value
        out.append(arg)
    return out


class _Command(TyperCommand):
    """Help as plain text, so no option name is cut at 80 columns, in a section per panel; a
    renamed flag's old spelling accepted."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: click's Context
        renamed: Mapping[str, str] = getattr(self.callback, _RENAMED, {})
        return super().parse_args(ctx, _renamed(args, renamed, ctx.command_path) if renamed else args)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        show_all = bool(ctx.meta.get(_HELP_ALL_KEY))
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": []}
        left_out = 0
        for param in self.get_params(ctx):
            panel: str | None = getattr(param, "rich_help_panel", None)
            hidden: bool = getattr(param, "hidden", False)
            advanced = hidden and panel is not None and panel.endswith(_ADVANCED)
            if advanced and not show_all:
                left_out += 1
                continue
            if advanced:  # shown by --help-all: the command is made afresh for each call
                setattr(param, "hidden", False)  # noqa: B010
            record = param.get_help_record(ctx)
            if record is not None:
                title = "Arguments" if param.param_type_name == "argument" else panel or "Options"
                sections.setdefault(title, []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        if left_out:
            formatter.write_paragraph()
            formatter.write_text(f"{left_out} more options: --help-all lists them.")


def _command_path(root: Any, argv: list[str], prog: str) -> str:
    """The command `argv` names under `root`, as the user typed it."""
    path, command = [prog], root
    for arg in argv:
        command = getattr(command, "commands", {}).get(arg)
        if command is None:
            break
        path.append(arg)
    return " ".join(path)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _user_error(e: Exception, root: Any, argv: list[str], prog: str) -> tuple[str, int] | None:
    """The one line (and exit code) a user sees for an error they can fix; None for a bug."""
    path = _command_path(root, argv, prog)
    if isinstance(e, typer.Abort):
        return f"{path}: aborted", 1
    if isinstance(e, TyperException) and hasattr(e, "format_message"):  # a usage error: click's
        ctx = getattr(e, "ctx", None)
        where = ctx.command_path if ctx is not None else path
        hint = f"(`{where} --help` says what it takes)"
        return f"{where}: {_one_line(e.format_message())}  {hint}", getattr(e, "exit_code", 2)
    if isinstance(e, InvalidFieldError):  # names the field, the value and the fix
        return f"{path}: {_one_line(str(e))}", 2
    if isinstance(e, JourneymanError | OSError) or (isinstance(e, ImportError) and "pip install" in str(e)):
        return f"{path}: {_one_line(str(e))}", 1
    import httpx  # a service the user named (Langfuse, a judge) that does not answer

    if isinstance(e, httpx.TransportError):
        try:
            url = e.request.url
            where = f" at {url.scheme}://{url.netloc.decode()}"
        except RuntimeError:  # raised before a request was made
            where = ""
        return f"{path}: nothing answers{where} ({type(e).__name__}: {_one_line(str(e))})", 1
    return None


class _Group(TyperGroup):
    """The command line's entry: `--debug` taken out of the arguments (before any `--`), and a user's
    error printed as one line, unless debugging, when it goes up as a traceback."""

    def main(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        end = argv.index("--") if "--" in argv else len(argv)
        debug = "--debug" in argv[:end] or os.environ.get("JOURNEYMAN_DEBUG", "") not in ("", "0")
        argv = [a for i, a in enumerate(argv) if a != "--debug" or i >= end]
        if debug or not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        prog = prog_name or self.name or os.path.basename(sys.argv[0])
        try:
            rv = super().main(argv, prog, complete_var, False, **extra)
        except Exception as e:
            said = _user_error(e, self, argv, prog)
            if said is None:
                raise
            line, code = said
            if "\n" in str(getattr(e, "message", "")):  # no arguments: click's help, as it is
                typer.echo(str(getattr(e, "message", "")), err=True)
            else:
                typer.secho(line, fg=typer.colors.RED, err=True)
                if not isinstance(e, TyperException | InvalidFieldError):  # a value: its line says it all
                    typer.echo(f"(`{prog} --debug ...` shows the traceback)", err=True)
            sys.exit(code)
        sys.exit(rv if isinstance(rv, int) else 0)


BUDGET = Fields(Budget, prefix="budget_", panel="Budget (hard caps on the run's spend; data/budget.py)")
"""`--budget-sampled-tokens`, `--budget-trained-tokens`, `--budget-judge-usd`, `--budget-judge-tokens`,
`--budget-wall-s`, `--budget-warn-at`: every command that registers a model takes them."""


def budget_of(values: Mapping[str, Any]) -> Budget | None:
    """The `BUDGET` options' values as a `ModelConfig.budget`: None when no limit is given."""
    budget = BUDGET.build(values)
    return budget if budget.limits() else None


class App(typer.Typer):
    """A typer app speaking Journeyman's command-line dialect (see the module docstring).
    `@app.command(renamed={"--old": "--new"})` keeps `--old` working for a release, hidden."""

    def __init__(self, **kwargs: Any) -> None:
        settings: dict[str, Any] = {
            "cls": _Group,
            "rich_markup_mode": None,  # plain help: whole option names at any width
            "no_args_is_help": True,
            "add_completion": False,
            "pretty_exceptions_show_locals": False,
            "epilog": "Add --debug to any command for the traceback of an error.",
        }
        super().__init__(**{**settings, **kwargs})

    def command(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, name: str | None = None, *, renamed: Mapping[str, str] | None = None, **kwargs: Any
    ) -> Callable[[Callable[..., R]], Callable[..., R]]:
        register = super().command(name, cls=kwargs.pop("cls", _Command), **kwargs)

        def decorate(fn: Callable[..., R]) -> Callable[..., R]:
            if renamed:
                setattr(fn, _RENAMED, dict(renamed))
            return register(fn)

        return decorate
