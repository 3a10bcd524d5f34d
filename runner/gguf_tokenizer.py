"""SentencePiece BPE vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``) as a
``tokenizers.Tokenizer``.

A GGUF file holds such a vocabulary as pieces, scores and token types, with no merges. A
SentencePiece BPE model encodes by starting from single characters and repeatedly joining the
adjacent pair whose joined piece is in the vocabulary with the highest score. That is a BPE
whose merges are every split ``(a, b)`` of a vocabulary piece ``a + b`` with both halves in the
vocabulary, ranked by the joined piece's score (best first): :func:`spm_merges` builds exactly
that list, so ``tokenizers``' BPE (with byte fallback for characters the vocabulary lacks, as
``<0xNN>`` tokens) reproduces the SentencePiece segmentation.

Spaces are ``▁`` (U+2581) in the pieces; with ``tokenizer.ggml.add_space_prefix`` (the default
for this model) a ``▁`` is put before every stretch of text, at the start and after each
special token, as llama.cpp does (``tokenizers`` normalizes each stretch between added tokens
on its own). Control (3) and user-defined (4) tokens are matched whole, before BPE.
"""

from __future__ import annotations

from protocol.errors import CorruptModelFile

# GGUF token types (SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def spm_merges(
    tokens: list[str], scores: list[float], types: list[int] | None
) -> list[tuple[str, str]]:
    """The BPE merges of a SentencePiece BPE vocabulary, best first: ``(a, b)`` for every
    normal piece ``a + b`` whose halves are normal pieces, ranked by the joined piece's score
    (higher first; ties keep vocabulary order, then the halves' ids, for a stable rank)."""
    normal = [types is None or types[i] == NORMAL for i in range(len(tokens))]
    ids: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if normal[i]:
            ids.setdefault(tok, i)  # a duplicate piece keeps its first id, as lookups do
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            a, b = ids.get(left), ids.get(right)
            if a is not None and b is not None:
                found.append((-float(scores[i]), i, a, b, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def spm_hf_tokenizer(meta: dict, path: str):
    """A ``tokenizers.Tokenizer`` for a ``llama`` (SentencePiece BPE) GGUF vocabulary."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta.get("tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    if not tokens or scores is None or len(scores) != len(tokens):
        raise CorruptModelFile("GGUF SentencePiece vocabulary lacks tokens or scores", path=path)
    if types is not None and len(types) != len(tokens):
        raise CorruptModelFile("GGUF token types do not match the tokens", path=path)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and types is not None:
        unk_id = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    hf = HFTokenizer(model)
    prefix = meta.get("tokenizer.ggml.add_space_prefix")
    prefix = True if prefix is None else bool(prefix)
    steps = [normalizers.Replace(" ", SPACE)]
    if prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(decode)
    if types is not None:
        special = [tokens[i] for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    return hf
