"""`assay bench verify`: both modes grade the same candidates to the same verdicts, and the table says so."""

import pytest

from assay.bench.verify import candidates, run_verify_bench


def test_half_of_the_candidates_are_wrong():
    items = candidates(8)
    assert len(items) == 8 and len({c.source for c in items}) == 8
    assert all("return 1 + (" in c.source for c in items[1::2])


@pytest.mark.usefixtures("isolated")
def test_the_bench_prints_both_modes_with_equal_verdicts():
    text = run_verify_bench(n=8, threads=4, rounds=1)
    assert "a sandboxed run per candidate" in text and "graded together" in text
    assert text.count("4/8") == 2 and "1.00x" in text
