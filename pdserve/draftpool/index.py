"""The fleet-wide suffix index: what followed a context's last tokens anywhere in a tenant's earlier requests.

Decode workers report every finished request's tokens (prompt + output); the index keeps them as
documents and maps each n-gram (``min_n``..``max_n`` tokens) to its most recent occurrence that has a
follower. A lookup takes a request's context tail and proposes what followed its longest recurring
suffix — prompt lookup over the whole fleet's history instead of one request's own text, which is
where agent workloads repeat themselves (tool-call shapes, system prompts, the code being edited).

Bounds: at most ``max_tokens`` tokens of documents in all (each document at most ``max_doc_tokens``,
its tail kept); the least recently used documents (added or drafted from) are evicted with their
n-grams. Tenants are separate indexes unless ``share_tenants``: one tenant's text never drafts for
another's requests. N-gram keys are Python hashes of token tuples; a hit is checked against the
document's tokens, so a collision proposes nothing rather than wrong text.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

SHARED_TENANT = "*"


class SuffixIndex:
    """Per-tenant n-gram index over reported token sequences, bounded by ``max_tokens`` (LRU by document)."""

    def __init__(self, min_n: int = 2, max_n: int = 8, max_tokens: int = 1 << 18, max_doc_tokens: int = 8192,
                 share_tenants: bool = False):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"SuffixIndex needs 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if max_tokens < 1 or max_doc_tokens < 1:
            raise ValueError(f"SuffixIndex needs positive bounds, got max_tokens={max_tokens} "
                             f"max_doc_tokens={max_doc_tokens}")
        self.min_n, self.max_n = min_n, max_n
        self.max_tokens, self.max_doc_tokens = max_tokens, max_doc_tokens
        self.share_tenants = share_tenants
        self._docs: OrderedDict[tuple[str, str], list[int]] = OrderedDict()  # (tenant, doc id) → tokens, LRU first
        self._grams: dict[str, dict[int, tuple[tuple[str, str], int]]] = {}  # tenant → gram hash → (doc, end)
        self.num_tokens = 0
        self.evicted_docs = 0

    def _tenant(self, tenant: str) -> str:
        return SHARED_TENANT if self.share_tenants else tenant

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tenant: str, doc_id: str, token_ids: Sequence[int]) -> None:
        """Index a document (a finished request's prompt + output); one of the same id is replaced.
        Evicts the least recently used documents while more than ``max_tokens`` are held."""
        tenant = self._tenant(tenant)
        key = (tenant, doc_id)
        if key in self._docs:
            self._remove(key)
        toks = [int(t) for t in token_ids[-self.max_doc_tokens:]]
        if len(toks) <= self.min_n:
            return
        self._docs[key] = toks
        self.num_tokens += len(toks)
        grams = self._grams.setdefault(tenant, {})
        for n in range(self.min_n, self.max_n + 1):
            for e in range(n, len(toks)):  # the gram toks[e-n:e] is followed by toks[e]
                grams[hash(tuple(toks[e - n:e]))] = (key, e)
        while self.num_tokens > self.max_tokens and self._docs:
            self._remove(next(iter(self._docs)))
            self.evicted_docs += 1

    def _remove(self, key: tuple[str, str]) -> None:
        toks = self._docs.pop(key)
        self.num_tokens -= len(toks)
        grams = self._grams.get(key[0], {})
        for n in range(self.min_n, self.max_n + 1):
            for e in range(n, len(toks)):
                h = hash(tuple(toks[e - n:e]))
                if grams.get(h, (None,))[0] == key:
                    del grams[h]
        if not grams:
            self._grams.pop(key[0], None)

    def lookup(self, tenant: str, tail: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest suffix of ``tail`` (``max_n`` down to ``min_n``
        tokens) in the tenant's documents, and that suffix's length; ``([], 0)`` when none recurs."""
        grams = self._grams.get(self._tenant(tenant))
        if not grams or k <= 0:
            return [], 0
        tail = [int(t) for t in tail[-self.max_n:]]
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            suffix = tail[len(tail) - n:]
            hit = grams.get(hash(tuple(suffix)))
            if hit is None:
                continue
            key, e = hit
            doc = self._docs[key]
            if doc[e - n:e] != suffix:  # a hash collision
                continue
            self._docs.move_to_end(key)  # drafting from a document keeps it
            return doc[e:e + k], n
        return [], 0
