"""Load a Hugging Face Qwen3 or Qwen3-MoE checkpoint (``config.json`` + safetensors).

The model is built on the meta device, materialised once on the target device (``to_empty``),
then filled tensor by tensor straight from the safetensors file(s): at no moment does a second
full copy of the weights exist. Every tensor name and shape is checked against the model before
any weight is read, so a bad checkpoint fails fast with a :class:`~pagedkv.errors.CheckpointError`
that names the offending tensor. Per-expert MoE tensors are copied into the model's stacked
expert parameters, and the parts of merged projections (q/k/v, gate/up) into their rows
(:mod:`pagedkv.model.checkpoint_layout`).

One rank of a tensor-parallel group loads only its shard: its blocks of the split tensors are
read with ``get_slice``, so no rank ever holds a whole split tensor (TP-004).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pagedkv.device import DEFAULT_DEVICE, torch_device, torch_dtype
from pagedkv.errors import CheckpointError
from pagedkv.model.checkpoint_layout import ShardedPiece, checkpoint_pieces, shard_pieces
from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import MergedLinear
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.tensor_parallel import Collectives, ShardLayout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: How many names an error message lists before summarising the rest.
MAX_NAMES_IN_ERROR = 8


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str | torch.device = DEFAULT_DEVICE,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    collectives: Collectives | None = None,
    progress: bool | None = None,
) -> Qwen3ForCausalLM:
    """Load the checkpoint in ``model_dir`` for inference, or one tensor-parallel rank's shard
    of it.

    Args:
        model_dir: a directory with ``config.json`` and either ``model.safetensors`` or
            ``model.safetensors.index.json`` and its shards.
        dtype: parameter dtype, ``float32``, ``bfloat16`` or ``float16``; checkpoint tensors
            are converted as they are copied in.
        device: where the parameters live, e.g. ``cpu`` or ``cuda:0``.
        tp_rank: this rank of a tensor-parallel group (specs/tensor-parallel.md).
        tp_size: ranks in the group; 1 loads the whole model.
        collectives: the group's collectives, which the shard's layers call (needed to run,
            not to load, a shard of a group of several).
        progress: draw a progress bar over the tensors on stderr (SRV-122); ``None`` (the
            default) draws it where stderr is a terminal, ``False`` never.

    Returns:
        The model in eval mode with ``requires_grad`` off on every parameter.

    Raises:
        CheckpointError: a missing directory, config, weight file or tensor, a tensor of the
            wrong shape, or tensors the model does not have; the message names each of them.
        UnsupportedModel: the config asks for something pagedkv does not implement, or a
            dimension ``tp_size`` ranks cannot split (TP-003).
        InvalidRequest: an unknown ``dtype``, or a ``device`` that is invalid or unavailable.
    """
    target_dtype = torch_dtype(dtype)
    target_device = torch_device(device)
    directory = Path(model_dir)
    config = ModelConfig.from_dir(directory)
    layout = ShardLayout.of(config, tp_rank, tp_size)
    paths, index = _weight_files(directory)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config, layout, collectives)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    merged = merged_parts(model)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in paths}
        locations = _locate(index, handles, config)
        pieces = shard_pieces(checkpoint_pieces(shapes, locations.keys(), merged), config, layout)
        _check_names(pieces, locations)
        _check_shapes(pieces, locations, handles)
        model = model.to(dtype=target_dtype).to_empty(device=target_device)
        if layout.vocab_stop - layout.vocab_start < layout.vocab_rows:
            _zero_vocab_padding(model)
        params = dict(model.named_parameters())
        bar = tqdm(
            pieces,
            desc="loading weights",
            unit="tensor",
            disable=None if progress is None else not progress,
        )
        for piece in bar:
            path = locations[piece.tensor]
            with torch.no_grad():
                params[piece.param][piece.index].copy_(_read(handles[path], piece, path))
    model.eval()
    model.requires_grad_(False)
    return model


def merged_parts(model: Qwen3ForCausalLM) -> dict[str, tuple[tuple[str, int], ...]]:
    """The model's merged projections and their parts (see
    :mod:`pagedkv.model.checkpoint_layout`)."""
    return {n: m.parts for n, m in model.named_modules() if isinstance(m, MergedLinear)}


def checkpoint_tensors(
    model: Qwen3ForCausalLM, stored: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """The model's weights under the names a checkpoint stores them by: views into the
    parameters, the inverse of loading. Merged projections are split into their parts; MoE
    experts are per expert unless ``stored`` holds their stacked names (transformers'
    in-memory layout)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    return {
        piece.tensor: params[piece.param][piece.index]
        for piece in checkpoint_pieces(shapes, stored, merged_parts(model))
    }


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files, and the index's map of tensor name to file (empty if unsharded)."""
    single = directory / SINGLE_FILE
    index = directory / INDEX_FILE
    if single.is_file():
        return [single], {}
    if not index.is_file():
        raise CheckpointError(f"no weights in {directory}: neither {single} nor {index} exists")
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read weight index {index}: {exc}") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"weight index {index} has no 'weight_map' of name -> file")
    files: dict[str, Path] = {}
    for name, shard in weight_map.items():
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"shard {path} (holding tensor {name!r}) does not exist")
        files[name] = path
    return sorted(set(files.values())), files


class _Handle:
    """An open safetensors file with its path, for error messages."""

    def __init__(self, path: Path, raw: Any) -> None:
        self.path = path
        self.raw = raw

    def names(self) -> list[str]:
        return list(self.raw.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.raw.get_slice(name).get_shape())


@contextmanager
def _open(path: Path) -> Iterator[_Handle]:
    """Open a safetensors file (header only), turning its errors into CheckpointError."""
    try:
        opened = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc
    with opened as raw:
        yield _Handle(path, raw)


def _locate(
    index: Mapping[str, Path], handles: Mapping[Path, _Handle], config: ModelConfig
) -> dict[str, Path]:
    """Every tensor name actually present, mapped to the file holding it."""
    locations: dict[str, Path] = {}
    for path, handle in handles.items():
        for name in handle.names():
            locations.setdefault(name, path)
    for name, path in index.items():
        if locations.get(name) != path:
            raise CheckpointError(f"tensor {name!r} is listed in the index but not in {path}")
    if config.tie_word_embeddings:
        # Some tied checkpoints also store the head; the tie makes it the embedding table.
        locations.pop("lm_head.weight", None)
    return locations


def _names(names: set[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(repr(n) for n in ordered[:MAX_NAMES_IN_ERROR])
    extra = len(ordered) - MAX_NAMES_IN_ERROR
    return shown + (f" and {extra} more" if extra > 0 else "")


def _zero_vocab_padding(model: Qwen3ForCausalLM) -> None:
    """Zero the padding rows of the last rank's vocabulary block: never looked up, and their
    logits are cut off, but they must not hold whatever the allocator left there (NaN)."""
    real = model.layout.vocab_stop - model.layout.vocab_start
    with torch.no_grad():
        model.model.embed_tokens.weight[real:].zero_()
        if model.lm_head is not None:
            model.lm_head.weight[real:].zero_()


def _check_names(pieces: list[ShardedPiece], locations: Mapping[str, Path]) -> None:
    needed = {piece.tensor for piece in pieces}
    missing = needed - set(locations)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s) {_names(missing)}")
    unexpected = set(locations) - needed
    if unexpected:
        raise CheckpointError(
            f"checkpoint has tensor(s) the model does not use: {_names(unexpected)}"
        )


def _check_shapes(
    pieces: list[ShardedPiece], locations: Mapping[str, Path], handles: Mapping[Path, _Handle]
) -> None:
    for piece in pieces:
        found = handles[locations[piece.tensor]].shape(piece.tensor)
        if found != piece.shape:
            raise CheckpointError(
                f"tensor {piece.tensor!r} has shape {list(found)}, expected {list(piece.shape)}"
            )


def _read(handle: _Handle, piece: ShardedPiece, path: Path) -> torch.Tensor:
    """The piece's tensor, or only its block (``piece.source``) of it."""
    name = piece.tensor
    try:
        if piece.source:
            tensor: torch.Tensor = handle.raw.get_slice(name)[piece.source]
        else:
            tensor = handle.raw.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from exc
    if not tensor.dtype.is_floating_point:
        raise CheckpointError(f"tensor {name!r} has non-floating dtype {tensor.dtype}")
    return tensor
