"""Unified diffs, as `diff -u` and `git diff` write them, read and applied the way a model writes them.

A model's diff is often slightly off: hunk headers with wrong line counts, blank context lines without
their leading space, line numbers that drifted. So a hunk is matched by its content, not by its header:
its context and removed lines must occur in the file (the occurrence nearest the header's line, at or
after the previous hunk's end), and are replaced by its context and added lines. Nothing is written
unless every hunk of every file applies."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEV_NULL = "/dev/null"
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


class DiffError(ValueError):
    """A diff that cannot be read or does not apply; the message says which hunk and why."""


@dataclass
class Hunk:
    line: int | None  # the header's first old line (1-based), a hint for where it applies
    old: list[str] = field(default_factory=list)  # context and removed lines
    new: list[str] = field(default_factory=list)  # context and added lines


@dataclass
class FilePatch:
    old_path: str  # DEV_NULL for a new file
    new_path: str  # DEV_NULL for a deleted file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.old_path if self.new_path == DEV_NULL else self.new_path


def _header_path(line: str) -> str:
    path = line[4:].split("\t", 1)[0].strip()
    return path[1:-1] if len(path) > 1 and path[0] == path[-1] == '"' else path


def _strip_prefix(old: str, new: str) -> tuple[str, str]:
    """git's a/ and b/ prefixes off (the -p1 that git's diffs need); other paths as written."""
    if (old == DEV_NULL or old.startswith("a/")) and (new == DEV_NULL or new.startswith("b/")) and \
            not (old == new == DEV_NULL):
        return (old if old == DEV_NULL else old[2:]), (new if new == DEV_NULL else new[2:])
    return old, new


def parse_diff(text: str) -> list[FilePatch]:
    """The files a unified diff changes, each with its hunks; a DiffError when it holds none or is malformed."""
    lines = text.replace("\r\n", "\n").rstrip("\n").split("\n")  # blank lines after the last hunk are not context
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _strip_prefix(_header_path(line), _header_path(lines[i + 1]))
            files.append(FilePatch(old, new))
            i += 2
            continue
        if line.startswith("@@"):
            if not files:
                raise DiffError("a hunk (@@ ... @@) comes before any file header; start the diff with "
                                "'--- a/PATH' and '+++ b/PATH' lines")
            m = _HUNK.match(line)
            hunk = Hunk(int(m.group(1)) if m else None)
            files[-1].hunks.append(hunk)
            i += 1
            while i < len(lines) and not lines[i].startswith("@@") and \
                    not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    pass
                elif body == "" or body[0] == " ":  # a blank context line may have lost its space
                    hunk.old.append(body[1:])
                    hunk.new.append(body[1:])
                elif body[0] == "-":
                    hunk.old.append(body[1:])
                elif body[0] == "+":
                    hunk.new.append(body[1:])
                else:
                    raise DiffError(f"hunk {len(files[-1].hunks)} of {files[-1].path}: the line {body[:60]!r} starts "
                                    "with none of ' ', '-', '+'; every line of a hunk needs one")
                i += 1
            continue
        i += 1
    if not files:
        raise DiffError("no file headers found: a unified diff starts each file with '--- a/PATH' then '+++ b/PATH', "
                        "then hunks that start with '@@'")
    for f in files:
        if not f.hunks:
            raise DiffError(f"{f.path}: a file header with no hunk (@@ ... @@) after it")
        if f.old_path == DEV_NULL == f.new_path:
            raise DiffError("a file header names /dev/null on both sides")
    return files


def _positions(lines: list[str], block: list[str], start: int) -> list[int]:
    n = len(block)
    return [i for i in range(start, len(lines) - n + 1) if lines[i:i + n] == block]


def apply_hunks(text: str, patch: FilePatch) -> str:
    """`text` with every hunk of `patch` applied in order; a DiffError naming the first that does not apply."""
    trailing = text.endswith("\n") or not text
    lines = text.split("\n") if text else []
    if text and trailing:
        lines.pop()
    cursor, drift = 0, 0
    for k, hunk in enumerate(patch.hunks, 1):
        if not hunk.old:  # a pure insertion: only its header says where
            if hunk.line is None:
                raise DiffError(f"hunk {k} of {patch.path} adds lines with no context and no line number; include "
                                "a few unchanged lines around it")
            at = min(max(hunk.line + drift, cursor), len(lines))
        else:
            found = _positions(lines, hunk.old, cursor)
            if not found:
                raise DiffError(f"hunk {k} of {patch.path} does not apply: its context and removed lines (the ' ' and "
                                "'-' lines) do not occur in the file as written after the previous hunk; read the file "
                                "and copy those lines exactly")
            hint = (hunk.line - 1 + drift) if hunk.line is not None else cursor
            at = min(found, key=lambda i: (abs(i - hint), i))
        lines[at:at + len(hunk.old)] = hunk.new
        cursor = at + len(hunk.new)
        drift += len(hunk.new) - len(hunk.old)
    return "\n".join(lines) + ("\n" if trailing and lines else "")
