"""Which extra variables a chat template reads, to check ``chat_template_kwargs`` against it.

A request may pass variables to the model's chat template (Qwen3's ``enable_thinking``). A
variable the template never reads would be ignored without a word, and one that shadows what the
renderer itself provides (``messages``, ``add_generation_prompt``, ``eos_token``, ...) would
change the prompt's structure; both are refused with :class:`InvalidTemplateKwargs` naming
the key. The template is parsed (never rendered) with jinja2, with the tags transformers
adds (``generation``) and loop controls. torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from pagedkv.errors import InvalidRequest


class InvalidTemplateKwargs(InvalidRequest):
    """A ``chat_template_kwargs`` key the chat template does not read or must not be given."""


#: Names the renderer provides or ``apply_chat_template`` takes itself.
RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "namespace",
        "dict",
    }
)


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The undeclared variables ``template`` reads (its inputs), by parsing it.

    Raises:
        InvalidRequest: the template is not valid jinja2.
    """
    import jinja2
    import jinja2.ext
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` marks; only parsed here."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    try:
        tree = environment.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(f"the model's chat template is not valid jinja2: {exc}") from exc
    return frozenset(jinja2.meta.find_undeclared_variables(tree))


def check_template_kwargs(templates: Sequence[str], kwargs: Mapping[str, object]) -> None:
    """Refuse a ``chat_template_kwargs`` key no template of the model reads, or one that must
    not be given.

    Args:
        templates: the tokenizer's chat template(s) (several when it has named ones).
        kwargs: the request's template variables.

    Raises:
        InvalidTemplateKwargs: naming the first offending key (alphabetically).
    """
    variables = frozenset().union(*(template_variables(t) for t in templates))
    for key in sorted(kwargs):
        if key in RESERVED_VARIABLES:
            raise InvalidTemplateKwargs(
                f"chat_template_kwargs key {key!r} is set by the server itself and cannot be given"
            )
        if key not in variables:
            readable = ", ".join(sorted(variables - RESERVED_VARIABLES)) or "none"
            raise InvalidTemplateKwargs(
                f"chat_template_kwargs key {key!r} is not read by this model's chat template "
                f"(it reads: {readable})"
            )
