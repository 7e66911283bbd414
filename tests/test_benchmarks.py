"""The statistics the paired benchmark rests its verdicts on."""

import random

from benchmarks.paired import median_interval


def test_median_interval_is_the_binomial_order_statistics():
    values = list(range(16, 0, -1))
    # Binomial(16, 1/2): P(X <= 3) = 0.011 <= 0.025 < P(X <= 4) = 0.038, so the 4th and 13th values
    assert median_interval(values) == (4, 13)
    # Binomial(5, 1/2): P(X = 0) = 0.031 > 0.025, so nothing narrower than the whole range
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([2.0]) == (2.0, 2.0)


def test_median_interval_covers_the_true_median_as_often_as_it_claims():
    rng = random.Random(0)
    trials, covered = 4000, 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(16)])
        covered += low <= 0.6931471805599453 <= high  # the exponential's median, ln 2
    assert 0.96 <= covered / trials <= 0.995  # exactly 1 - 2 * 0.0106 = 0.979 for 16 values


def _suite_results(rows: dict) -> dict:
    size = {"state_bytes": 3_000_000_000, "weight_bytes": 1_000_000_000, "n_layers": 2, "rows": rows}
    return {"ranks": 2, "repeats": 1, "sizes": [size]}


def _row(seconds: float, peak: int = 0) -> dict:
    return {"median_s": seconds, "min_s": seconds, "max_s": seconds, "peak_extra_bytes_per_rank": peak}


def test_suite_report_formats_a_row_without_its_floor():
    from benchmarks.suite_report import detail, overview, targets

    results = _suite_results({"ours_save": _row(1.0)})  # `--only ours_save`: no raw floor row
    assert "1.00 s (-)" in overview(results)
    assert "| - |" in detail(results["sizes"][0], results["ranks"])
    assert "save <= 1.05x" in targets(results)


def test_suite_report_hf_memory_is_against_the_weights():
    from benchmarks.suite_report import targets

    # 0.04 GB per rank, 2 ranks: 8% of the 1 GB of weights (met), not 2.7% of the 3 GB state
    results = _suite_results({"ours_hf_save": _row(1.0, peak=40_000_000), "ours_save": _row(1.0, peak=40_000_000)})
    lines = {line.split(" (sum")[0]: line for line in targets(results).splitlines()}
    assert "8% met" in lines["| HF export peak extra memory <= 10% of weights"]
    assert "3% met" in lines["| save peak extra memory <= 10% of state"]


def test_faults_draws_only_phases_that_fire_on_a_local_folder():
    from benchmarks import faults as bench_faults

    assert "upload" not in bench_faults.LOCAL_PHASES
    rng = random.Random(0)
    for steps in (8, 10, 12, 80):
        for resume in range(0, steps - bench_faults.INTERVAL, bench_faults.INTERVAL):
            for _ in range(20):
                point, _mode = bench_faults.choose_failpoint(rng, resume, steps)
                phase, step = point.split("@")[0], int(point.split("@")[1].split(":")[0])
                assert phase != "upload"
                # the kill comes before the last step commits: the final run has steps to train
                last = step + bench_faults.INTERVAL * bench_faults.KEEP if phase == "purge" else step
                assert last < steps, point


def test_async_save_table_skips_modes_not_measured():
    import contextlib
    import io

    from benchmarks.async_save import print_table

    row = {"block": 1.0, "total": 2.0, "extra": None, "slow": 1.1}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table({"bytes": 1e9, "raw disk": row, "disabled": row, "dcp.async_save": row}, 2)
    assert "ours, disabled" in out.getvalue() and "ours, async |" not in out.getvalue()
