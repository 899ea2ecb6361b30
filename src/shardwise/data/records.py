"""Reading one piece of a corpus file as documents, streamed: a byte range of a text or JSON-lines file, a
range of a Parquet file's row groups, or a whole JSON array (parsed element by element). No file is read
whole; what is held at once is one read block and one record.

A record that cannot be a document (a line that is not JSON, an object without the text key, a text that
is not a string, a Parquet row group that cannot be decoded) is a bad record: with data.bad_records =
"error" it stops the preparation naming file and line (BadRecord); with "skip" it is counted by kind.
Bytes that are not UTF-8 are read as U+FFFD and counted (the record is kept); an empty or null text is
no document (an end-of-document token alone would only add a separator) and is counted as empty.
"""
from __future__ import annotations

import codecs
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.data.corpus import file_kind
from shardwise.data.finetune import FINETUNE_FORMATS, record_item
from shardwise.errors import ConfigError

# A big text file (one document) is read and tokenized in chunks of about this many bytes, cut after a
# newline: a tokenizer's Encoding of one call holds ~40 bytes a token, so a 32 MB file at once would
# hold ~300 MB. A file up to WHOLE_TEXT bytes is tokenized at once (the Python stdlib's largest is 0.76 MB).
READ_BLOCK = 1 << 20
WHOLE_TEXT = 4 << 20
BAD_KINDS = {"not_json": "not valid JSON", "no_text": "no text field", "not_text": "text is not a string",
             "unreadable": "unreadable Parquet rows", "not_object": "not an object",
             "no_fields": "no prompt / completion or messages", "bad_chat": "chat that cannot be rendered"}


@dataclass(frozen=True)
class Piece:
    """A part of one file that one preparation unit reads. text / jsonl: bytes [start, stop); parquet:
    row groups [start, stop); json (an array): the whole file. `ends_document`: a text piece that ends its
    file (the document gets its end-of-document token here, not in the piece before)."""

    path: str
    kind: str
    start: int
    stop: int
    ends_document: bool = True


class BadRecord(Exception):
    """A bad record under data.bad_records="error": where (file:line), what, and its kind (BAD_KINDS)."""

    def __init__(self, where: str, problem: str, kind: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem, self.kind = where, problem, kind

    def __reduce__(self):  # crosses from a preparation worker to its parent
        return BadRecord, (self.where, self.problem, self.kind)

    def error(self, path_field: str = "data.path", key_field: str = "data.text_key") -> ConfigError:
        """The user's error: a missing or wrong text field names the text key, anything else the path."""
        if self.kind in ("no_text", "not_text"):
            return ConfigError(key_field, f"{self.where} {self.problem}", f"set {key_field} to the field that holds the "
                               'text, or data.bad_records = "skip" to skip such records (they are counted and named)')
        return ConfigError(path_field, f"{self.where} {self.problem}", 'repair or remove that record, or set '
                           'data.bad_records = "skip" to skip such records (they are counted and named)')


@dataclass
class RecordStats:
    """What a piece's reading found besides documents: bad records by kind (skipped), the first of them,
    empty texts, and records with bytes that are not UTF-8 (kept, read with U+FFFD)."""

    policy: str = "error"
    bad: dict[str, int] = field(default_factory=dict)
    first_bad: str = ""
    empty: int = 0
    invalid_utf8: int = 0

    def bad_record(self, where: str, problem: str, kind: str) -> None:
        if self.policy != "skip":
            raise BadRecord(where, problem, kind)
        self.bad[kind] = self.bad.get(kind, 0) + 1
        if not self.first_bad:
            self.first_bad = f"{where}: {problem}"

    def add(self, other: dict) -> None:
        for kind, n in other.get("bad", {}).items():
            self.bad[kind] = self.bad.get(kind, 0) + n
        self.first_bad = self.first_bad or other.get("first_bad", "")
        self.empty += other.get("empty", 0)
        self.invalid_utf8 += other.get("invalid_utf8", 0)

    def as_dict(self) -> dict:
        return {"bad": dict(sorted(self.bad.items())), "first_bad": self.first_bad, "empty": self.empty,
                "invalid_utf8": self.invalid_utf8}


def line_number(path: str, offset: int) -> int:
    """The 1-based line of byte `offset` (read only when a bad record is named)."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 23, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count + 1


def _decode(raw: bytes, stats: RecordStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return raw.decode("utf-8", errors="replace")


def _text_chunks(piece: Piece, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    """A text piece with universal newlines (as Python's text mode reads them): a small file at once, as
    one document; a bigger one, or a piece of a file cut into several units, in chunks cut after
    newlines, the last of which ends the document when the piece ends the file."""
    with open(piece.path, "rb") as f:
        if piece.start == 0 and piece.ends_document and piece.stop == os.fstat(f.fileno()).st_size <= WHOLE_TEXT:
            text = _decode(f.read(), stats).replace("\r\n", "\n").replace("\r", "\n")
            if text:
                yield text, True
            else:
                stats.empty += 1
            return
        f.seek(piece.start)
        left = piece.stop - piece.start
        carry = b""
        while left > 0 or carry:
            block = f.read(min(READ_BLOCK, left)) if left > 0 else b""
            left = left - len(block) if block else 0  # a file cut short since it was planned ends here
            data = carry + block
            if left > 0:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # no newline in a whole block: keep reading (a long line)
                    carry = data
                    continue
                data, carry = data[:cut], data[cut:]
            else:
                carry = b""
            text = _decode(data, stats).replace("\r\n", "\n").replace("\r", "\n")
            yield text, left <= 0 and piece.ends_document


def _record_text(record: object, text_key: str, where: str, stats: RecordStats) -> str | None:
    if not isinstance(record, dict):
        stats.bad_record(where, f"is a JSON {type(record).__name__}, not an object with a {text_key!r} field", "not_object")
        return None
    if text_key not in record:
        keys = ", ".join(map(str, record)) or "none"
        stats.bad_record(where, f"has no key {text_key!r} (found: {keys})", "no_text")
        return None
    text = record[text_key]
    if text is None or text == "":
        stats.empty += 1
        return None
    if not isinstance(text, str):
        stats.bad_record(where, f"{text_key!r} is a {type(text).__name__}, not a string", "not_text")
        return None
    return text


def _text_of(text_key: str, stats: RecordStats, strings: bool = False):
    """The default item of a JSON record: its text (data.text_key); a fine-tuning corpus's is its prompt /
    completion or messages (data/finetune.py record_item). `where()` names the record, computed only for
    a bad one (a line number costs a read of the file up to it)."""
    def extract(record: object, where) -> str | None:
        if strings and isinstance(record, str):  # an element of a JSON array of strings
            return record or None
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:  # the slow path names the record
            text = _record_text(record, text_key, where(), stats)
        return text or None
    return extract


def _jsonl_documents(piece: Piece, extract, stats: RecordStats) -> Iterator[tuple[object, bool]]:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        offset = piece.start
        while offset < piece.stop:
            line = f.readline()
            if not line:
                break
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                record = None
                try:
                    record = json.loads(_decode(line, stats))
                except json.JSONDecodeError as e:
                    stats.bad_record(f"{piece.path}:{line_number(piece.path, at)}", f"is not valid JSON ({e.msg})", "not_json")
                    continue
            except json.JSONDecodeError as e:
                stats.bad_record(f"{piece.path}:{line_number(piece.path, at)}", f"is not valid JSON ({e.msg})", "not_json")
                continue
            item = extract(record, lambda at=at: f"{piece.path}:{line_number(piece.path, at)}")
            if item is not None:
                yield item, True


def _json_array_documents(piece: Piece, extract, stats: RecordStats) -> Iterator[tuple[object, bool]]:
    """A JSON array of strings or objects, element by element (json.JSONDecoder.raw_decode over a buffer
    refilled as it empties). A syntax error cannot be skipped: nothing after it can be found again."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, item = "", 0, False, 0

    def fill(f) -> bool:
        nonlocal buf, pos
        block = f.read(READ_BLOCK)
        text = utf8.decode(block, final=not block)
        if "\ufffd" in text:
            stats.invalid_utf8 += 1
        buf, pos = buf[pos:] + text, 0
        return bool(block)

    def skip_space(f) -> str:
        nonlocal pos, eof
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            eof = not fill(f)

    def syntax(problem: str) -> None:
        raise BadRecord(f"{piece.path} item {item}", f"{problem}; a JSON array cannot be read past a syntax error "
                        "(repair it, or write the records as JSON lines)", "not_json")

    with open(piece.path, "rb") as f:
        if skip_space(f) != "[":
            syntax("does not start a JSON array")
        pos += 1
        if skip_space(f) == "]":
            return
        while True:
            skip_space(f)  # raw_decode starts at a value, not at the space before it
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    if end == len(buf) and not eof:  # a number may go on in the next block
                        raise json.JSONDecodeError("truncated", buf, end)
                    break
                except json.JSONDecodeError as e:
                    if eof:
                        syntax(f"is not valid JSON ({e.msg})")
                    eof = not fill(f)
            pos = end
            found = extract(record, lambda item=item: f"{piece.path} item {item}")
            if found is not None:
                yield found, True
            item += 1
            sep = skip_space(f)
            if sep == "]":
                return
            if sep != ",":
                syntax(f"expected ',' or ']' after item {item - 1}")
            pos += 1


def _parquet_documents(piece: Piece, text_key: str, stats: RecordStats) -> Iterator[tuple[str, bool]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(piece.path)
    schema = pf.schema_arrow
    if text_key not in schema.names:  # the whole file's, never skipped: the key is wrong
        raise BadRecord(piece.path, f"has no column {text_key!r} (found: {', '.join(schema.names)})", "no_text")
    if not (pa.types.is_string(schema.field(text_key).type) or pa.types.is_large_string(schema.field(text_key).type)):
        raise BadRecord(piece.path, f"column {text_key!r} holds {schema.field(text_key).type}, not strings", "not_text")
    for group in range(piece.start, piece.stop):
        rows = pf.metadata.row_group(group).num_rows
        seen = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=[group], columns=[text_key]):
                for text in batch.column(0).to_pylist():  # strings or None: the column's type was checked
                    seen += 1
                    if text:
                        yield text, True
                    else:
                        stats.empty += 1
        except (OSError, pa.ArrowException) as e:
            where = f"{piece.path} row group {group} (rows {seen}-{rows - 1} of it)"
            if stats.policy != "skip":
                raise BadRecord(where, f"cannot be read ({e})", "unreadable") from None
            stats.bad["unreadable"] = stats.bad.get("unreadable", 0) + rows - seen
            stats.first_bad = stats.first_bad or f"{where}: cannot be read ({e})"


def _parquet_records(piece: Piece, fmt: str, stats: RecordStats) -> Iterator[tuple[object, bool]]:
    """Fine-tuning records of a Parquet piece: its prompt / completion columns, or its messages column (a
    list of structs, as Hugging Face datasets write chats), row by row."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(piece.path)
    columns = ["messages"] if fmt == "chat" else ["prompt", "completion"]
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:  # the whole file's, never skipped: it holds other records
        raise BadRecord(piece.path, f"has no column {missing[0]!r} (found: {', '.join(pf.schema_arrow.names)})", "no_fields")
    for group in range(piece.start, piece.stop):
        row = 0
        for batch in pf.iter_batches(batch_size=1024, row_groups=[group], columns=columns):
            for record in batch.to_pylist():
                where = functools.partial("{} row group {} row {}".format, piece.path, group, row)
                row += 1
                item = record_item(record, fmt, where, stats)
                if item is not None:
                    yield (item, where), True


JSON_READERS = {"jsonl": _jsonl_documents, "json": _json_array_documents}


def piece_documents(piece: Piece, text_key: str, stats: RecordStats, fmt: str = "text") -> Iterator[tuple[object, bool]]:
    """(text, ends_document) of every document (or, for a big text file, chunk of one) of a piece; for a
    fine-tuning corpus (`fmt`: data/finetune.py), ((item, where), True) of every record, `where()` naming it."""
    if piece.kind == "text":
        return _text_chunks(piece, stats)
    if fmt in FINETUNE_FORMATS:
        if piece.kind == "parquet":
            return _parquet_records(piece, fmt, stats)

        def extract(record: object, where):  # the item and where it is: rendering a chat may fail later
            item = record_item(record, fmt, where, stats)
            return None if item is None else (item, where)

        return JSON_READERS[piece.kind](piece, extract, stats)
    if piece.kind == "parquet":
        return _parquet_documents(piece, text_key, stats)
    return JSON_READERS[piece.kind](piece, _text_of(text_key, stats, strings=piece.kind == "json"), stats)


def whole_file_pieces(path: Path) -> list[Piece]:
    """One file as a single piece (tests, and the BPE sample of small corpora)."""
    kind = file_kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return [Piece(str(path), kind, 0, pq.ParquetFile(path).metadata.num_row_groups)]
    return [Piece(str(path), kind, 0, path.stat().st_size)]


def iter_documents(files: list[Path], text_key: str, policy: str = "error") -> Iterator[str]:
    """Every non-empty document of these files, in order (big text files as one document)."""
    stats = RecordStats(policy)
    try:
        for path in files:
            parts: list[str] = []
            for piece in whole_file_pieces(path):
                for text, ends in piece_documents(piece, text_key, stats):
                    parts.append(text)
                    if ends:
                        yield "".join(parts)
                        parts = []
    except BadRecord as e:
        raise e.error() from None
