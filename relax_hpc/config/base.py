"""What every config section shares: :class:`Section` (strict keys, docstrings as descriptions, finite floats, 64-bit
integers) and :class:`Variants`, a section whose keys depend on one selecting key (a discriminated union).

A variant section (``trainer`` by ``backend``, ``rollout`` by ``engine``, ``algorithm`` by ``name``) is one model
per variant, all subclasses of the section's base; the selecting key picks the model, so a key of a variant that is
not selected is an error (``trainer.megatron`` with ``trainer.backend: torch``), never ignored. No torch here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, field_validator

INT_LIMIT = 2**63 - 1
"""Largest integer any field takes (torch's int64); seeds are further limited to what numpy takes."""
SEED_LIMIT = 2**32 - 1
"""Largest seed (numpy's ``RandomState`` refuses more)."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings become descriptions; NaN and
    infinities are refused in every float; integers must fit in 64 bits."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_LIMIT:
            raise ValueError(f"must fit in a 64-bit integer (|value| <= {INT_LIMIT})")
        return v


_ABSENT = object()


@dataclass(frozen=True, eq=False)
class Variants:
    """The variants of one section: ``key`` (the selecting key) -> a tag -> the model of that variant.

    ``family`` maps the key's value to a tag where several values share one variant (``algorithm.name``: ``grpo``,
    ``gspo`` and user algorithms share one; ``sapo`` and ``distill`` have options of their own); None: the value is
    the tag. ``default``: the tag when the key is not given. The section's annotation is :meth:`annotation`."""

    key: str
    models: Mapping[str, type[BaseModel]]
    default: str
    family: Callable[[Any], str] | None = None

    def selected(self, value: Any) -> Any:
        """The selecting key's value in ``value`` (a mapping or a model), or the default's."""
        raw = value.get(self.key, _ABSENT) if isinstance(value, Mapping) else getattr(value, self.key, _ABSENT)
        return self.default if raw is _ABSENT else raw

    def tag_of(self, value: Any) -> str:
        """The variant tag of a section value (pydantic's discriminator)."""
        raw = self.selected(value)
        if self.family is not None:
            return self.family(raw) if isinstance(raw, str) else self.default  # the key's own type check reports it
        return raw if isinstance(raw, str) else repr(raw)  # no variant has it: reported as a bad value

    def annotation(self) -> Any:
        """``Annotated[Union[...], Discriminator]`` of the section's field (this object rides along as metadata)."""
        members = tuple(Annotated[model, Tag(tag)] for tag, model in self.models.items())
        return Annotated[Union[members], Discriminator(self.tag_of), self]  # noqa: UP007 (a runtime tuple)

    def owners(self, key: str) -> list[str]:
        """The tags of the variants that have ``key``."""
        return [tag for tag, model in self.models.items() if key in model.model_fields]

    def choices(self) -> str:
        """``'torch' or 'megatron'``: the values of the selecting key that pick a variant (for messages)."""
        names = [repr(t) for t in self.models]
        return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def variants_of(annotation: Any, metadata: list[Any] | None = None) -> Variants | None:
    """The :class:`Variants` a field was declared with, else None."""
    for item in [*(metadata or []), *getattr(annotation, "__metadata__", ())]:
        if isinstance(item, Variants):
            return item
    return None


@functools.cache
def union_points(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Variants]:
    """Every variant section under ``model`` by its key path (``("trainer",)`` -> the trainer's variants), nested
    ones included (a section inside a variant)."""
    out: dict[tuple[str, ...], Variants] = {}
    for name, f in model.model_fields.items():
        path = (*prefix, name)
        v = variants_of(f.annotation, f.metadata)
        subs = list(v.models.values()) if v is not None else _section_models(f.annotation)
        if v is not None:
            out[path] = v
        for sub in subs:
            out.update(union_points(sub, path))
    return out


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    args = getattr(annotation, "__args__", ())
    return [a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)][:1]
