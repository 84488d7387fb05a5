"""Command-line options generated from a recipe section: each field is an option, so a setting is
declared once (in specctl.recipe) and `--help`, the recipe reference and the command agree.

A field `num_prompts: int` becomes `--num-prompts INTEGER`, its help the field's description and
its shown default the schema's. Every generated option defaults to None ("not given"), so the
recipe's value stays unless the flag is passed. Lists are comma lists (`--request-rate 1,4,inf`),
Literals show their choices as the metavar (`off|on|both`) and are checked by the schema like any
value (one error path, naming the flag: `settings_from_flags`), booleans are flags that turn the
setting on (`--allow-key-over-http`; a recipe's `true` stays on without one). A
field's metadata (`recipe.cli`) renames the flag or leaves the option to the command.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rich.markup import escape

Command = Callable[..., Any]


@dataclass(frozen=True)
class FieldOption:
    """One generated option: the field it sets and how the command line spells it."""

    name: str  # the field, and the command function's parameter
    flags: tuple[str, ...]  # `--num-prompts`, or the field's own spellings (`--repeat`, `--repeats`)
    kind: type  # what click parses: int, float, str or bool (a list: str, split on commas)
    is_list: bool
    metavar: str | None
    help: str
    default: str | None  # the schema's default as --help shows it (None: none to show)


def _scalar(annotation: Any) -> tuple[Any, bool]:
    """(the element annotation, is it a list) with `X | None` and Annotated[X, ...] unwrapped."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return _scalar(args[0]) if len(args) == 1 else (str, False)
    if origin is Annotated:
        return _scalar(get_args(annotation)[0])
    if origin is list:
        return _scalar(get_args(annotation)[0])[0], True
    return annotation, False


def _kind(element: Any) -> tuple[type, str | None]:
    """(the type click parses, the metavar a Literal shows its choices as)."""
    if get_origin(element) is Literal:
        return str, "|".join(map(str, get_args(element)))
    if element in (int, float, bool):
        return element, None
    return str, None


def _default_text(f: FieldInfo) -> str | None:
    value = f.get_default(call_default_factory=True)
    if value is None or value == []:
        return None
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def field_options(model: type[BaseModel]) -> list[FieldOption]:
    """An option per field of `model`, in schema order, but for those the command declares itself
    (`recipe.COMMAND_DECLARES`) and sections within it."""
    from specctl.recipe import cli_spelling

    out = []
    for name, f in model.model_fields.items():
        flags, metavar = cli_spelling(name, f)
        element, is_list = _scalar(f.annotation)
        if not flags or (isinstance(element, type) and issubclass(element, BaseModel)):
            continue
        kind, choices = _kind(element)
        if is_list:  # a comma list: click takes the text, the schema each item
            choices, kind = choices or f"{kind.__name__.upper()},...", str
        out.append(
            FieldOption(name, flags, kind, is_list, metavar or choices, f.description or "", _default_text(f))
        )
    return out


def option_parameter(option: FieldOption) -> inspect.Parameter:
    """The keyword parameter typer reads the option from: `name: Annotated[kind | None, Option]`."""
    default = f" \\[default: {escape(option.default)}]" if option.default is not None else ""
    metavar = "" if option.kind is bool else option.metavar  # a flag takes no value (cli.Flag)
    info = typer.Option(
        *option.flags, help=escape(option.help) + default, metavar=metavar, show_default=False
    )
    return inspect.Parameter(
        option.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[option.kind | None, info],
    )


def with_section_options(load_model: Callable[[], type[BaseModel]]) -> Callable[[Command], Command]:
    """Decorate a command whose `**settings` collects the options of a recipe section
    (`load_model()`); register it with `cls=SectionOptionsCommand`. Its signature keeps the
    options the command declares itself; the section's are added when the command is parsed or
    its help shown (SectionOptionsCommand), each passed as a keyword (None when not given)."""

    def decorate(func: Command) -> Command:
        signature = inspect.signature(func, eval_str=True)
        params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        func.section_model = load_model  # type: ignore[attr-defined]
        return func

    return decorate


class SectionOptionsCommand(typer.core.TyperCommand):
    """A command with an option per field of a recipe section, generated the first time its
    parameters are asked for (parsing, --help): the schema imports the drafters (torch, ~2.4 s),
    which `specctl --version` and every other command's start should not wait for (as
    cli.AlgoHelpCommand fills in the algorithms only for --help)."""

    def get_params(self, ctx: Any) -> list[Any]:
        if not getattr(self, "_section_options", False):
            self._section_options = True
            self._add_section_options()
        return super().get_params(ctx)

    def _add_section_options(self) -> None:
        """typer's parameters and callback rebuilt from the signature with the section's options:
        the command function, its `__signature__` extended by them, is registered on a bare Typer
        app and built by typer's public `typer.main.get_command`, as `app.command()` would; only its
        parameters and callback are taken (name, help and the rest stay this command's)."""
        func = self.callback.__wrapped__  # typer's wrapper around the command function
        signature = inspect.signature(func)
        generated = [option_parameter(o) for o in field_options(func.section_model())]

        def command(**kwargs: Any) -> Any:
            return func(**kwargs)

        command.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*signature.parameters.values(), *generated]
        )
        app = typer.Typer(add_completion=False)
        app.command()(command)
        built = typer.main.get_command(app)
        self.params, self.callback = built.params, built.callback


def given_settings(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """The options that were passed (not None), as the schema takes them: comma lists split into
    their items (the schema converts and checks each)."""
    out = {}
    for option in field_options(model):
        value = values.get(option.name)
        if value is None or value is False:  # a flag not passed (typer may say False)
            continue
        out[option.name] = [part.strip() for part in value.split(",")] if option.is_list else value
    return out
