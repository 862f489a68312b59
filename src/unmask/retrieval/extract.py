"""The text of an uploaded file, for chunking: by its extension, UTF-8 (a BOM allowed), HTML reduced to its text,
PDF through pypdf's text layer (a scanned PDF without one is refused: there is no OCR here).

Unsupported types and undecodable bytes raise `ExtractError` naming the file; the API answers those with a 400
when the file is attached, before anything is queued.
"""
from __future__ import annotations

import io
import json
from html.parser import HTMLParser
from pathlib import PurePath

from unmask.errors import UnmaskError

PLAIN = {".txt", ".md", ".markdown", ".rst", ".tex", ".csv", ".tsv", ".log", ".ini", ".cfg", ".toml", ".yaml",
         ".yml", ".xml", ".css", ".sql"}
SOURCE = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cs", ".java", ".kt", ".go", ".rs", ".rb", ".php",
          ".js", ".mjs", ".ts", ".tsx", ".jsx", ".sh", ".bash", ".swift", ".scala", ".lua", ".pl", ".r", ".m"}
STRUCTURED = {".json", ".jsonl"}
HTML = {".html", ".htm"}
PDF = {".pdf"}
SUPPORTED = PLAIN | SOURCE | STRUCTURED | HTML | PDF


class ExtractError(UnmaskError):
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class _Text(HTMLParser):
    SKIP = {"script", "style", "head", "template"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "article", "table"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self._skipping += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self._skipping:
            self._skipping -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self._skipping:
            self.parts.append(data)


def check_supported(filename: str) -> str:
    suffix = PurePath(filename).suffix.lower()
    if suffix not in SUPPORTED:
        raise ExtractError(f"file {filename!r}: type {suffix or '(no extension)'!r} is not supported for search; "
                           f"supported: {', '.join(sorted(SUPPORTED))}", "unsupported_file")
    return suffix


def pdf_text(filename: str, data: bytes) -> str:
    """The text layer of a PDF, page by page (pages separated by a blank line). pypdf (BSD, pure Python) reads
    it: the well-kept library the issue asks for, with no system packages."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):  # an owner password alone still opens for reading
            raise ExtractError(f"file {filename!r} is an encrypted PDF; upload it without a password",
                               "invalid_file")
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    except ExtractError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as e:  # what a damaged file raises in pypdf
        raise ExtractError(f"file {filename!r} is not a readable PDF: {e}", "invalid_file") from None
    text = "\n\n".join(p for p in pages if p)
    if not text.strip():
        raise ExtractError(f"file {filename!r} has no text layer (a scanned PDF?); unmask does no OCR",
                           "invalid_file")
    return text


def extract_text(filename: str, data: bytes) -> str:
    suffix = check_supported(filename)
    if suffix in PDF:
        return pdf_text(filename, data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ExtractError(f"file {filename!r} is not UTF-8 text (byte {e.start})", "invalid_file") from None
    if suffix in HTML:
        parser = _Text()
        parser.feed(text)
        parser.close()
        lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
        return "\n".join(line for line in lines if line)
    if suffix == ".json":
        try:
            json.loads(text)
        except ValueError as e:
            raise ExtractError(f"file {filename!r} is not valid JSON: {e}", "invalid_file") from None
    return text
