"""Where a server's text first leaves the reference's, and whether that is a tie (CRT-011)."""

from __future__ import annotations

from pagedkv.certify.reference import INCOMPLETE, Reference, ReferenceRun
from pagedkv.certify.verdicts import Divergence


def first_divergence(reference: Reference, run: ReferenceRun, text: str) -> Divergence | None:
    """The first reference token whose text the server's ``text`` does not continue with;
    ``None`` when ``text`` is exactly the reference's text.

    The reference's tokens are decoded one more at a time; the diverging token is the first
    whose decoded prefix is no longer a prefix of ``text`` (a token ending mid-character may
    still match once the next completes it, so the search keeps the last matching prefix).
    """
    expected = reference.decode(run.token_ids)
    text = text.rstrip(INCOMPLETE)
    if text == expected:
        return None
    matched_chars = 0
    index = 0
    for count in range(1, len(run.token_ids) + 1):
        prefix = reference.decode(run.token_ids[:count])
        if text.startswith(prefix):
            matched_chars = len(prefix)
            index = count
    if index == len(run.token_ids):
        # every reference token matched: the server wrote more than the reference
        return Divergence(index, -1, "", text[matched_chars:], float("inf"))
    return Divergence(
        index=index,
        reference_token=run.token_ids[index],
        reference_text=expected[matched_chars:],
        server_text=text[matched_chars:],
        margin=run.margins[index],
    )
