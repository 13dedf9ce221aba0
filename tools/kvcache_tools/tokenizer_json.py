"""Builders of Hugging Face `tokenizer.json` documents (no `tokenizers` package needed)."""
import json
from typing import Dict, List, Optional, Sequence, Tuple

from .errors import ToolError

SPIECE_UNDERLINE = "\u2581"  # ▁

# Qwen2 pre-tokenizer split regex (digits one by one: \p{N} without {1,3})
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2/2.5 added tokens, ids 151643..151664; <tool_call> .. <|file_sep|> are not "special"
# (they are still matched before BPE, but not skipped when decoding with skip_special_tokens).
QWEN2_ADDED_TOKENS: List[Tuple[int, str, bool]] = [
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True), (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True), (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False), (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
]
QWEN2_DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def added_token(tid: int, content: str, special: bool, normalized: bool) -> Dict:
    return {"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": normalized, "special": special}


def sentencepiece_bpe(pieces: Sequence[str], scores: Sequence[float], specials: Dict[int, str],
                      bos: Optional[str] = None, where: str = "tokenizer") -> Dict:
    """SentencePiece-style BPE as HF's Llama tokenizer.json: BPE with byte_fallback, normalizer
    Prepend("▁") + Replace(" " -> "▁"), no pre-tokenizer, decoder Replace("▁" -> " ") + ByteFallback
    + Fuse + Strip(one leading space); post-processor prepends `bos` when given.

    pieces[i] is the text of id i with U+2581 for a space (byte pieces are "<0xNN>"); specials maps
    the ids of control tokens to their text. Merges are derived from the scores as HF's
    SentencePieceExtractor does: every split (left, right) of a piece into two vocab pieces is a
    merge; merges are ordered by the merged piece's score, descending (ties: by left id, right id)."""
    vocab: Dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p in vocab:
            raise ToolError(f"{where}: duplicate tokenizer piece {p!r} at ids {vocab[p]} and {i}")
        vocab[p] = i
    normal = [i for i, p in enumerate(pieces) if i not in specials and not _is_byte_piece(p)]
    normal_set = {pieces[i] for i in normal}
    merges = []
    for i in normal:
        piece = pieces[i]
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal_set and right in normal_set:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend((scores[i], l, r) for _, _, l, r in local)
    merges.sort(key=lambda m: -m[0])  # stable: keeps the (left id, right id) order within a score
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(i, t, True, True) for i, t in sorted(specials.items())],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPIECE_UNDERLINE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPIECE_UNDERLINE},
        ]},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPIECE_UNDERLINE}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": specials.get(0, None),
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{l} {r}" for _, l, r in merges]},
    }
    if bos is not None:
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}},
        }
    return tok


def _is_byte_piece(p: str) -> bool:
    return len(p) == 6 and p.startswith("<0x") and p.endswith(">")


def merge_lines(text: str, where: str) -> List[Tuple[int, str]]:
    """(line number, 'left right') of each merge of a merges.txt, read as the C++ loader reads it:
    a trailing '\r' dropped, empty lines and a first line '#version...' skipped, every other line
    exactly two non-empty parts separated by one space."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line[:-1] if line.endswith("\r") else line
        if not line or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ToolError(f"{where}: line {n} is not a merge 'left right': {line[:60]!r}")
        out.append((n, line))
    return out


def read_merges(text: str, where: str) -> List[str]:
    """merges.txt lines 'a b' (see merge_lines)."""
    return [m for _, m in merge_lines(text, where)]


def qwen2_byte_level(vocab: Dict[str, int], merges: List[str], added=None) -> Dict:
    """Qwen2/2.5 tokenizer.json: NFC normalizer; pre-tokenizer Split(QWEN2_SPLIT_REGEX, Isolated) +
    ByteLevel(no prefix space, no regex); ByteLevel BPE without unk / byte fallback; ByteLevel decoder;
    `added` as (id, content, special) triples, default Qwen2's 22 added tokens (ids 151643..151664)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(i, t, s, False) for i, t, s in (QWEN2_ADDED_TOKENS if added is None else added)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def qwen2_tokenizer_config(chat_template: str) -> Dict:
    """tokenizer_config.json of Qwen2.5-Instruct (ChatML template; its default system prompt is
    QWEN2_DEFAULT_SYSTEM_PROMPT, inside the template)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": s} for i, t, s in QWEN2_ADDED_TOKENS},
        "additional_special_tokens": [t for i, t, s in QWEN2_ADDED_TOKENS if s and i != 151643],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def dumps(doc: Dict) -> str:
    return json.dumps(doc, ensure_ascii=False, indent=1)
