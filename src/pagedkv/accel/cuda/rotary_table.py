"""The rotary substitute of ``fused_ops="triton"`` (ENG-232): a step's cos/sin rows gathered
from a table of every position the model serves, built once, instead of computed from the
step's positions.

Why: the reference computes a step's tables with a chain of elementwise launches (the angles,
their concatenation, cos, sin, the attention factor, the casts). A table makes them one gather,
which a captured step replays as one node, as vLLM's rotary cache does. The table is the
reference's own formula applied to every position at once, on the same device and cast to the
same dtype, so each row is the reference's value for that position.
"""

from __future__ import annotations

import torch

from pagedkv.accel.cuda.triton_substitute import TritonSubstitute
from pagedkv.accel.substitution import as_subclass
from pagedkv.model.rope import RotaryEmbedding


class TableRotaryEmbedding(RotaryEmbedding, TritonSubstitute):
    """A :class:`~pagedkv.model.rope.RotaryEmbedding` reading its rows from ``table``. Build it
    with :meth:`substitute`.

    Attributes:
        table: ``[positions, 2, head_dim]`` in the activation dtype: each position's ``cos``
            row, then its ``sin`` row (one gather serves both). A buffer of the substitute
            alone, not saved with the model.
    """

    table: torch.Tensor

    @classmethod
    def substitute(
        cls,
        rotary: RotaryEmbedding,
        *,
        positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> TableRotaryEmbedding:
        """``rotary``'s substitute holding the rows of positions ``0 .. positions - 1``, in
        ``dtype`` on ``device`` (``positions * 2 * head_dim`` elements), ``rotary`` not
        changed.

        Raises:
            ValueError: ``positions`` below 1.
        """
        if positions < 1:
            raise ValueError(f"a rotary table holds >= 1 position, got {positions}")
        every = torch.arange(positions, dtype=torch.int64, device=device)
        cos, sin = rotary(every, dtype)
        new = as_subclass(rotary, cls)
        new.register_buffer("table", torch.stack((cos, sin), dim=1), persistent=False)
        return new

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[T, head_dim]`` of ``positions`` ``[T]`` int64: views of one
        gather from the table (rows ``2 * head_dim`` apart, channels contiguous), or the
        reference's computation for a dtype or device the table is not in.

        Precondition: every position below the table's length. The engine never asks past it:
        its ``max_model_len`` is capped at the runner's ``max_positions``, the length the
        runner builds the table with (ENG-232). No host synchronisation.
        """
        table = self.table
        if dtype != table.dtype or positions.device != table.device:
            return super().forward(positions, dtype)
        rows = table.index_select(0, positions)
        return rows[:, 0], rows[:, 1]
