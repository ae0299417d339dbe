"""A radix tree of full pages: the second prefix-index backend.

Each node is one published page; its children are keyed by the next page's token ids, and each
salt has its own root. A lookup walks the tree page by page, so a hit is an exact token match by
construction and no hash is involved. Removing a page detaches its node from its parent; the
node's own children stay published but unreachable until they are evicted in turn, exactly as an
orphaned entry of the chained-hash index does.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kv.prefix_index import PrefixEntry

#: A node's key in the children map: a published entry, or the root of one salt.
_NodeKey = PrefixEntry | tuple[str, str | None]


def _root(salt: str | None) -> tuple[str, str | None]:
    return ("root", salt)


class RadixPrefixIndex:
    """Satisfies :class:`~pagedkv.kv.prefix_index.PrefixLookup`."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._children: dict[_NodeKey, dict[tuple[int, ...], PrefixEntry]] = {}
        self._by_page: list[PrefixEntry | None] = [None] * num_pages
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def entry_of(self, page: int) -> PrefixEntry | None:
        return self._by_page[page]

    def entries(self) -> list[PrefixEntry]:
        return [e for e in self._by_page if e is not None]

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_pages: int
    ) -> list[PrefixEntry]:
        size = self.page_size
        chain: list[PrefixEntry] = []
        node: _NodeKey = _root(salt)
        for i in range(min(max_pages, len(token_ids) // size)):
            child = self._children.get(node, {}).get(tuple(token_ids[i * size : (i + 1) * size]))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain

    def publish(
        self, page: int, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: str | None
    ) -> PrefixEntry | None:
        node: _NodeKey = _root(salt) if parent is None else parent
        children = self._children.setdefault(node, {})
        existing = children.get(token_ids)
        if existing is not None:
            return existing
        entry = PrefixEntry(key=0, page=page, token_ids=token_ids, cache_salt=salt, parent=parent)
        children[token_ids] = entry
        self._by_page[page] = entry
        self._count += 1
        return entry

    def remove_page(self, page: int) -> None:
        entry = self._by_page[page]
        if entry is None:
            return
        self._by_page[page] = None
        self._count -= 1
        node: _NodeKey = _root(entry.cache_salt) if entry.parent is None else entry.parent
        siblings = self._children.get(node)
        if siblings is not None and siblings.get(entry.token_ids) is entry:
            del siblings[entry.token_ids]
            if not siblings:
                del self._children[node]

    def clear(self) -> None:
        self._children.clear()
        self._by_page = [None] * len(self._by_page)
        self._count = 0
