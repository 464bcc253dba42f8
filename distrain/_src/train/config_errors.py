"""Config errors in our words: pydantic's validation errors as one message.

``config.py`` and its section modules hold the schema (one pydantic model per section);
this module turns pydantic's list of errors into one :class:`ConfigError` with one
sentence per problem: an unknown key with the closest valid one, a wrong type named as
the schema names it, the valid choices of a literal.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

import pydantic
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A config file or override that does not match the schema."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _literals(tp: Any) -> list[str]:
    """The string choices a field accepts (for "Did you mean ...?")."""
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return [c for a in typing.get_args(tp) for c in _literals(a)]


def _suggest(key: str, valid: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean {prefix + close[0]!r}?" if close else ""


def is_section(tp: Any) -> typing.TypeGuard[type[pydantic.BaseModel]]:
    return isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def _optional_section(tp: Any) -> Any:
    """The section of an optional one (``WandbConfig | None``), else ``tp``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1
    return args[0] if optional and is_section(args[0]) else tp


def unknown_key(full: str, key: str, section: str, model: type[pydantic.BaseModel]) -> str:
    names = list(model.model_fields)
    prefix = f"{section}." if section else ""
    return (
        f"Unknown config key {full!r}.{_suggest(key, names, prefix)} Valid keys"
        f"{' in ' + repr(section) if section else ''}: {', '.join(names)}."
    )


_ITEM_TYPES = {"string_type": "str", "int_type": "int", "float_type": "float", "bool_type": "bool"}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">"}  # the schema's Field(ge=, gt=)


def _field_message(path: str, field: FieldInfo, errors: list[ErrorDetails]) -> str:
    """One sentence for all of pydantic's errors about one field (a union gives several)."""
    tp, value = field.annotation, errors[0]["input"]
    received = f"Received: {value!r}"
    for e in errors:
        if e["type"] == "value_error":  # a cross-field check raised ConfigError
            return str(e["ctx"]["error"])
        if e["type"] == "missing":
            if is_section(tp):
                required = [n for n, f in tp.model_fields.items() if f.is_required()]
                return f"Config section {path!r} is required; it needs {', '.join(required)}."
            what = f": {field.description}" if field.description else " (it has no default)"
            return f"Config field {path!r} is required{what}."
        if e["type"] == "model_type":
            return (
                f"Config section {path!r} must be a mapping of keys to values. "
                f"{received} ({type(value).__name__})."
            )
        if e["type"] in _BOUNDS:
            (bound,) = e["ctx"].values()
            null = " or null" if type(None) in typing.get_args(tp) else ""
            return f"Config field {path!r} must be {_BOUNDS[e['type']]} {bound}{null}. {received}."
        if e["type"] == "finite_number":
            return f"Config field {path!r} must be a finite number. {received}."
    if path.endswith("]"):  # an item of a list: name the type pydantic expected there
        expected = _ITEM_TYPES.get(errors[0]["type"], errors[0]["msg"])
        return f"Config field {path!r} must be {expected}. {received} ({type(value).__name__})."
    choices = _literals(tp)
    suggestion = _suggest(value, choices) if isinstance(value, str) else ""
    if typing.get_origin(tp) is Literal:
        return f"Config field {path!r} must be one of {_type_name(tp)}. {received}.{suggestion}"
    yaml_hint = ""
    if isinstance(value, str) and tp in (int, float) and "e" in value.lower():
        yaml_hint = " (YAML reads 1e-3 as a string; write 1.0e-3)"
    return (
        f"Config field {path!r} must be {_type_name(tp)}. {received} "
        f"({type(value).__name__}){yaml_hint}.{suggestion}"
    )


def translate(error: pydantic.ValidationError, root: type[pydantic.BaseModel]) -> ConfigError:
    """pydantic's errors about a ``root`` config as one message: one sentence per unknown
    key or bad field."""
    messages: list[str] = []
    fields: dict[str, tuple[FieldInfo, list[ErrorDetails]]] = {}
    for e in error.errors():
        if not e["loc"]:  # the root's own check (across sections), or "not a mapping"
            if e["type"] == "value_error":
                return ConfigError(str(e["ctx"]["error"]))
            value = e["input"]
            return ConfigError(
                "A config must be a mapping of keys to values. "
                f"Received: {value!r} ({type(value).__name__})."
            )
        # Walk the location through the sections to the field it is about; what follows
        # (a union member's tag, a list index) belongs to that field.
        model: Any = root
        path: list[str] = []
        for part in e["loc"]:
            if not is_section(model):
                break
            if part not in model.model_fields:  # a key not in the schema (or not a string)
                full = ".".join([*path, str(part)])
                messages.append(unknown_key(full, str(part), ".".join(path), model))
                break
            path.append(str(part))
            field = model.model_fields[str(part)]
            model = _optional_section(field.annotation)
        if e["type"] not in ("extra_forbidden", "invalid_key"):
            where = ".".join(path) + "".join(f"[{i}]" for i in e["loc"] if isinstance(i, int))
            fields.setdefault(where, (field, []))[1].append(e)
    messages += [_field_message(path, f, errors) for path, (f, errors) in fields.items()]
    return ConfigError(" ".join(messages))
