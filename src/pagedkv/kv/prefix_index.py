"""The chained-hash prefix index of full pages.

Each published page gets an entry keyed by ``hash_fn(parent_key, token_ids, cache_salt)``, so a
page's key depends on every token before it (KVM-020). Lookups walk a prompt page by page from
the root and verify each entry's token ids, salt and parent entry, so a hash collision can never
hand one prompt another prompt's K/V (KVM-022): the hash only finds candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: ``hash_fn(parent_key, page_token_ids, cache_salt) -> key``; ``parent_key`` is ``None`` for
#: the first page of a prompt.
HashFn = Callable[[int | None, tuple[int, ...], str | None], int]


def builtin_page_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    """Python's own tuple hash: fast, stable within one process (which is all the index needs)."""
    return hash((parent, token_ids, salt))


@dataclass(eq=False, slots=True)
class PrefixEntry:
    """One published full page.

    Attributes:
        key: chained hash of this page.
        page: physical page holding the K/V.
        token_ids: the page's ``page_size`` token ids, kept to verify hits.
        cache_salt: the salt it was published under.
        parent: the entry of the previous page in the chain, ``None`` for a first page. Compared
            by identity: if the parent was evicted and republished, this child no longer matches.
    """

    key: int
    page: int
    token_ids: tuple[int, ...]
    cache_salt: str | None
    parent: PrefixEntry | None


class PrefixLookup(Protocol):
    """What the KVManager needs of a prefix index of full pages.

    Two implementations: :class:`PrefixIndex` (chained hash, verified) and
    :class:`~pagedkv.kv.radix_index.RadixPrefixIndex` (a tree of pages keyed by token ids).
    """

    def __len__(self) -> int:
        """Entries published."""
        ...

    def entry_of(self, page: int) -> PrefixEntry | None:
        """The entry published for ``page``, if any."""
        ...

    def entries(self) -> list[PrefixEntry]:
        """Every entry (for checks)."""
        ...

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        """The longest chain of entries for the leading full pages of ``token_ids``; pure."""
        ...

    def publish(
        self, page: int, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> PrefixEntry | None:
        """Publish ``page`` after ``parent``: its entry, an equal existing one, or ``None`` when
        the chain cannot go on."""
        ...

    def remove_page(self, page: int) -> None:
        """Drop the entry of ``page``."""
        ...

    def clear(self) -> None:
        """Forget every entry."""
        ...


class PrefixIndex:
    """Key → entry and page → entry maps; knows nothing of reference counts."""

    def __init__(self, num_pages: int, page_size: int, hash_fn: HashFn = builtin_page_hash) -> None:
        self.page_size = page_size
        self._hash_fn = hash_fn
        self._by_key: dict[int, PrefixEntry] = {}
        self._by_page: list[PrefixEntry | None] = [None] * num_pages

    def __len__(self) -> int:
        return len(self._by_key)

    def entry_of(self, page: int) -> PrefixEntry | None:
        """The entry published for ``page``, if any."""
        return self._by_page[page]

    def entries(self) -> list[PrefixEntry]:
        """Every entry (for checks)."""
        return list(self._by_key.values())

    def key_of(
        self, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> int:
        """The chained key of a page whose predecessor's entry is ``parent``."""
        return self._hash_fn(None if parent is None else parent.key, token_ids, salt)

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        """The longest verified chain of entries for the leading full pages of ``token_ids``.

        At most ``max_pages`` entries. Pure: nothing moves.
        """
        size = self.page_size
        chain: list[PrefixEntry] = []
        parent: PrefixEntry | None = None
        for i in range(min(max_pages, len(token_ids) // size)):
            page_tokens = tuple(token_ids[i * size : (i + 1) * size])
            entry = self._by_key.get(self.key_of(parent, page_tokens, salt))
            if (
                entry is None
                or entry.parent is not parent
                or entry.cache_salt != salt
                or entry.token_ids != page_tokens
            ):
                break
            chain.append(entry)
            parent = entry
        return chain

    def publish(
        self, page: int, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> PrefixEntry | None:
        """Publish ``page`` as the successor of ``parent``; returns the chain's entry for it.

        If the key is already taken by an equal page (another sequence computed the same
        prefix), that entry is returned and ``page`` stays unpublished. If it is taken by a
        different page (a hash collision), ``None`` is returned: the chain cannot go on.
        """
        key = self.key_of(parent, token_ids, salt)
        existing = self._by_key.get(key)
        if existing is not None:
            same = (
                existing.parent is parent
                and existing.cache_salt == salt
                and existing.token_ids == token_ids
            )
            return existing if same else None
        entry = PrefixEntry(key=key, page=page, token_ids=token_ids, cache_salt=salt, parent=parent)
        self._by_key[key] = entry
        self._by_page[page] = entry
        return entry

    def remove_page(self, page: int) -> None:
        """Drop the entry of ``page`` (it is being evicted or reset)."""
        entry = self._by_page[page]
        if entry is not None:
            self._by_page[page] = None
            del self._by_key[entry.key]

    def clear(self) -> None:
        """Forget every entry."""
        self._by_key.clear()
        self._by_page = [None] * len(self._by_page)
