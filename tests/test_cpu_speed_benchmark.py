"""`benchmarks.cpu_speed`: the draw rows (both draws timed on the same logits), the peak a
generation is measured against, the A/B of each change to the loop, and a whole quick run."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.cpu_speed import (
    CHANGES,
    ab_runs,
    alternate,
    main,
    matmul_flops_per_token,
    matmul_peak,
    measure_draw,
    parse_args,
)


def test_the_draw_benchmark_times_both_draws():
    result = measure_draw(rows=4, vocab_size=1000, repeats=3)
    assert set(result) == {"torch.multinomial", "draw_tokens"}
    assert all(ms > 0 for ms in result.values())


def test_a_tokens_flops_count_the_head_once_and_not_the_input_embeddings(tiny_model):
    total = sum(p.numel() for p in tiny_model.parameters())
    assert matmul_flops_per_token(tiny_model) == 2 * total  # tied: the head is the embeddings
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          tie_word_embeddings=False))  # fmt: skip
    total = sum(p.numel() for p in untied.parameters())
    assert matmul_flops_per_token(untied) == 2 * (total - 50 * 16)
    assert matmul_peak(torch.float32, size=64, repeats=1) > 0


def test_the_ab_options_are_checked_and_default_to_the_best_of_three(capsys):
    args = parse_args(["--small", "--ab", "cache,rows"])
    assert args.ab == ["cache", "rows"] and args.repeats == 3
    assert args.samplers == ["loop", "static"]  # --small compiles nothing
    assert parse_args([]).repeats == 2
    with pytest.raises(SystemExit):
        parse_args(["--ab", "cache,fast"])
    assert "unknown change(s) fast" in capsys.readouterr().err


def test_each_change_runs_on_and_off_on_the_same_model(tiny_model, tokenizer):
    args = parse_args(["--small"])
    batch = [tokenizer(text)["input_ids"] for text in ("Ann has 3 pens.\n", "Bob?\n")
             for _ in range(args.group_size)]  # fmt: skip
    for change in CHANGES:
        rates = alternate(ab_runs(change, tiny_model, tokenizer.pad_token_id, args), batch, 1)
        assert set(rates) == {"off", "on"} and all(rate > 0 for rate in rates.values())


@pytest.mark.slow
def test_a_quick_run_and_a_quick_ab_on_the_built_in_policy(capsys):
    """`--small` (the built-in policy): the table, then every change on and off."""
    table = main(["--small"])
    generation = [r for r in table if r["what"] == "generation"]
    assert generation and {r["sampler"] for r in generation} <= {"loop", "static"}
    assert all(0 < r["peak_share_percent"] < 100 for r in generation)
    assert [r["dtype"] for r in table if r["what"] == "train step"] == ["float32", "bfloat16"]
    ab = main(["--small", "--ab", ",".join(CHANGES), "--dtypes", "float32"])
    assert [r["change"] for r in ab if r["what"] == "ab"] == list(CHANGES)
    out = capsys.readouterr().out
    assert "peak of a 2048 x 2048 matrix product" in out and "policy.dtype=auto: " in out
