"""`benchmarks.cpu_speed`'s draw rows: both draws timed on the same logits."""

from benchmarks.cpu_speed import measure_draw


def test_the_draw_benchmark_times_both_draws():
    result = measure_draw(rows=4, vocab_size=1000, repeats=3)
    assert set(result) == {"torch.multinomial", "draw_tokens"}
    assert all(ms > 0 for ms in result.values())
