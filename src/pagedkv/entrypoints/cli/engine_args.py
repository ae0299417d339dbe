"""Command-line flags shared by the commands that build an engine, and the engine they build.

The flags are generated from the one table of engine arguments,
:data:`pagedkv.engine.engine_args.ENGINE_ARGS`, under vLLM's names (``--max-model-len``,
``--gpu-memory-utilization``, ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``, ...),
so ``LLM(...)`` and the command line take the same arguments (ENG-180, SRV-120). pagedkv's
older spellings (``--page-size``, ``--no-prefix-caching``) still work.

Heavy modules (torch, transformers) are imported only when an engine is actually loaded, so
``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.engine.engine_args import ENGINE_ARGS, EngineArgs

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.interfaces import Engine

#: Width of wrapped help text, characters.
HELP_WIDTH = 79
#: Each engine argument's default, by name.
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(EngineArgs) if f.default is not MISSING
}


def wrap(text: str) -> str:
    """``text`` wrapped for a help screen whose formatter keeps descriptions as written."""
    return textwrap.fill(text, HELP_WIDTH)


def add_model_flag(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """``--model DIR``; with ``positional``, also ``MODEL`` as the first argument (as ``vllm
    serve MODEL``)."""
    help_text = (
        "Hugging Face format Qwen3 directory (config.json, *.safetensors, tokenizer files) or "
        "a hub id in the local Hugging Face cache; default: the small model embedded in pagedkv"
    )
    if positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=help_text)
    parser.add_argument("--model", metavar="DIR", default=None, help=help_text)


def _embedded_context() -> str:
    """The embedded model's context length, for ``--help`` (read from its config.json)."""
    try:
        from pagedkv.model_source import resolve_model

        config = json.loads((resolve_model(None) / "config.json").read_text(encoding="utf-8"))
        return f"; {int(config['max_position_embeddings'])} for the embedded model"
    except Exception:  # --help must not fail on a broken install
        return ""


def _default_text(name: str) -> str:
    """The effective default of an engine argument, as ``--help`` shows it (SRV-120)."""
    if name == "max_model_len":
        return f"default: the model's max_position_embeddings{_embedded_context()}"
    if name == "num_pages":
        return (
            "default: sized by --kv-cache-memory-bytes, by --gpu-memory-utilization on CUDA, "
            "by VLLM_CPU_KVCACHE_SPACE on the CPU, else 512"
        )
    if name == "served_model_name":
        return "default: the model directory's name, the hub id, or pagedkv-default"
    if name == "tokenizer":
        return "default: the model's"
    value = _DEFAULTS.get(name)
    if value is None:
        return "default: none"
    if isinstance(value, bool):
        return f"default: {'on' if value else 'off'}"
    return f"default: {value}"


def add_engine_flags(parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """The engine arguments as flags (ENG-180); ``serve`` adds those only the server uses.
    A flag the command already defines for another purpose (``generate``'s per-request
    ``--seed``) is left to it."""
    group = parser.add_argument_group("engine (vLLM's engine arguments)")
    taken = set(parser._option_string_actions)
    for spec in ENGINE_ARGS:
        flag = "--" + spec.name.replace("_", "-")
        if (spec.serve_only and not serve) or flag in taken:
            continue
        help_text = f"{spec.help} ({_default_text(spec.name)})"
        if spec.parse is None:
            if spec.name == "enable_prefix_caching":
                group.add_argument(
                    flag,
                    dest=spec.name,
                    action=argparse.BooleanOptionalAction,
                    default=_DEFAULTS[spec.name],
                    help=help_text,
                )
                group.add_argument(
                    "--no-prefix-caching",
                    dest=spec.name,
                    action="store_false",
                    help="the same as --no-enable-prefix-caching",
                )
            else:
                group.add_argument(flag, dest=spec.name, action="store_true", help=help_text)
            continue
        names = [flag, "--page-size"] if spec.name == "block_size" else [flag]
        group.add_argument(
            *names,
            dest=spec.name,
            type=_flag_type(spec.name, spec.parse),
            default=_DEFAULTS.get(spec.name),
            metavar=spec.metavar,
            choices=spec.choices,
            help=help_text,
        )


def _flag_type(name: str, parse: Any) -> Any:
    """``parse`` with its ``ValueError`` turned into argparse's message naming the value."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) or f"invalid {name}: {text!r}") from None

    convert.__name__ = name
    return convert


def seed_flag(text: str) -> int:
    """A ``--seed`` value: an integer in ``[0, 2**64 - 1]``, what the API takes (SRV-119)."""
    from pagedkv.engine.engine_args import parse_seed

    try:
        return parse_seed(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_of(args: argparse.Namespace) -> str | None:
    """The model the command line names: ``MODEL`` or ``--model`` (both: the same).

    Raises:
        InvalidRequest: both given and different.
    """
    from pagedkv.errors import InvalidRequest

    positional: str | None = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise InvalidRequest(f"the model is given twice: {positional!r} and --model {args.model!r}")
    given: str | None = args.model
    return positional if positional is not None else given


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The :class:`EngineArgs` the flags ask for.

    Raises:
        InvalidRequest: a value is out of range; the message names the field.
    """
    given = {
        spec.name: getattr(args, spec.name) for spec in ENGINE_ARGS if hasattr(args, spec.name)
    }
    if getattr(args, "generation_config", None) is not None:
        given["generation_config"] = args.generation_config
    if "seed" in given and not isinstance(given["seed"], int):
        del given["seed"]
    return EngineArgs(model=model_of(args), **given)


def resolve_model_dir(value: str | None) -> Path:
    """The model directory a ``--model`` value names: a directory, a hub id in the local
    Hugging Face cache, or the embedded model for ``None``.

    Raises:
        CheckpointError: no such directory or cached id, or the embedded model is missing.
    """
    from pagedkv.model_source import resolve_model

    return resolve_model(value)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the flags ask for, for the model they name.

    Raises:
        InvalidRequest: a value is out of range; the message names the field.
    """
    chosen = engine_args(args)
    return chosen.engine_config(resolve_model_dir(chosen.model))


def load_engine(args: argparse.Namespace) -> Engine:
    """Load the engine the flags describe (``load_engine_from_args``).

    Raises:
        CheckpointError: a missing or malformed file (``UnsupportedModel`` for an architecture
            pagedkv does not implement).
        InvalidRequest: a bad dtype, device or engine argument.
    """
    from pagedkv.engine.engine_args import load_engine_from_args

    return load_engine_from_args(engine_args(args))


def close_engine(engine: Engine) -> None:
    """Release what the engine holds beyond memory (a tensor-parallel model's workers,
    TP-023); engines without a ``close`` hold nothing of the kind."""
    from pagedkv.interfaces import Closable

    if isinstance(engine, Closable):
        engine.close()
