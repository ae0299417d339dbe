"""Where a model comes from: a directory, a Hugging Face hub id already in the local cache, or
the small model embedded in pagedkv (ENG-082); and what ``dtype="auto"`` means for it
(ENG-081).

Nothing here reaches the network: a hub id is looked up in the local Hugging Face cache only
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as
``huggingface_hub`` does with ``local_files_only``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pagedkv.errors import CheckpointError

#: A hub id: ``name`` or ``owner/name``, of letters, digits, ``-``, ``_`` and ``.``.
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
#: ``config.json`` dtype names, as torch and transformers write them, by pagedkv's name.
_CONFIG_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(repo_id: str) -> Path:
    """The local snapshot of hub model ``repo_id`` (its ``main`` revision).

    Raises:
        CheckpointError: the id is not in the local cache (one line naming it).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        path = snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"model {repo_id!r} is neither a directory nor in the local Hugging Face cache "
            f"({cache}); download it first (huggingface-cli download {repo_id}) or pass a "
            "directory"
        ) from None
    return Path(str(path))


def resolve_model(model: str | Path | None) -> Path:
    """The directory of ``model``: the embedded model for ``None``, a directory as given, else
    a hub id found in the local cache.

    Raises:
        CheckpointError: a path that is not a directory, an id not in the cache, or the
            embedded model missing from this installation.
    """
    if model is None:
        from pagedkv.assets import default_model_dir, has_default_model

        if not has_default_model():
            raise CheckpointError(
                "the embedded default model is missing from this installation; pass a model"
            )
        return default_model_dir()
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{model} is not a directory")
    name = str(model)
    if path.is_absolute() or name.startswith(".") or not _HUB_ID.match(name):
        raise CheckpointError(f"model directory {model} does not exist")
    return cached_snapshot(name)


def resolve_dtype(dtype: str, model_dir: str | Path) -> str:
    """``dtype`` itself, or for ``"auto"`` the checkpoint's own: ``config.json``'s ``dtype``
    (transformers 5) or ``torch_dtype``, ``float32`` when it names none.

    Raises:
        CheckpointError: ``config.json`` names a dtype pagedkv does not run (named).
    """
    if dtype != "auto":
        return dtype
    path = Path(model_dir) / "config.json"
    config: Any = {}
    if path.exists():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    if name is None:
        return "float32"
    short = str(name).removeprefix("torch.")
    if short not in _CONFIG_DTYPES:
        raise CheckpointError(
            f"{path}: dtype {name!r} is not one pagedkv runs "
            f"({', '.join(sorted(set(_CONFIG_DTYPES.values())))})"
        )
    return _CONFIG_DTYPES[short]
