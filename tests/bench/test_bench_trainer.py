from assay.bench.trainer import VARIANTS, run_trainer_bench


def test_the_trainer_bench_measures_every_variant_in_its_own_process():
    lines = []
    text = run_trainer_bench(rounds=1, seqs=8, length=40, completion=8, hidden=32, threads=1, log=lines.append)
    assert len(lines) == len(VARIANTS)  # one fresh process each
    for variant in VARIANTS:
        row = next(r for r in text.splitlines() if r.startswith(f"| {variant} |"))
        seconds, peak = (float(c) for c in row.strip("|").split("|")[1:3])
        assert seconds > 0 and peak > 0
    assert "shared prompt / selective + lora: step time" in text
