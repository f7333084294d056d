"""The BPE model of tokenizer.json (``"model": {"type": "BPE", ...}``), as Hugging Face's tokenizers runs it.

A word (one pre-tokenized piece) becomes symbols, one per character (``merge_word``): the character's
vocabulary id; else, with ``byte_fallback``, its UTF-8 bytes as ``<0xNN>`` tokens; else ``unk_token``
(consecutive unknown characters fused into one with ``fuse_unk``; with no ``unk_token`` the character
is dropped). Then merges apply lowest rank first, leftmost first among equal ranks (tokenizers'
word.rs ``merge_all``: a heap of (rank, position) with stale entries skipped). With ``ignore_merges`` a
word that is itself in the vocabulary is that one token (Llama 3).

Merges come as ``"a b"`` strings or ``["a", "b"]`` pairs; the merged token is ``a + b`` without
``continuing_subword_prefix``, and every part must be in the vocabulary.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from runtime.tokenizer.json_fields import Node, TokenizerError

SHORT_WORD = 48  # symbols; longer words merge with the heap (the scan is quadratic)


@dataclass
class BPE:
    vocab: dict[str, int]
    id_to_token: dict[int, str]
    merges: dict[tuple[int, int], tuple[int, int]]  # (left id, right id) -> (rank, merged id)
    unk_token: str | None = None
    fuse_unk: bool = False
    byte_fallback: bool = False
    ignore_merges: bool = False
    continuing_subword_prefix: str | None = None
    end_of_word_suffix: str | None = None
    unique_merges: bool = True  # no two merges make the same token: the scan and the heap agree

    @classmethod
    def from_json(cls, node: Node) -> BPE:
        if node.get("dropout", (int, float), 0) not in (0, 0.0):
            raise node.error("must be null or 0: BPE dropout samples merges at random, not reproducible ids", "dropout")
        vocab_node = node.child("vocab")
        vocab = node.get("vocab", dict)
        for token, i in vocab.items():
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise vocab_node.error(f"maps {token!r} to {i!r}; ids are non-negative integers")
        prefix = node.get("continuing_subword_prefix", str, None)
        merges: dict[tuple[int, int], tuple[int, int]] = {}
        results = set()
        merge_nodes = node.get("merges", list, [])
        for rank, merge in enumerate(merge_nodes):
            left, right = _merge_parts(merge, node, rank)
            merged = left + right[len(prefix or ""):]
            for part in (left, right, merged):
                if part not in vocab:
                    raise node.error(f"merge {merge!r} needs {part!r}, which is not in model.vocab", f"merges[{rank}]")
            merges[(vocab[left], vocab[right])] = (rank, vocab[merged])  # a repeated pair: the later rank wins
            results.add(vocab[merged])
        unk = node.get("unk_token", str, None)
        if unk is not None and unk not in vocab:
            raise node.error(f"{unk!r} is not in model.vocab", "unk_token")
        return cls(vocab=vocab, id_to_token={i: t for t, i in vocab.items()}, merges=merges, unk_token=unk,
                   fuse_unk=node.get("fuse_unk", bool, False), byte_fallback=node.get("byte_fallback", bool, False),
                   ignore_merges=node.get("ignore_merges", bool, False), continuing_subword_prefix=prefix,
                   end_of_word_suffix=node.get("end_of_word_suffix", str, None),
                   unique_merges=len(results) == len(merges))

    def tokenize(self, word: str) -> list[int]:
        """Ids of one pre-tokenized word."""
        if not word:
            return []
        if self.ignore_merges:
            whole = self.vocab.get(word)
            if whole is not None:
                return [whole]
        symbols = self.symbols(word)
        if len(symbols) < 2 or not self.merges:
            return symbols
        if self.unique_merges and len(symbols) <= SHORT_WORD:
            return self._merge_by_scan(symbols)
        return self.merge_by_heap(symbols)

    def symbols(self, word: str) -> list[int]:
        """tokenizers' ``merge_word`` up to the merges: one id per character (or per byte, or a fused unk)."""
        vocab, out = self.vocab, []
        unk: list[int] | None = None  # [id] of a pending unknown token (fused over consecutive characters)
        last = len(word) - 1
        for i, ch in enumerate(word):
            s = ch
            if i and self.continuing_subword_prefix:
                s = self.continuing_subword_prefix + s
            if i == last and self.end_of_word_suffix:
                s = s + self.end_of_word_suffix
            token = vocab.get(s)
            if token is not None:
                if unk is not None:
                    out.append(unk[0])
                    unk = None
                out.append(token)
                continue
            if self.byte_fallback:
                codes = [vocab.get(f"<0x{b:02X}>") for b in s.encode("utf-8")]
                if None not in codes:
                    out.extend(codes)  # a pending unk is not flushed first: tokenizers' order
                    continue
            if self.unk_token is not None:
                if unk is not None and not self.fuse_unk:
                    out.append(unk[0])
                    unk = None
                if unk is None:
                    unk = [vocab[self.unk_token]]
        if unk is not None:
            out.append(unk[0])
        return out

    def _merge_by_scan(self, symbols: list[int]) -> list[int]:
        """Repeatedly merge the lowest-rank adjacent pair, leftmost first. With unique merge results this is
        exactly the heap order (a stale heap entry can then never pass tokenizers' new-id check)."""
        merges = self.merges
        while len(symbols) > 1:
            best, best_at = None, -1
            for at in range(len(symbols) - 1):
                found = merges.get((symbols[at], symbols[at + 1]))
                if found is not None and (best is None or found[0] < best[0]):
                    best, best_at = found, at
            if best is None:
                break
            symbols[best_at: best_at + 2] = [best[1]]
        return symbols

    def merge_by_heap(self, symbols: list[int]) -> list[int]:
        """tokenizers' word.rs ``merge_all`` (no dropout), step for step: a min-heap of (rank, position,
        new id); an entry whose pair no longer makes that new id is skipped."""
        merges, n = self.merges, len(symbols)
        ids, nxt, prev, alive = list(symbols), list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        nxt[-1] = -1
        heap = [(found[0], at, found[1]) for at in range(n - 1)
                if (found := merges.get((ids[at], ids[at + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            rank, at, new_id = heapq.heappop(heap)
            right = nxt[at]
            if not alive[at] or right == -1:
                continue
            found = merges.get((ids[at], ids[right]))
            if found is None or found[1] != new_id:
                continue
            ids[at], alive[right] = new_id, False
            nxt[at] = nxt[right]
            if nxt[at] != -1:
                prev[nxt[at]] = at
            if prev[at] >= 0 and (found := merges.get((ids[prev[at]], new_id))) is not None:
                heapq.heappush(heap, (found[0], prev[at], found[1]))
            if nxt[at] != -1 and (found := merges.get((new_id, ids[nxt[at]]))) is not None:
                heapq.heappush(heap, (found[0], at, found[1]))
        return [ids[i] for i in range(n) if alive[i]]


def _merge_parts(merge, node: Node, rank: int) -> tuple[str, str]:
    if isinstance(merge, str):
        parts = merge.split(" ")
    elif isinstance(merge, list) and all(isinstance(p, str) for p in merge):
        parts = merge
    else:
        parts = []
    if len(parts) != 2:
        raise TokenizerError(f"{node.where(f'merges[{rank}]')} must be \"a b\" or [\"a\", \"b\"], got {merge!r}"[:300])
    return parts[0], parts[1]
