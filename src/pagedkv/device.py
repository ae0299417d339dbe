"""Where and in what dtype pagedkv computes: the one place that names the default device and
turns device and dtype names into torch's.

Every entry point (``LLM``, the backend, the runner, the command line, tensor parallelism)
defaults to :data:`DEFAULT_DEVICE` and checks a name here, once, where it is given; below
that, code reads the device of the tensors it is handed. torch-free at import, so the
Protocols' boundary objects can name the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

#: The device a model and its K/V pool live on when none is named.
DEFAULT_DEVICE = "cpu"

#: The dtype names a :class:`~pagedkv.interfaces.StoreConfig` and the loader accept.
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of :data:`DTYPE_NAMES`).

    Raises:
        InvalidRequest: any other name.
    """
    import torch

    if name not in DTYPE_NAMES:
        raise InvalidRequest(f"unsupported dtype {name!r}; expected one of {list(DTYPE_NAMES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def torch_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` (``cpu``, ``cuda``, ``cuda:1``, ...), checked to be usable.

    Raises:
        InvalidRequest: an unparsable name, or a CUDA device on a machine without CUDA.
    """
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequest(f"invalid device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r} requested but CUDA is not available")
    return device


def cuda_total_bytes(device: str) -> int:
    """Bytes of memory of the CUDA device ``device`` names (``cuda`` or ``cuda:N``).

    Raises:
        InvalidRequest: CUDA is not available.
    """
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequest(f"device {device!r} needs CUDA, which is not available")
    return int(torch.cuda.get_device_properties(torch_device(device)).total_memory)
