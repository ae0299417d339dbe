"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (ENG-190).

Exactly one constraint is given: a JSON schema (``json``), any JSON object (``json_object``),
a regular expression (``regex``), one of a list of strings (``choice``) or a grammar
(``grammar``: Lark, or GBNF as llama.cpp and xgrammar write it). The engine compiles it when
the request is added (:mod:`pagedkv.engine.grammar`); one it cannot compile is refused then,
naming the problem. torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidRequest


class InvalidStructuredOutputs(InvalidRequest):
    """A structured-output constraint that is malformed or cannot be compiled; the message
    names the problem."""


#: The constraint fields, exactly one of which a request sets.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's field names).

    Attributes:
        json: a JSON schema, as a mapping or its JSON text; stored as canonical JSON text so
            the object stays hashable.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings (a list, stored as a tuple).
        grammar: a context-free grammar in Lark or GBNF syntax.
        json_object: ``True``: the output is any JSON object.
        disable_any_whitespace: JSON is written without whitespace between tokens (vLLM's
            flag); by default whitespace is free, as in vLLM.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidStructuredOutputs(
                    "structured_outputs.choice must be a list of strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise InvalidStructuredOutputs("structured_outputs.choice must not be empty")
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise InvalidStructuredOutputs(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidStructuredOutputs(
                    f"structured_outputs.json is not valid JSON: {exc}"
                ) from None
            if not isinstance(schema, dict | bool):
                raise InvalidStructuredOutputs(
                    "structured_outputs.json must be a JSON schema (an object)"
                )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)
