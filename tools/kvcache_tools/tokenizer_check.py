"""Checks tokenizer files as the C++ tokenizer loader reads them, so an export never embeds a
tokenizer it rejects (libkvcache/src/model/tokenizer_load.cpp, bpe.cpp, tokenizer.cpp).

Mirrored: tokenizer.json's model (BPE only; vocab of ids in [0, 2^26); merges "a b" / [a, b] whose
parts and result are in the vocab; unk_token in the vocab; no continuing_subword_prefix /
end_of_word_suffix), added_tokens (ids, non-empty content, no id twice), the normalizer /
pre_tokenizer / decoder / post_processor steps the loader implements with their fields;
vocab.json + merges.txt; tokenizer_config.json (added_tokens_decoder, bos_token / eos_token that
resolve to a token, add_bos_token / add_eos_token only with that token defined).
Not mirrored: compiling Split / Replace regexes with the loader's own regex engine.
Added here: every id the tokenizer can produce must lie inside the model's vocabulary.
Each failure is one ToolError "FILE: field 'json.path' ...".
"""
from typing import Any, Dict, List, Optional, Tuple

from .errors import ToolError
from .fileio import json_path, parse_json, shown
from .tokenizer_json import merge_lines

MAX_TOKEN_ID = 1 << 26  # tokenizer_load.cpp kMaxTokenId


class _Reader:
    """Typed field access; `path` arguments are JSON path lists, messages name file and field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: List, what: str):
        raise ToolError(f"{self.where}: field '{json_path(path)}' {what}")

    @staticmethod
    def find(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, dict) else None

    def require(self, obj: Any, key: str, path: List) -> Any:
        v = self.find(obj, key)
        if v is None:
            self.fail(path + [key], "is missing")
        return v

    def object(self, obj: Any, key: str, path: List) -> Dict:
        v = self.require(obj, key, path)
        if not isinstance(v, dict):
            self.fail(path + [key], f"= {shown(v)} is not an object")
        return v

    def array(self, obj: Any, key: str, path: List, required: bool = True) -> List:
        v = self.require(obj, key, path) if required else self.find(obj, key)
        if v is None:
            return []
        if not isinstance(v, list):
            self.fail(path + [key], f"= {shown(v)} is not an array")
        return v

    def string(self, obj: Any, key: str, path: List, default: Optional[str] = None,
               required: bool = False) -> Optional[str]:
        v = self.require(obj, key, path) if required else self.find(obj, key)
        if v is None:
            return default
        if not isinstance(v, str):
            self.fail(path + [key], f"= {shown(v)} is not a string")
        return v

    def boolean(self, obj: Any, key: str, path: List) -> Optional[bool]:
        v = self.find(obj, key)
        if v is not None and not isinstance(v, bool):
            self.fail(path + [key], f"= {shown(v)} is not true or false")
        return v

    def integer(self, obj: Any, key: str, path: List) -> Optional[int]:
        v = self.find(obj, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            self.fail(path + [key], f"= {shown(v)} is not an integer")
        return v

    def token_id(self, v: Any, path: List) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, f"= {shown(v)} is not an integer token id")
        if not 0 <= v < MAX_TOKEN_ID:
            self.fail(path, f"= {v} is out of range [0, 2^26) (the C++ tokenizer loader's limit)")
        return v

    def one_char(self, obj: Any, key: str, path: List, default: str) -> None:
        s = self.string(obj, key, path, default)
        if len(s) != 1:
            self.fail(path + [key], f"= {shown(s)} is not a single character")

    def pattern(self, obj: Any, key: str, path: List, string_only: bool = False,
                nonempty: bool = True) -> Optional[str]:
        """{"String": s} or {"Regex": r}; returns the String literal (None for a regex)."""
        p = self.require(obj, key, path)
        if self.find(p, "String") is not None:
            s = self.string(p, "String", path + [key])
            if s == "" and nonempty:
                self.fail(path + [key, "String"], "is an empty pattern")
            return s
        if string_only:
            self.fail(path + [key], f"= {shown(p)}: only {{\"String\": ...}} patterns are supported in decoders")
        if self.find(p, "Regex") is None:
            self.fail(path + [key], f"= {shown(p)} is not {{\"String\": ...}} or {{\"Regex\": ...}}")
        self.string(p, "Regex", path + [key])
        return None


def _step_type(r: _Reader, step: Any, path: List, supported: str) -> str:
    if not isinstance(step, dict):
        r.fail(path, f"= {shown(step)} is not an object")
    t = r.string(step, "type", path, required=True)
    if t not in supported.split(", "):
        r.fail(path + ["type"], f"= {shown(t)} is not supported (supported: {supported})")
    return t


def _normalizer(r: _Reader, n: Any, path: List) -> None:
    t = _step_type(r, n, path, "NFC, NFD, Prepend, Replace, Strip, Sequence")
    if t == "Sequence":
        for i, x in enumerate(r.array(n, "normalizers", path)):
            _normalizer(r, x, path + ["normalizers", i])
    elif t == "Prepend":
        r.string(n, "prepend", path, required=True)
    elif t == "Replace":
        r.pattern(n, "pattern", path)
        r.string(n, "content", path, required=True)
    elif t == "Strip":
        r.boolean(n, "strip_left", path)
        r.boolean(n, "strip_right", path)


def _prepend_scheme(r: _Reader, obj: Dict, path: List) -> None:
    v = r.find(obj, "prepend_scheme")
    if v is not None:
        if v not in ("always", "first", "never"):
            r.fail(path + ["prepend_scheme"], f"= {shown(v)} is not one of always, first, never")
    else:
        r.boolean(obj, "add_prefix_space", path)


def _pretokenizer(r: _Reader, p: Any, path: List) -> None:
    t = _step_type(r, p, path, "Split, ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit, Sequence")
    if t == "Sequence":
        for i, x in enumerate(r.array(p, "pretokenizers", path)):
            _pretokenizer(r, x, path + ["pretokenizers", i])
    elif t == "Split":
        r.pattern(p, "pattern", path, nonempty=False)
        behaviors = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")
        b = r.string(p, "behavior", path, required=True)
        if b not in behaviors:
            r.fail(path + ["behavior"], f"= {shown(b)} is not one of {', '.join(behaviors)}")
        r.boolean(p, "invert", path)
    elif t == "ByteLevel":
        r.boolean(p, "add_prefix_space", path)
        r.boolean(p, "use_regex", path)
    elif t == "Metaspace":
        r.one_char(p, "replacement", path, "\u2581")
        _prepend_scheme(r, p, path)
        r.boolean(p, "split", path)
    elif t == "Digits":
        r.boolean(p, "individual_digits", path)


def _decoder(r: _Reader, d: Any, path: List) -> None:
    t = _step_type(r, d, path, "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence")
    if t == "Sequence":
        for i, x in enumerate(r.array(d, "decoders", path)):
            _decoder(r, x, path + ["decoders", i])
    elif t == "Replace":
        r.pattern(d, "pattern", path, string_only=True)
        r.string(d, "content", path, required=True)
    elif t == "Strip":
        r.one_char(d, "content", path, " ")
        for k in ("start", "stop"):
            v = r.integer(d, k, path)
            if v is not None and v < 0:
                r.fail(path + [k], f"= {v} must be >= 0")
    elif t == "Metaspace":
        r.one_char(d, "replacement", path, "\u2581")
        _prepend_scheme(r, d, path)


def _post_processor(r: _Reader, p: Any, path: List, prefix: List[int], ids: Dict[int, List]) -> None:
    """Collects the ids a post-processor adds (prefix: those before the sequence)."""
    t = _step_type(r, p, path, "TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence")
    if t == "Sequence":
        for i, x in enumerate(r.array(p, "processors", path)):
            _post_processor(r, x, path + ["processors", i], prefix, ids)
    elif t == "TemplateProcessing":
        specials = r.find(p, "special_tokens")
        seen_sequence = False
        for i, item in enumerate(r.array(p, "single", path)):
            if r.find(item, "Sequence") is not None:
                seen_sequence = True
                continue
            sp = r.find(item, "SpecialToken")
            if sp is None:
                r.fail(path + ["single", i], f"= {shown(item)} is not a SpecialToken or a Sequence")
            name = r.string(sp, "id", path + ["single", i, "SpecialToken"], required=True)
            entry = r.find(specials, name)
            if entry is None:
                r.fail(path + ["special_tokens"], f"has no entry for {shown(name)}")
            epath = path + ["special_tokens", name, "ids"]
            for j, v in enumerate(r.array(entry, "ids", path + ["special_tokens", name])):
                tid = r.token_id(v, epath + [j])
                ids.setdefault(tid, epath + [j])
                if not seen_sequence:
                    prefix.append(tid)
    elif t in ("RobertaProcessing", "BertProcessing"):
        cls, sep = r.require(p, "cls", path), r.require(p, "sep", path)
        if not (isinstance(cls, list) and len(cls) == 2 and isinstance(sep, list) and len(sep) == 2):
            r.fail(path, "cls/sep must be [token, id]")
        prefix.append(r.token_id(cls[1], path + ["cls", 1]))
        ids.setdefault(prefix[-1], path + ["cls", 1])
        ids.setdefault(r.token_id(sep[1], path + ["sep", 1]), path + ["sep", 1])


def _vocab(r: _Reader, v: Any, path: List) -> Dict[str, int]:
    if not isinstance(v, dict):
        r.fail(path, f"= {shown(v)} is not an object {{token: id}}")
    if not v:
        r.fail(path, "is an empty vocabulary")
    for tok, tid in v.items():
        r.token_id(tid, path + [tok])
    return v


def _merge_problem(a: str, b: str, vocab: Dict[str, int]) -> Optional[str]:
    """Why the loader's BPE model rejects merge (a, b): a part or the result is not in the vocab."""
    for piece in (a, b, a + b):
        if piece not in vocab:
            return f"uses {shown(piece)}, which is not in the vocab"
    return None


class _Tokenizer:
    """What tokenizer_config.json is checked against."""

    def __init__(self):
        self.vocab: Dict[str, int] = {}
        self.added: Dict[int, str] = {}  # id -> content
        self.ids: Dict[int, Tuple[str, List]] = {}  # every producible id -> (file, JSON path) first seen
        self.bos: Optional[int] = None
        self.eos: Optional[int] = None

    def note(self, tid: int, where: str, path: List) -> None:
        self.ids.setdefault(tid, (where, path))


def _added_token(r: _Reader, t: Any, path: List) -> str:
    if not isinstance(t, dict):
        r.fail(path, f"= {shown(t)} is not an object")
    content = r.string(t, "content", path, required=True)
    if content == "":
        r.fail(path + ["content"], "is an empty added token")
    for k in ("special", "lstrip", "rstrip", "single_word"):
        r.boolean(t, k, path)
    return content


def _tokenizer_json(text: str, where: str) -> _Tokenizer:
    r = _Reader(where)
    root = parse_json(text, where)
    if not isinstance(root, dict):
        r.fail([], f"= {shown(root)} is not a JSON object")
    tk = _Tokenizer()
    model = r.object(root, "model", [])
    mt = r.string(model, "type", ["model"], "BPE")
    if mt != "BPE":
        r.fail(["model", "type"], f"= {shown(mt)} is not supported (supported: BPE)")
    for k in ("continuing_subword_prefix", "end_of_word_suffix"):
        if r.string(model, k, ["model"], ""):
            r.fail(["model", k], f"= {shown(model[k])}: non-empty values are not supported")
    tk.vocab = _vocab(r, r.require(model, "vocab", ["model"]), ["model", "vocab"])
    for tok, tid in tk.vocab.items():
        tk.note(tid, where, ["model", "vocab", tok])
    for i, e in enumerate(r.array(model, "merges", ["model"], required=False)):
        if isinstance(e, str):
            parts = e.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                r.fail(["model", "merges", i], f"= {shown(e)} is not a merge \"left right\"")
        elif isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e):
            parts = e
        else:
            r.fail(["model", "merges", i], f"= {shown(e)} is not \"left right\" or [left, right]")
        why = _merge_problem(parts[0], parts[1], tk.vocab)
        if why:
            r.fail(["model", "merges", i], f"= {shown(e)} {why}")
    unk = r.string(model, "unk_token", ["model"], "")
    if unk and unk not in tk.vocab:
        r.fail(["model", "unk_token"], f"= {shown(unk)} is not in the vocab")
    for k in ("byte_fallback", "fuse_unk", "ignore_merges"):
        r.boolean(model, k, ["model"])
    for i, t in enumerate(r.array(root, "added_tokens", [], required=False)):
        path = ["added_tokens", i]
        tid = r.token_id(r.require(t, "id", path), path + ["id"])
        content = _added_token(r, t, path)
        if tid in tk.added:
            r.fail(path + ["id"], f"= {tid}: two added tokens have this id ({shown(tk.added[tid])}, {shown(content)})")
        tk.added[tid] = content
        tk.note(tid, where, path + ["id"])
    for key, check in (("normalizer", _normalizer), ("pre_tokenizer", _pretokenizer), ("decoder", _decoder)):
        if r.find(root, key) is not None:
            check(r, root[key], [key])
    if r.find(root, "post_processor") is not None:
        prefix: List[int] = []
        ids: Dict[int, List] = {}
        _post_processor(r, root["post_processor"], ["post_processor"], prefix, ids)
        for tid, path in ids.items():
            tk.note(tid, where, path)
        tk.bos = prefix[0] if prefix else None
    return tk


def _vocab_merges(vocab_text: str, vocab_where: str, merges_text: str, merges_where: str) -> _Tokenizer:
    tk = _Tokenizer()
    r = _Reader(vocab_where)
    tk.vocab = _vocab(r, parse_json(vocab_text, vocab_where), [])
    for tok, tid in tk.vocab.items():
        tk.note(tid, vocab_where, [tok])
    for n, line in merge_lines(merges_text, merges_where):
        why = _merge_problem(*line.split(" "), tk.vocab)
        if why:
            raise ToolError(f"{merges_where}: line {n} {shown(line)} {why}")
    return tk


def _tokenizer_config(text: str, where: str, tk: _Tokenizer) -> None:
    r = _Reader(where)
    cfg = parse_json(text, where)
    if not isinstance(cfg, dict):
        r.fail([], f"= {shown(cfg)} is not a JSON object")
    dec = r.find(cfg, "added_tokens_decoder")
    if dec is not None:
        if not isinstance(dec, dict):
            r.fail(["added_tokens_decoder"], f"= {shown(dec)} is not an object")
        for key, t in dec.items():
            path = ["added_tokens_decoder", key]
            if not (key.isascii() and key.isdigit() and int(key) < MAX_TOKEN_ID):
                r.fail(path, "has a key that is not a token id in [0, 2^26)")
            if int(key) not in tk.added:
                tk.added[int(key)] = _added_token(r, t, path)
                tk.note(int(key), where, path)
    by_content: Dict[str, int] = {}
    for i in sorted(tk.added):  # the lowest id wins, as in the loader
        by_content.setdefault(tk.added[i], i)
    for key in ("bos_token", "eos_token"):
        v = r.find(cfg, key)
        if v is None:
            continue
        if isinstance(v, dict):
            name = r.string(v, "content", [key], required=True)
        elif isinstance(v, str):
            name = v
        else:
            r.fail([key], f"= {shown(v)} is not a string, an object with \"content\" or null")
        tid = by_content.get(name, tk.vocab.get(name))
        if tid is None:
            r.fail([key], f"= {shown(name)}: the token is not in the vocabulary")
        setattr(tk, key[:3], tid)
    for key, have in (("add_bos_token", tk.bos), ("add_eos_token", tk.eos)):
        if r.boolean(cfg, key, []) and have is None:
            r.fail([key], f"is true but no {key[4:]} is defined")


def check_tokenizer_files(files: Dict[str, str], paths: Dict[str, str], vocab_size: int) -> None:
    """files: name -> text of "tokenizer.json" or "vocab.json" + "merges.txt", optionally
    "tokenizer_config.json"; paths: name -> the path messages show. vocab_size: the model's.
    Raises ToolError naming the file and the field of the first problem."""
    if "tokenizer.json" in files:
        tk = _tokenizer_json(files["tokenizer.json"], paths["tokenizer.json"])
    else:
        tk = _vocab_merges(files["vocab.json"], paths["vocab.json"], files["merges.txt"], paths["merges.txt"])
    if "tokenizer_config.json" in files:
        _tokenizer_config(files["tokenizer_config.json"], paths["tokenizer_config.json"], tk)
    top = max(tk.ids)
    if top >= vocab_size:
        where, path = tk.ids[top]
        raise ToolError(f"{where}: field '{json_path(path)}' = {top} is outside the model's vocabulary [0, {vocab_size}) "
                        f"(config.json vocab_size)")
