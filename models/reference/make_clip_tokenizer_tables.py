#!/usr/bin/env python3
"""Writes models/clip_tokenizer_tables.inc: the character tables that models/clip_tokenizer.cpp
needs to match Hugging Face transformers' slow CLIPTokenizer exactly.

The tables come from the very libraries the reference tokenizer uses, so the C++ tokenizer sees
the same Unicode version they do:

- kLetter, kNumber, kSpace, kUnmatched: how the `regex` module classifies each code point in
  CLIPTokenizer's pre-tokenizer pattern, compiled with re.IGNORECASE as transformers does
  ([\\p{L}], [\\p{N}], \\s, and the code points no alternative of the pattern matches at all:
  U+0345 under IGNORECASE). The same \\s set serves whitespace_clean's `\\s+`.
- kStripSpace: str.isspace, for whitespace_clean's str.strip().
- kDecimalDigit: Python `re`'s \\d (Unicode Nd, Python's unicodedata), for ftfy's
  remove_terminal_escapes.
- kHtmlEntities: ftfy.chardata.HTML_ENTITIES (the html5 entities that end in ';', plus ftfy's
  upper-cased variants), for ftfy.fixes.unescape_html.
- kInvalidCharrefs, kInvalidCodepoints: the tables html.unescape applies to numeric character
  references, which ftfy defers to.

Run with the project's test venv (the one LORAPIPE_PYTHON names) and commit the result:
  $LORAPIPE_PYTHON models/reference/make_clip_tokenizer_tables.py models/clip_tokenizer_tables.inc
With --check, compares instead of writing and exits 1 when the file is stale.
"""

import argparse
import html
import re
import sys
import unicodedata

import ftfy
import ftfy.chardata
import regex

MAX_CODE_POINT = 0x110000


def ranges_of(predicate):
    """Inclusive [first, last] ranges of the code points that satisfy `predicate`."""
    out = []
    start = None
    for cp in range(MAX_CODE_POINT + 1):
        hit = cp < MAX_CODE_POINT and not (0xD800 <= cp <= 0xDFFF) and predicate(chr(cp))
        if hit and start is None:
            start = cp
        elif not hit and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def c_string(text):
    """A C++ string literal holding `text` as UTF-8, every non-alphanumeric byte octal-escaped."""
    parts = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        parts.append(ch if ch.isascii() and ch.isalnum() else "\\%03o" % byte)
    return '"' + "".join(parts) + '"'


def range_table(name, comment, ranges):
    lines = [f"// {comment} ({len(ranges)} ranges)",
             f"inline constexpr CodePointRange {name}[] = {{"]
    row = []
    for first, last in ranges:
        row.append(f"{{0x{first:X}, 0x{last:X}}},")
        if len(row) == 5:
            lines.append("    " + " ".join(row))
            row = []
    if row:
        lines.append("    " + " ".join(row))
    lines.append("};")
    return "\n".join(lines)


def build():
    flags = regex.IGNORECASE
    letter = regex.compile(r"[\p{L}]", flags)
    number = regex.compile(r"[\p{N}]", flags)
    other = regex.compile(r"[^\s\p{L}\p{N}]", flags)
    space = regex.compile(r"\s", flags)
    plain_space = regex.compile(r"\s")
    digit = re.compile(r"\d")

    classes = {}
    for cp in range(MAX_CODE_POINT):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        hits = (bool(letter.match(ch)), bool(number.match(ch)), bool(other.match(ch)),
                bool(space.match(ch)))
        if sum(hits) > 1:
            sys.exit(f"U+{cp:04X} falls in more than one pre-tokenizer class: {hits}")
        if bool(space.match(ch)) != bool(plain_space.match(ch)):
            sys.exit(f"U+{cp:04X}: \\s differs with and without IGNORECASE")
        classes[cp] = hits

    sections = [
        range_table("kLetter", "regex [\\p{L}] under IGNORECASE",
                    ranges_of(lambda ch: classes[ord(ch)][0])),
        range_table("kNumber", "regex [\\p{N}] under IGNORECASE",
                    ranges_of(lambda ch: classes[ord(ch)][1])),
        range_table("kSpace", "regex \\s", ranges_of(lambda ch: classes[ord(ch)][3])),
        range_table("kUnmatched", "code points no alternative of the pattern matches (skipped "
                    "like whitespace)", ranges_of(lambda ch: not any(classes[ord(ch)]))),
        range_table("kStripSpace", "Python str.isspace", ranges_of(str.isspace)),
        range_table("kDecimalDigit", "Python re \\d", ranges_of(lambda ch: bool(digit.match(ch)))),
    ]

    entities = sorted((name[1:-1], value) for name, value in ftfy.chardata.HTML_ENTITIES.items())
    lines = [f"// ftfy.chardata.HTML_ENTITIES without '&' and ';', sorted by name "
             f"({len(entities)} entries)",
             "inline constexpr HtmlEntity kHtmlEntities[] = {"]
    for name, value in entities:
        lines.append(f"    {{{c_string(name)}, {c_string(value)}}},")
    lines.append("};")
    sections.append("\n".join(lines))

    charrefs = sorted(html._invalid_charrefs.items())
    lines = [f"// html._invalid_charrefs ({len(charrefs)} entries)",
             "inline constexpr InvalidCharref kInvalidCharrefs[] = {"]
    for code, value in charrefs:
        lines.append(f"    {{0x{code:X}, {c_string(value)}}},")
    lines.append("};")
    sections.append("\n".join(lines))

    codepoints = sorted(html._invalid_codepoints)
    sections.append(range_table("kInvalidCodepoints", "html._invalid_codepoints",
                                [(cp, cp) for cp in codepoints]))

    header = (
        "// Generated by models/reference/make_clip_tokenizer_tables.py; do not edit.\n"
        f"// Python {sys.version.split()[0]} (unicodedata {unicodedata.unidata_version}), "
        f"regex {regex.__version__}, ftfy {ftfy.__version__}.\n"
        "// Included by models/clip_tokenizer.cpp inside its anonymous namespace, after the\n"
        "// CodePointRange, HtmlEntity and InvalidCharref structs.\n")
    return header + "\n" + "\n\n".join(sections) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    text = build()
    if args.check:
        with open(args.output, encoding="utf-8") as f:
            if f.read() != text:
                sys.exit(f"{args.output} is stale: rerun {sys.argv[0]}")
        return
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
