"""The base of every section of the YAML spec (`spec.py`): what any setting must be to be read at all."""

from __future__ import annotations

import math
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator

MAX_NUMBER = 10**12  # no count, size or rate of a real run comes near it


class Strict(BaseModel):
    """Unknown keys, NaN and infinity refused; a boolean is not a number; a number beyond MAX_NUMBER is no real
    setting (a typo, or a value meant to overflow)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _sane_numbers(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            key = field.alias or name
            value = data.get(key)
            if isinstance(value, bool) and not _takes_bool(field.annotation):
                raise ValueError(
                    f"{key} takes {_what_it_takes(field.annotation)}, not the boolean {str(value).lower()}"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, not {value}")
            _bounded(key, value)
        return data

    @model_validator(mode="after")
    def _real_sizes(self) -> Strict:
        """After coercion, so that a number YAML read as text ('1e30', without a dot) is bounded as well."""
        for name, field in type(self).model_fields.items():
            _bounded(field.alias or name, getattr(self, name))
        return self


def _bounded(key: str, value: object) -> None:
    """As given (before the field's own limits, for this message) and as coerced (a number YAML read as text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise ValueError(f"{key} {value:.3g} is beyond any real setting (at most {MAX_NUMBER:.0e})")


def _what_it_takes(annotation: object) -> str:
    """'a number', or 'a number or a name' where the field also takes a string (a choice, a path, `auto`)."""
    kinds = (annotation, *get_args(annotation))
    names = any(k is str or get_origin(k) is Literal for k in kinds)
    return "a number or a name" if names else "a number"


def _takes_bool(annotation: object) -> bool:
    return annotation is bool or bool in getattr(annotation, "__args__", ())
