"""Command-line options derived from a pydantic model's fields, so a CLI cannot drift from the model.

Each option takes its help from the field's `description`, its default from the field's default (or
from a parent's default instance, for a nested model whose defaults the parent sets) and its type
from the annotation. Only what a command line cannot say is written by hand: a shorter flag, a
default the command wants different, the formats of a date.

    SFT = Fields(SFTConfig, panel="Fine-tuning")

    @app.command()
    @with_fields(sft=SFT)
    def sft(file: Path, *, sft: dict[str, Any]) -> None:
        config = SFT.build(sft)    # an SFTConfig; a bad value exits 2, naming its --option

Public, because the integration packages' CLIs (`mcp-rl`) build their options with it too.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from journeyman.errors import InvalidFieldError

__all__ = ["Fields", "with_fields"]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

_SEQUENCES = (list, set, frozenset, collections.abc.Sequence, collections.abc.Set)


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
    `typer.Option` arguments per field (`formats=`, `envvar=`, `show_default=`)."""

    model: type[M]
    only: Sequence[str] | None = None
    exclude: Collection[str] = ()
    prefix: str = ""
    flags: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] | BaseModel | None = None
    panel: str | None = None
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

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
            option = typer.Option(*decls, help=info.description or "", rich_help_panel=self.panel, **more)
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

        @functools.wraps(fn)
        def command(**kwargs: Any) -> R:
            for key, group in groups.items():
                kwargs[key] = group.take(kwargs)
            return fn(**kwargs)

        command.__signature__ = sig.replace(parameters=params)  # pyright: ignore[reportAttributeAccessIssue]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
