"""Reading user files and writing outputs, shared by every tool.

Reading: UTF-8 text and *strict* JSON, i.e. JSON the C++ loader's reader (nlohmann::json) accepts
too: no NaN/Infinity literals, no number beyond a double's range, no unpaired UTF-16 surrogate
escape, and (a limit of ours) no nesting deeper than MAX_JSON_DEPTH. Every failure is a one-line
ToolError naming the file and, where there is one, the field.

Writing: atomic_output gives a temp path in the output's own directory; the finished file is
fsync'ed and renamed over the output, and on any failure (an exception, Ctrl-C, a full disk) the
temp file is deleted, so a run leaves either the complete new file or nothing.
"""
import json
import math
import os
import re
import stat
import sys
import tempfile
from typing import Any, List, Optional, Tuple

import numpy as np

from .errors import ToolError

# Deepest nesting accepted in a JSON file (real configs and tokenizer.json files nest < 10 deep);
# well under Python's recursion limit, so the parser cannot hit RecursionError.
MAX_JSON_DEPTH = 100
# Largest text file read (config.json, tokenizer.json, ...): real tokenizer.json files are < 20 MB.
# Checked before reading, so /dev/zero or a huge file ends in this error, not in a MemoryError.
MAX_TEXT_BYTES = 128 * 1024 * 1024
# Largest magnitude the C++ loader's JSON reader represents (a double); beyond it, it rejects the file.
MAX_JSON_NUMBER = sys.float_info.max
_MAX_INT_DIGITS = len(str(int(MAX_JSON_NUMBER)))  # 309

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string literal
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def shown(v: Any, limit: int = 60) -> str:
    """A value as a message shows it: JSON-like, on one line, cut to `limit` characters."""
    if isinstance(v, _Bad):
        s = v.text
    elif isinstance(v, StrictFloat):
        s = v.text
    else:
        try:
            s = json.dumps(v, ensure_ascii=False)
        except (TypeError, ValueError):
            s = repr(v)
    s = s.replace("\n", "\\n")
    if len(s) > limit:
        s = f"{s[:limit - 3]}... ({len(s)} characters)"
    return s


class StrictFloat(float):
    """A JSON float that remembers how the file spelled it (messages quote `1e9`, not 1000000000.0)."""

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        self.text = text
        return self


class _Bad:
    """Placeholder the parse hooks return for a number the loader would reject."""
    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def _parse_int(s: str):
    digits = len(s.lstrip("-"))
    if digits > _MAX_INT_DIGITS or (digits == _MAX_INT_DIGITS and abs(int(s)) > MAX_JSON_NUMBER):
        return _Bad(f"{s[:12]}...({digits} digits)" if digits > 20 else s,
                    f"is out of range (JSON numbers must be within +-{MAX_JSON_NUMBER:.4g}, a double)")
    return int(s)


def _parse_float(s: str):
    v = StrictFloat(s)
    if not math.isfinite(v):
        return _Bad(s, f"is out of range (JSON numbers must be within +-{MAX_JSON_NUMBER:.4g}, a double)")
    return v


def _parse_constant(s: str):
    return _Bad(s, "is not a JSON number (NaN and Infinity are not JSON; the C++ loader rejects them)")


def json_path(parts: List) -> str:
    """['a', 3, 'b'] -> "a[3].b" (the root alone is "(root)")."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def _find_bad(doc: Any) -> Optional[Tuple[str, str]]:
    """First (path, message) of a rejected number or a string with an unpaired surrogate, in
    document order; None when the document is clean."""
    stack: List[Tuple[Any, List]] = [(doc, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Bad):
            return json_path(path), f"= {v.text} {v.why}"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return json_path(path), "has an unpaired UTF-16 surrogate escape (not valid Unicode)"
        elif isinstance(v, dict):
            for k in v:
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return json_path(path), f"has a key with an unpaired UTF-16 surrogate escape ({shown(k)})"
            stack.extend((x, path + [k]) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((x, path + [i]) for i, x in reversed(list(enumerate(v))))
    return None


def json_depth(text: str) -> int:
    """Deepest [ / { nesting of a JSON text (string literals skipped); O(n) at C speed."""
    brackets = re.sub(r"[^\[\]{}]+", "", _STRING.sub("", text))
    if not brackets:
        return 0
    b = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json(text: str, where: str, what: str = "file") -> Any:
    """Parses `text` as strict JSON (see the module doc). `where` names the file in messages,
    `what` the kind of document ("model config")."""
    if not text.strip():
        raise ToolError(f"{where}: {what} is empty (expected JSON)")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ToolError(f"{where}: {what} is JSON nested {depth} levels deep, more than the limit of {MAX_JSON_DEPTH}")
    bad_numbers = []

    def on_bad(b: _Bad) -> _Bad:
        bad_numbers.append(b)
        return b

    def parse_int(s: str):
        v = _parse_int(s)
        return on_bad(v) if isinstance(v, _Bad) else v

    def parse_float(s: str):
        v = _parse_float(s)
        return on_bad(v) if isinstance(v, _Bad) else v

    try:
        doc = json.loads(text, parse_int=parse_int, parse_float=parse_float,
                         parse_constant=lambda s: on_bad(_parse_constant(s)))
    except json.JSONDecodeError as e:
        raise ToolError(f"{where}: {what} is not valid JSON: {e}") from None
    except RecursionError:  # not reachable below MAX_JSON_DEPTH; kept so it can never be a traceback
        raise ToolError(f"{where}: {what} is JSON nested too deeply for the parser") from None
    # the walk that locates the field runs only when there is something to find
    bad = _find_bad(doc) if bad_numbers or _SURROGATE_ESCAPE.search(text) else None
    if bad is not None:
        field, msg = bad
        raise ToolError(f"{where}: field '{field}' {msg}")
    return doc


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_text(path: str, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """Reads a UTF-8 text file of at most `max_bytes` bytes; ToolError naming the file when
    missing, not a regular file (a directory, a device such as /dev/zero, a FIFO: checked before
    anything is opened, so nothing blocks or reads without end), larger than the limit (named),
    unreadable or not UTF-8."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ToolError(f"{path}: {what} not found") from None
    except OSError as e:
        raise ToolError(f"{path}: cannot read {what}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{path}: {what} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path}: {what} is {_file_kind(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise ToolError(f"{path}: {what} is {st.st_size} bytes, more than the limit of {max_bytes} bytes "
                        f"({max_bytes // (1024 * 1024)} MiB) for a {what}")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ToolError(f"{path}: cannot read {what}: {e.strerror}") from None
    if len(raw) > max_bytes:  # it grew since the check
        raise ToolError(f"{path}: {what} holds more than the limit of {max_bytes} bytes for a {what}")
    try:
        # newline=None semantics of text mode: \r\n and \r become \n, as open(..., "r") read them
        return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise ToolError(f"{path}: {what} is not UTF-8 text: {e}") from None


def load_json(path: str, what: str) -> Any:
    """Reads a strict JSON file (parse_json); ToolError naming the file when missing or malformed."""
    return parse_json(read_text(path, what), path, what)


def check_output_path(path: str) -> str:
    """The directory `path` will be written into; ToolError when the path is a directory or its
    directory is missing. (Whether the directory is writable is found by creating the temp file.)"""
    if os.path.isdir(path):
        raise ToolError(f"{path}: output path is a directory (give a file name)")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ToolError(f"{path}: output directory {d} does not exist")
    return d


def prepare_output_dir(path: str) -> None:
    """Creates the output directory `path` (and its parents) if missing; ToolError when it is a
    file or cannot be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ToolError(f"{path}: output directory is an existing file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ToolError(f"{path}: cannot create the output directory: {e.strerror}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class atomic_output:
    """Context manager yielding a temp path next to `path`; on success the temp file is fsync'ed
    and renamed onto `path` (then the directory is fsync'ed); on any exception, KeyboardInterrupt
    included, it is deleted. The temp file is created on entry, so an unwritable directory fails
    before any work is done. OSErrors (a full disk, a permission) become one-line ToolErrors."""

    def __init__(self, path: str):
        self.path = path
        self.dir = check_output_path(path)
        self.tmp: Optional[str] = None

    def __enter__(self) -> str:
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.tmp-", dir=self.dir)
            try:
                os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the output normal permissions
            finally:
                os.close(fd)
        except OSError as e:
            self._remove()
            raise ToolError(f"{self.path}: cannot write to the output directory {self.dir}: {e.strerror}") from None
        return self.tmp

    def _remove(self) -> None:
        if self.tmp is not None:
            try:
                os.remove(self.tmp)
            except OSError:
                pass

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._remove()
            # an OSError on the temp file (or a write, which names no file) is the output's;
            # one naming another file (an input read inside the block) propagates as it is
            if issubclass(exc_type, OSError) and getattr(exc, "filename", None) in (None, self.tmp):
                raise ToolError(f"{self.path}: cannot write: {exc.strerror or exc}") from None
            return False
        try:
            _fsync_path(self.tmp)
            if os.path.isdir(self.path):  # appeared since the check
                raise IsADirectoryError(21, "output path is a directory")
            os.replace(self.tmp, self.path)
        except OSError as e:
            self._remove()
            raise ToolError(f"{self.path}: cannot write: {e.strerror or e}") from None
        except BaseException:
            self._remove()
            raise
        try:
            _fsync_path(self.dir, directory=True)
        except OSError:
            pass  # some file systems cannot fsync a directory; the rename itself is done
        return False


def write_text_atomic(path: str, text: str) -> None:
    """Writes a UTF-8 text file through atomic_output."""
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
