"""Unified diffs: what difflib and git write applies exactly; what models get wrong (header counts, drifted
line numbers, blank context lines without their space) still applies; what cannot apply says why."""

from __future__ import annotations

import difflib

import pytest

from assay.envs.builtin._unidiff import DEV_NULL, DiffError, apply_hunks, parse_diff

OLD = "".join(f"line {i}\n" for i in range(1, 31))


def udiff(old: str, new: str, path: str = "pkg/m.py", n: int = 3) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}", n=n))


def test_difflib_diffs_apply_exactly():
    new = OLD.replace("line 3\n", "line three\n").replace("line 20\n", "").replace("line 28\n", "line 28\nextra\n")
    for n in (0, 1, 3):
        [patch] = parse_diff(udiff(OLD, new, n=n))
        assert patch.path == "pkg/m.py" and patch.old_path == patch.new_path  # git's a/ b/ prefixes are dropped
        assert apply_hunks(OLD, patch) == new


def test_what_models_get_wrong_still_applies():
    new = OLD.replace("line 10\n", "line ten\n")
    good = udiff(OLD, new)
    assert "@@ -7,7 +7,7 @@" in good
    wrong_counts = good.replace("@@ -7,7 +7,7 @@", "@@ -7,9 +7,2 @@")
    drifted = good.replace("@@ -7,7 +7,7 @@", "@@ -1 +1 @@")
    no_header_numbers = good.replace("@@ -7,7 +7,7 @@", "@@")
    for diff in (wrong_counts, drifted, no_header_numbers, good + "\n\n"):
        assert apply_hunks(OLD, parse_diff(diff)[0]) == new
    blank = "a\n\nb\n"
    stripped = "--- x.py\n+++ x.py\n@@ -1,3 +1,3 @@\n a\n\n-b\n+c\n"  # the blank context line lost its space
    assert apply_hunks(blank, parse_diff(stripped)[0]) == "a\n\nc\n"


def test_repeated_text_goes_where_the_header_says():
    text = "x = 1\ny = 2\n" * 3
    diff = "--- f\n+++ f\n@@ -3,2 +3,2 @@\n x = 1\n-y = 2\n+y = 3\n"
    assert apply_hunks(text, parse_diff(diff)[0]) == "x = 1\ny = 2\nx = 1\ny = 3\nx = 1\ny = 2\n"


def test_new_deleted_and_several_files():
    diff = ("--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1,2 @@\n+a = 1\n+b = 2\n"
            "--- a/pkg/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone = True\n"
            + udiff(OLD, OLD.replace("line 1\n", "first\n")))
    new, old, changed = parse_diff(diff)
    assert (new.old_path, new.path) == (DEV_NULL, "pkg/new.py") and apply_hunks("", new) == "a = 1\nb = 2\n"
    assert (old.new_path, old.path) == (DEV_NULL, "pkg/old.py") and apply_hunks("gone = True\n", old) == ""
    assert apply_hunks(OLD, changed).startswith("first\nline 2\n")


@pytest.mark.parametrize("diff, says", [
    ("", "no file headers"),
    ("just some text\n", "no file headers"),
    ("@@ -1 +1 @@\n-a\n+b\n", "before any file header"),
    ("--- a/f\n+++ b/f\n", "no hunk"),
    ("--- a/f\n+++ b/f\n@@ -1 +1 @@\n*a\n", "starts with none of"),
    ("--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+a\n", "/dev/null on both sides"),
])
def test_malformed_diffs_say_what_is_wrong(diff, says):
    with pytest.raises(DiffError, match=says):
        parse_diff(diff)


def test_a_hunk_that_does_not_match_changes_nothing_and_says_which():
    diff = udiff(OLD, OLD.replace("line 5\n", "five\n")) + "@@ -25,1 +25,1 @@\n-not in the file\n+x\n"
    [patch] = parse_diff(diff)
    with pytest.raises(DiffError, match="hunk 2 of pkg/m.py does not apply"):
        apply_hunks(OLD, patch)
    insertion = parse_diff("--- f\n+++ f\n@@\n+orphan\n")[0]
    with pytest.raises(DiffError, match="no context and no line number"):
        apply_hunks(OLD, insertion)
