"""The spec reference, generated from the pydantic schema: `python -m rollplex.report.specdoc > docs/spec.md`.

One table per section of the spec: every key with its type, its default and its description, as the schema
states them. A test keeps `docs/spec.md` equal to what this prints.
"""

from __future__ import annotations

import json
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rollplex.graph.spec import Spec

HEADER = """# Spec reference

A spec is one YAML file (`specs/` has examples). This page is generated from the schema in
`rollplex/graph/spec.py` (`python -m rollplex.report.specdoc > docs/spec.md`); a test keeps it current.
Unknown keys are errors; every error names the key and its line.
"""


def spec_reference() -> str:
    parts = [HEADER]
    top = [(name, field) for name, field in Spec.model_fields.items() if _model_of(field.annotation) is None]
    parts.append(_table("Top level", [_row(name, f) for name, f in top]))
    for name, field in Spec.model_fields.items():
        model = _model_of(field.annotation)
        if model is not None:
            parts.append(_table(f"`{name}`", list(_rows(model, f"{name}."))))
    return "\n".join(parts)


def _rows(model: type[BaseModel], prefix: str, within: str = ""):
    """`within`: the optional section these keys belong to (their `required` holds only when it is given)."""
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        nested = _model_of(field.annotation)
        optional = nested is not None and not field.is_required() and field.default is None
        if nested is None or _is_sequence(field.annotation) or optional:
            yield _row(key, field, within)  # a list of sections: the list, then the keys of each item
        if nested is not None:
            yield from _rows(nested, key + ".", key if optional else within)


def _row(key: str, field, within: str = "") -> tuple[str, str, str, str]:
    required = f"required with `{within}`" if within else "required"
    default = required if field.is_required() else _value(field.default)
    bounds = ", ".join(_bound(m) for m in field.metadata if _bound(m))
    kind = _type(field.annotation) + (f" ({bounds})" if bounds else "")
    return f"`{key}`", kind, default, (field.description or "").replace("|", "\\|")


def _bound(constraint) -> str:
    """'> 0' for annotated-types' Gt(gt=0), and so on; '' for anything else."""
    for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if type(constraint).__name__.lower() == attr:
            return f"{sign} {getattr(constraint, attr)}"
    return ""


def _table(title: str, rows: list[tuple[str, str, str, str]]) -> str:
    lines = [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(lines) + "\n"


def _value(value) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True)
    if isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(mode="json", by_alias=True) for v in value]
    return f"`{json.dumps(value)}`"


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is tuple:
        inner = _type(args[0]) if args else ""
        return f"list of {inner}" if len(args) == 2 and args[1] is Ellipsis else f"[{', '.join(map(_type, args))}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    metadata = getattr(annotation, "__metadata__", ())
    base = typing.get_args(annotation)[0] if metadata else annotation
    name = getattr(base, "__name__", str(base)).replace("NoneType", "null")
    bounds = ", ".join(_bound(m) for m in metadata if _bound(m))
    return name + (f" ({bounds})" if bounds else "")


def _model_of(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        for inner in (candidate, *typing.get_args(candidate)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _is_sequence(annotation) -> bool:
    return typing.get_origin(annotation) is tuple or any(
        typing.get_origin(a) is tuple for a in typing.get_args(annotation)
    )


if __name__ == "__main__":
    print(spec_reference(), end="")
