"""The configuration reference (docs/configuration.md), generated from the config models' field descriptions.

The models are the one place a key's meaning is written: the reference is rendered from them, and a test keeps
the checked-in file equal to what this module renders."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from assay.core.config import Config

REGENERATE = "assay config reference --out docs/configuration.md"


@dataclass(frozen=True)
class Key:
    path: str  # dotted, list items as `[]`: `domains[].difficulty.min`
    type: str
    default: str
    constraints: str
    meaning: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level
    meaning: str
    shape: str  # what the section's own key holds: "" at the top level, else a sentence on its default
    keys: list[Key]


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (a section), and whether as a list of them; (None, False) for a plain key."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if get_origin(annotation) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    return None, False


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Paths of the fields, this model's and its sections', that have no description."""
    missing = []
    for name, field in model.model_fields.items():
        path = prefix + name
        if not (field.description or "").strip():
            missing.append(path)
        sub, many = _model_of(field.annotation)
        if sub is not None:
            missing += undocumented(sub, path + ("[]." if many else "."))
    return missing


def _type(annotation: Any) -> str:
    """A field's type in a YAML writer's terms: alternatives spelled out, literals as their values."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "none"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return _alternatives([f"`{a}`" for a in args])
    if origin in (Union, types.UnionType):
        return _alternatives([_type(a) for a in args])
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if origin is tuple:
        return "[" + ", ".join(_type(a) for a in args) + "]"
    return annotation.__name__


def _alternatives(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _yaml(value: Any) -> Any:
    """Tuples as the lists YAML writes them as."""
    if isinstance(value, (list, tuple)):
        return [_yaml(v) for v in value]
    if isinstance(value, dict):
        return {k: _yaml(v) for k, v in value.items()}
    return value


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, str):
        return f"`{value}`"
    # YAML's own spelling (true, 0.0003, [0.9, 0.99], {}), so that a default can be copied into a config
    text = yaml.safe_dump(_yaml(value), default_flow_style=True, width=10**6).strip()
    return f"`{text.removesuffix('...').strip()}`"


_BOUNDS = ((at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤"))


def _constraints(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, at.MinLen):
            found.append(f"at least {item.min_length} item{'s' if item.min_length != 1 else ''}")
    return ", ".join(found)


def sections(model: type[BaseModel] = Config, path: str = "", meaning: str = "", shape: str = "") -> list[Section]:
    """The model's own keys as one section, then each nested section (depth first, in field order)."""
    keys: list[Key] = []
    nested: list[Section] = []
    for name, field in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        sub, many = _model_of(field.annotation)
        if sub is not None:
            shape_of = ""
            if many:  # a single section's default is its keys' defaults; a list's is its own
                default, bounds = _default(field), _constraints(field)
                shape_of = ("A list of these" + (f" ({bounds})" if bounds else "")
                            + ("; required." if default == "required" else f", default {default}."))
            nested += sections(sub, dotted + ("[]" if many else ""), field.description or "", shape_of)
        else:
            keys.append(Key(dotted, _type(field.annotation), _default(field), _constraints(field),
                            field.description or ""))
    return [Section(path, meaning, shape, keys), *nested]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The reference as markdown: one table per section. Refuses a field without a description."""
    missing = undocumented(Config)
    if missing:
        raise ValueError("config fields without a description (Field(description=...) in "
                         f"src/assay/core/config.py): {', '.join(missing)}")
    lines = [f"*Generated by `{REGENERATE}` from the field descriptions in src/assay/core/config.py: "
             "edit those, not this file.*",
             "",
             "# Configuration reference",
             "",
             "A run is one YAML file of the sections below. Any key can be overridden on the command line as "
             "`key.sub=value` (list items by index or, for domains, by name: `domains.arith.group_size=4`); "
             "an unknown key, a wrong type or a bad value is reported as one line naming the key path.",
             ]
    for section in sections():
        lines += ["", f"## `{section.path}`" if section.path else "## Top level", ""]
        if section.meaning:
            lines += [_cell(section.meaning) + ".", ""]
        if section.shape:
            lines += [section.shape, ""]
        lines += ["| key | type | default | constraints | meaning |", "|---|---|---|---|---|"]
        lines += [f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.constraints)} | {_cell(k.meaning)} |"
                  for k in section.keys]
    return "\n".join(lines) + "\n"
