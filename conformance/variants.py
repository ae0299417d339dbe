"""Named variants: where the specs leave room, a backend declares which choice it made.

Two correct backends may legitimately differ (SQLAlchemy's suite calls such differences
requirements, open or closed per dialect). The suite never picks one backend's behaviour as
"the" answer: each room is a :class:`Variant` with named choices, a backend declares its choice
in an optional ``variants`` mapping, and the oracles follow the declaration. A backend that
declares nothing gets each variant's default (the reference's choice).

::

    @dataclass(frozen=True)
    class MyBackend:
        name: str = "mine"
        capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction"})
        variants: Mapping[str, str] = field(default_factory=lambda: {"orphans": "detach"})

The rooms are specified in ``specs/kv-manager.md`` (section "Variants").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Variant:
    """One room the spec leaves, and the choices a backend may declare.

    Attributes:
        name: the key in a backend's ``variants`` mapping.
        choices: each legal choice and what it means.
        default: the choice assumed when a backend declares none (the reference's).
        requirement: the spec ID that describes the room.
    """

    name: str
    choices: Mapping[str, str]
    default: str
    requirement: str


#: KVM-050: what becomes of prefix entries whose parent entry was evicted.
ORPHANS = Variant(
    name="orphans",
    choices={
        "block": "an orphan is never hit; it keeps its key until evicted itself, and a commit "
        "that reaches its key stops publishing for that sequence (chained-hash index)",
        "detach": "an orphan is never hit; a commit that reaches its prefix publishes its own "
        "page beside it (radix tree)",
        "reattach": "an orphan is hit again once its prefix is published again, and a commit "
        "that reaches its prefix continues the chain from it (index keyed by the whole prefix)",
    },
    default="block",
    requirement="KVM-050",
)

#: Every variant the suite knows, by name.
VARIANTS: dict[str, Variant] = {v.name: v for v in (ORPHANS,)}


class VariantError(ValueError):
    """A backend declares an unknown variant or an unknown choice."""


def declared_variants(backend: object) -> dict[str, str]:
    """The backend's choice for every known variant, completed with the defaults.

    ``variants`` is optional: a mapping of variant names to choices, or a set of strings in
    which ``"name=choice"`` declares a choice and a bare name declares a departure the suite
    does not model as a variant (it is ignored here: such backends list what it breaks in an
    expected-failures file).

    Raises:
        VariantError: ``variants`` is neither form, or names an unknown variant or choice.
    """
    raw: object = getattr(backend, "variants", None) or {}
    pairs: list[tuple[object, object]]
    if isinstance(raw, Mapping):
        pairs = list(raw.items())
    elif isinstance(raw, (set, frozenset, list, tuple)):
        pairs = [tuple(item.split("=", 1)) for item in raw if isinstance(item, str) and "=" in item]  # type: ignore[misc]
        if not all(isinstance(item, str) for item in raw):
            raise VariantError("'variants' must hold strings")
    else:
        raise VariantError("'variants' must be a mapping of variant names to choices")
    chosen = {name: variant.default for name, variant in VARIANTS.items()}
    for name, choice in pairs:
        if not isinstance(name, str) or not isinstance(choice, str):
            raise VariantError("'variants' must map variant names (str) to choices (str)")
        variant = VARIANTS.get(name)
        if variant is None:
            raise VariantError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
        if choice not in variant.choices:
            raise VariantError(
                f"variant {name!r} has no choice {choice!r}; choices: {sorted(variant.choices)}"
            )
        chosen[name] = choice
    return chosen
