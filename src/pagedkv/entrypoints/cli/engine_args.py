"""Command-line flags shared by the commands that build an engine, and the engine they build.

Heavy modules (torch, transformers) are imported only when an engine is actually loaded, so
``--help`` and flag errors stay fast.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.device import DEFAULT_DEVICE

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.interfaces import Engine

DTYPES = ("float32", "bfloat16", "float16", "auto")
#: Width of wrapped help text, characters.
HELP_WIDTH = 79


def wrap(text: str) -> str:
    """``text`` wrapped for a help screen whose formatter keeps descriptions as written."""
    return textwrap.fill(text, HELP_WIDTH)


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="Hugging Face format Qwen3 directory (config.json, *.safetensors, tokenizer "
        "files); default: the small model embedded in pagedkv",
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The KV pool, batching budgets, dtype and device flags (see ``EngineConfig``)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--page-size",
        type=int,
        default=16,
        metavar="N",
        help="token positions per KV page (default 16)",
    )
    group.add_argument(
        "--num-pages", type=int, default=512, metavar="N", help="KV pages in the pool (default 512)"
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        metavar="N",
        help="most sequences in one step (default 64)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        metavar="N",
        help="most token positions computed in one step; longer prompts are prefilled in "
        "chunks (default 512)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        metavar="N",
        help="most positions one sequence may reach, prompt included (default 2048)",
    )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="parameter dtype; auto takes the checkpoint's (config.json dtype or torch_dtype) "
        "(default float32)",
    )
    group.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help=f"torch device, e.g. cpu or cuda:0 (default {DEFAULT_DEVICE})",
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse cached KV pages across requests",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks: N-1 worker processes on this machine (gloo on "
        "cpu, NCCL on cuda), or the ranks of a torchrun launch (default 1)",
    )
    group.add_argument(
        "--max-step-retries",
        type=int,
        default=2,
        metavar="N",
        help="times a request whose step failed with it running alone is run again before it "
        "fails; a failed step of several requests counts against none of them, its requests "
        "being run again in halves to find the cause (default 2)",
    )


def resolve_model_dir(value: str | None) -> Path:
    """The model directory a ``--model`` value names: a directory, a hub id in the local
    Hugging Face cache, or the embedded model for ``None``.

    Raises:
        CheckpointError: no such directory or cached id, or the embedded model is missing.
    """
    from pagedkv.model_source import resolve_model

    return resolve_model(value)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the flags ask for.

    Raises:
        InvalidRequest: a value is out of range; the message names the field.
    """
    from pagedkv.engine.config import EngineConfig

    return EngineConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_step_retries=args.max_step_retries,
    )


def load_engine(
    model_dir: Path,
    config: EngineConfig,
    args: argparse.Namespace,
    generation_config: str = "auto",
) -> Engine:
    """Load the checkpoint in ``model_dir`` with ``--dtype`` and ``--device``; the sampling
    defaults of ``generation_config`` (``auto``, ``vllm`` or a directory, see
    :meth:`~pagedkv.engine.generation_config.GenerationDefaults.load`) apply to requests that
    leave a field out (``generate`` passes every field, so it takes none).

    Raises:
        CheckpointError: a missing or malformed file (``UnsupportedModel`` for an architecture
            pagedkv does not implement).
        InvalidRequest: a bad dtype or device.
    """
    from pagedkv.backend import load_engine as load_reference_engine

    return load_reference_engine(
        model_dir,
        config,
        dtype=args.dtype,
        device=args.device,
        generation_config=generation_config,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def close_engine(engine: Engine) -> None:
    """Release what the engine holds beyond memory (a tensor-parallel model's workers,
    TP-023); engines without a ``close`` hold nothing of the kind."""
    from pagedkv.interfaces import Closable

    if isinstance(engine, Closable):
        engine.close()
