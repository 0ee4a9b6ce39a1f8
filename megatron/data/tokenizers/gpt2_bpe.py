"""GPT-2's byte-level BPE from vocab.json + merges.txt, written here (Megatron's GPT2BPETokenizer).

Text is cut into pieces by GPT-2's pre-tokenisation pattern (contractions, letter runs,
digit runs, other-symbol runs, each optionally led by one space; whitespace runs), each
piece's UTF-8 bytes are mapped to printable characters (the byte-to-unicode table), and
merges are applied lowest rank first. As in Megatron, `<|endoftext|>` is the EOD id and
is not special inside text. Pieces repeat a lot in prose, so their BPE result is cached.
"""

from __future__ import annotations

import json

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOD_TOKEN = "<|endoftext|>"
CACHE_LIMIT = 1 << 16


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table: printable Latin-1 bytes map to themselves,
    the other 68 bytes to characters from U+0100 on, so no piece holds whitespace or controls."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def read_merges(merge_file: str) -> list[tuple[str, str]]:
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (number == 1 and line.startswith("#version")):
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise ValueError(f"--merge-file {merge_file}:{number}: expected two symbols, got {line[:40]!r}")
            merges.append((pair[0], pair[1]))
    return merges


class GPT2BPETokenizer:
    bos = None
    eos = None

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: dict[str, int] = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({error.msg})") from None
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"--vocab-file {vocab_file}: no {EOD_TOKEN} token (the EOD)")
        self.decoder = {i: t for t, i in self.encoder.items()}
        merges = read_merges(merge_file)
        for a, b in merges:
            if a + b not in self.encoder:
                raise ValueError(f"--merge-file {merge_file}: merge {a!r} + {b!r} makes a token not in {vocab_file}")
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder[EOD_TOKEN]
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[str]:
        symbols = list(piece)
        while len(symbols) > 1:
            best, best_rank = None, None
            for pair in zip(symbols, symbols[1:]):
                rank = self.ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = pair, rank
            if best is None:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids = [self.encoder[s] for s in self._bpe(mapped)]
            if len(self._cache) >= CACHE_LIMIT:
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in PATTERN.findall(text):
            ids.extend(self._encode_piece(piece))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
