"""The built-in sampler's two paths: the loop (its KV cache written in place, the prefill's logits
at the last position only, its variants for measurements) and the static path
(`tba.policy.sampling.StaticSampler`) against it: the same greedy responses, the same samples from
one seed, the trainer's log-probs on their samples, draws that follow the softmax, few host
synchronisations and one compilation per bucket.

`compiled` here traces the decode step with torch.compile's `eager` backend (dynamo's whole-graph
capture, the guards and the recompilations, without inductor's code generation, which takes
~20 s on a CPU); the slow test runs inductor itself."""

from __future__ import annotations

import gc
import math
import weakref
from collections import Counter
from types import SimpleNamespace
from unittest import mock

import peft
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tba.config import load_config
from tba.errors import ConfigError
from tba.evaluation import EvalSettings
from tba.policy.decoding import draw_tokens, prefill
from tba.policy.engines import BuiltinEngine
from tba.policy.kv_cache import PreallocatedLayer, logits_keyword, preallocated_cache
from tba.policy.logprobs import token_logprobs
from tba.policy.model import enable_checkpointing, is_checkpointing
from tba.policy.sampling import (
    LoopSampler,
    LoopVariant,
    StaticSampler,
    bucket,
    generate,
    pick_tokens,
    resolve_sampler,
    sampler_for,
)

VOCAB, PAD = 48, 0
# Different lengths, and repeated prompts (not next to each other): each distinct prompt is
# encoded once and its cache copied to each of its rows.
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 5, 6, 7], [1, 3, 4, 5, 6, 7, 8, 9, 10], [1, 20, 30],
           [1, 8, 9]]  # fmt: skip
MAX_NEW = 12


def tiny(arch: str) -> torch.nn.Module:
    """A random 2-layer model whose weights are large enough that its greedy responses vary
    from token to token (at the default scale they repeat one token)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                 pad_token_id=PAD, eos_token_id=2)  # fmt: skip
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny(request.param)


def static_sampler(model, kind: str, backend=None) -> StaticSampler:
    if kind == "static":
        return StaticSampler(model, compile=False)
    return StaticSampler(model, compile=True, compile_options={"backend": backend or "eager"})


def greedy_eos(model, prompts: list[list[int]]) -> int:
    """A token that the loop's greedy responses reach first at the most different steps, in
    some rows and not in others: as EOS, responses end at different steps or run to the limit."""
    rows = generate(model, prompts, eos_id=-1, pad_id=PAD, max_new_tokens=MAX_NEW,
                    greedy=True).response_ids  # fmt: skip

    def spread(token: int) -> tuple[int, int]:
        firsts = {row.index(token) if token in row else -1 for row in rows}
        return len(firsts), -1 in firsts

    return max(range(3, VOCAB), key=spread)


def assert_same(out, expected, tol: float = 1e-5) -> None:
    assert out.response_ids == expected.response_ids
    assert out.truncated == expected.truncated
    for ours, theirs in zip(out.token_logps, expected.token_logps, strict=True):
        assert ours == pytest.approx(theirs, abs=tol)
    assert out.logps == pytest.approx(expected.logps, abs=tol)


def test_the_compiled_sampler_runs_on_a_module_that_trains_with_checkpointing(model):
    """In-process, the searcher samples with the trainer's own module: gradient checkpointing
    (on by default on a GPU) must leave its decode step one graph, with the loop's tokens. The
    embeddings keep no hook of transformers' that sets `requires_grad_` (a graph break that
    torch 2.11's whole-graph capture refuses)."""
    expected = generate(model, PROMPTS, eos_id=-1, pad_id=PAD, max_new_tokens=MAX_NEW,
                        greedy=True)  # fmt: skip
    checkpointed = tiny(model.config.model_type)  # "llama" or "qwen2"
    enable_checkpointing(checkpointed)
    assert is_checkpointing(checkpointed)
    assert not checkpointed.get_input_embeddings()._forward_hooks
    out = static_sampler(checkpointed, "compiled").generate(
        PROMPTS, eos_id=-1, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True)
    assert_same(out, expected)


@pytest.mark.parametrize("kind", ["static", "compiled"])
def test_greedy_responses_are_the_loops(model, kind):
    eos = greedy_eos(model, PROMPTS)
    expected = generate(model, PROMPTS, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW,
                        greedy=True)  # fmt: skip
    lengths = {len(r) for r in expected.response_ids}
    assert len(lengths) >= 3 and any(expected.truncated) and not all(expected.truncated)
    sampler = static_sampler(model, kind)
    for _ in range(2):  # the second generation reuses the bucket's buffers and cache
        out = sampler.generate(PROMPTS, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW,
                               greedy=True)  # fmt: skip
        assert_same(out, expected)
    # A batch of another bucket, and the first bucket again after it.
    more = PROMPTS * 2
    assert_same(
        sampler.generate(more, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True),
        generate(model, more, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True),
    )
    assert len(sampler.buckets) == 2
    out = sampler.generate(PROMPTS, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True)
    assert_same(out, expected)


def test_greedy_responses_are_the_loops_when_padding_is_eos():
    """GPT-2 has no pad token: rows pad with EOS once done."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.3, bos_token_id=2, eos_token_id=2)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    eos = greedy_eos(model, PROMPTS)
    options = dict(eos_id=eos, pad_id=eos, max_new_tokens=MAX_NEW, greedy=True)
    expected = generate(model, PROMPTS, **options)
    assert any(expected.truncated) and not all(expected.truncated)
    assert_same(static_sampler(model, "static").generate(PROMPTS, **options), expected)


def add_eos_bias(model, eos: int, bias: float = 3.0):
    """`model` with `bias` added to the EOS logit (a hook in its forward, which the trainer's
    log-probs see too), so that sampled responses end at all sorts of steps."""
    added = torch.zeros(VOCAB)
    added[eos] = bias
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output + added)
    return handle


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_trainers(model, temperature):
    eos = 3
    handle = add_eos_bias(model, eos)
    try:
        sampler = static_sampler(model, "static")
        prompts = PROMPTS * 4
        generator = torch.Generator().manual_seed(0)
        out = sampler.generate(prompts, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW,
                               temperature=temperature, generator=generator)  # fmt: skip
        with torch.no_grad():
            trainer, mask = token_logprobs(model, prompts, out.response_ids, pad_id=PAD,
                                           temperature=temperature)  # fmt: skip
    finally:
        handle.remove()
    lengths = [len(r) for r in out.response_ids]
    assert len(set(lengths)) >= 4 and any(out.truncated) and not all(out.truncated)
    for row, (response, truncated) in enumerate(zip(out.response_ids, out.truncated)):
        assert len(out.token_logps[row]) == len(response) == int(mask[row].sum())
        assert out.token_logps[row] == pytest.approx(trainer[row, : len(response)].tolist(),
                                                     abs=1e-5)  # fmt: skip
        assert out.logps[row] == pytest.approx(sum(out.token_logps[row]), abs=1e-5)
        assert eos not in response[:-1]
        assert truncated == (response[-1] != eos)
        assert len(response) == MAX_NEW or not truncated
    # Past its EOS a row ran as padding, with log-prob 0.
    buffers = sampler.buckets[bucket(len(prompts), 9 + MAX_NEW)]
    for row, length in enumerate(lengths):
        assert buffers.tokens[row, length:MAX_NEW].eq(PAD).all()
        assert buffers.logps[row, length:MAX_NEW].eq(0).all()


def chi_squared_threshold(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-squared with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_squared(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """The statistic and its degrees of freedom, cells of expected count < 5 pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(statistic), int(keep.sum()) - 1


def test_the_inverse_transform_draws_from_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -6.0, 3.0])
    rows, temperature = 40_000, torch.tensor(0.8)
    generator = torch.Generator().manual_seed(0)
    uniform = torch.rand((rows, 1), dtype=torch.float64, generator=generator)
    done, sample = torch.zeros(rows, dtype=torch.bool), torch.tensor(False)
    token, logp, _ = pick_tokens(logits.expand(rows, -1), uniform, sample, done, temperature, -1,
                                 PAD)  # fmt: skip
    probs = torch.softmax(logits / 0.8, -1)
    statistic, df = chi_squared(torch.bincount(token, minlength=len(logits)), probs)
    assert statistic < chi_squared_threshold(df)
    assert torch.allclose(logp, probs.log()[token])
    # The greedy flag: the argmax whatever the numbers; a done row: padding with log-prob 0.
    zeros = torch.zeros((2, 1), dtype=torch.float64)
    token, logp, now_done = pick_tokens(logits.expand(2, -1), zeros, torch.tensor(True),
                                        torch.tensor([False, True]), temperature, 7,
                                        PAD)  # fmt: skip
    assert token.tolist() == [7, PAD] and logp[1] == 0 and now_done.tolist() == [True, True]


def test_a_token_owns_exactly_its_probabilitys_share_of_the_uniform_numbers():
    # p = (0, 1e-12, 0.5 - 1e-12, 0, 0.5): the float64 cumulative sum gives the 1e-12 token its
    # own sliver, tokens of probability 0 none (not even at u = 0), and u just below 1 the last.
    probs = torch.tensor([0.0, 1e-12, 0.5 - 1e-12, 0.0, 0.5], dtype=torch.float64)
    log_probs = probs.log().float().expand(5, -1)
    uniform = torch.tensor([[0.0], [0.5e-12], [2e-12], [0.75], [1 - 1e-16]], dtype=torch.float64)
    assert draw_tokens(log_probs, uniform).tolist() == [1, 1, 2, 4, 4]


@pytest.mark.parametrize("kind", ["loop", "static"])
def test_the_samplers_first_tokens_follow_the_models_softmax(model, kind):
    prompt, rows = [1, 5, 6, 7], 4096
    sampler = LoopSampler(model) if kind == "loop" else static_sampler(model, "static")
    out = sampler.generate([prompt] * rows, eos_id=-1, pad_id=PAD, max_new_tokens=1,
                           generator=torch.Generator().manual_seed(1))  # fmt: skip
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    counts = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=VOCAB)
    statistic, df = chi_squared(counts, probs)
    assert df > 5 and statistic < chi_squared_threshold(df)


def test_a_seeded_generator_draws_the_same_samples(model):
    sampler = static_sampler(model, "static")

    def draw(seed):
        return sampler.generate(PROMPTS, eos_id=3, pad_id=PAD, max_new_tokens=MAX_NEW,
                                generator=torch.Generator().manual_seed(seed))  # fmt: skip

    assert draw(5) == draw(5)
    assert draw(5).response_ids != draw(6).response_ids


SYNCS = ("item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "__index__")


def count_host_syncs(run) -> int:
    """Calls, during `run()`, of every tensor method that waits for the device to hand a value
    to the host."""
    counts: Counter[str] = Counter()

    def counting(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return method

    with mock.patch.multiple(torch.Tensor, **{name: counting(name) for name in SYNCS}):
        run()
    return sum(counts.values())


@pytest.mark.parametrize("kind", ["static", "compiled"])
def test_host_synchronisations_are_one_per_check_not_per_token(model, kind):
    tokens, check_every = 40, 8
    sampler = static_sampler(model, kind)
    sampler.check_every = check_every
    options = dict(eos_id=-1, pad_id=PAD, max_new_tokens=tokens,
                   generator=torch.Generator().manual_seed(0))  # fmt: skip
    sampler.generate(PROMPTS, **options)  # compiles
    syncs = count_host_syncs(lambda: sampler.generate(PROMPTS, **options))
    assert syncs <= math.ceil(tokens / check_every) + 6
    # The counter sees the loop's check after every token.
    assert count_host_syncs(lambda: generate(model, PROMPTS, **options)) >= tokens


def test_one_compilation_per_bucket():
    model = tiny("llama")
    torch._dynamo.reset()
    counter = CompileCounter()
    sampler = static_sampler(model, "compiled", backend=counter)
    generator = torch.Generator().manual_seed(0)
    # Within a bucket (5 to 8 rows, prompt + response up to 64 tokens): prompts, lengths,
    # temperatures, greedy or sampled change nothing compiled.
    for prompts, max_new, temperature, greedy in [
        (PROMPTS, 12, 1.0, True), (PROMPTS[:5], 30, 0.7, False), (PROMPTS + PROMPTS[:2], 5, 1.3,
         False), ([[1, 2] * 20] * 8, 20, 1.0, True),
    ]:  # fmt: skip
        sampler.generate(prompts, eos_id=3, pad_id=PAD, max_new_tokens=max_new,
                         temperature=temperature, greedy=greedy, generator=generator)  # fmt: skip
    assert counter.frame_count == 1
    # Other buckets compile anew, past Dynamo's limit of variants (made 1 here): a step compiled
    # as one graph would fail there, were the limit not raised while generating.
    with torch._dynamo.config.patch(cache_size_limit=1):
        sampler.generate(PROMPTS * 2, eos_id=3, pad_id=PAD, max_new_tokens=12, greedy=True)
        sampler.generate(PROMPTS[:2], eos_id=3, pad_id=PAD, max_new_tokens=100, greedy=True)
    assert counter.frame_count == 3  # 12 rows: the bucket of 16; 2 rows of 109: of (2, 128)
    assert list(sampler.buckets) == [(16, 64), (2, 128)]  # at most 2 kept: (8, 64) was freed
    # A batch that a kept bucket can hold runs in it: nothing allocated, nothing compiled.
    sampler.generate(PROMPTS[:3], eos_id=3, pad_id=PAD, max_new_tokens=12, greedy=True)
    assert counter.frame_count == 3 and list(sampler.buckets) == [(2, 128), (16, 64)]
    assert bucket(12, 70) == (16, 128) and bucket(8, 64) == (8, 64) and bucket(1, 1) == (1, 64)


@pytest.mark.parametrize("kind", ["static", "compiled"])
def test_the_buckets_kept_are_bounded_and_the_rest_freed(model, kind):
    """Many distinct shapes, each too big for the buckets kept: at most `max_buckets` stay, the
    others are freed (nothing, compiled code included, holds on to their buffers), and each holds
    what the module's docstring says."""
    sampler = static_sampler(model, kind)
    sampler.buckets.limit = 3
    freed = []
    for rows, max_new in [(1, 10), (2, 60), (3, 10), (5, 130), (9, 10), (17, 200), (33, 10)]:
        sampler.generate([[1, 5, 6]] * rows, eos_id=-1, pad_id=PAD, max_new_tokens=max_new,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert len(sampler.buckets) <= 3
        shape = bucket(rows, 3 + max_new)
        assert next(reversed(sampler.buckets)) == shape  # allocated and used last
        freed.append(weakref.ref(sampler.buckets[shape].mask))
    gc.collect()
    assert [ref() is None for ref in freed] == [True] * 4 + [False] * 3
    c = model.config
    layers, kv_heads = c.num_hidden_layers, c.num_key_value_heads
    head_dim = c.hidden_size // c.num_attention_heads
    for (rows, length), b in sampler.buckets.items():
        cache = 2 * layers * rows * kv_heads * head_dim * length * 4  # float32
        assert b.nbytes == cache + rows * length * 20 + rows * 25 + 5
    with pytest.raises(ValueError, match="max_buckets=0"):
        StaticSampler(model, compile=False, max_buckets=0)


@pytest.mark.parametrize("kind", ["static", "compiled"])
@pytest.mark.parametrize("greedy", [False, True])
def test_a_bigger_kept_bucket_samples_what_a_bucket_of_its_own_does(model, kind, greedy):
    """A generation served by a kept bucket with more rows and positions than its own draws the
    same noise for its rows, and samples the same tokens and log-probs, bit for bit."""
    eos = 3
    handle = add_eos_bias(model, eos)
    try:
        options = dict(eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, temperature=0.8,
                       greedy=greedy)  # fmt: skip

        def draw(sampler):
            generator = torch.Generator().manual_seed(3)
            first = sampler.generate(PROMPTS, generator=generator, **options)
            return first, sampler.generate(PROMPTS[:3], generator=generator, **options)

        reused = static_sampler(model, kind)
        reused.generate(PROMPTS * 4, eos_id=eos, pad_id=PAD, max_new_tokens=70)
        assert list(reused.buckets) == [(32, 128)]
        expected = draw(static_sampler(model, kind))
        assert draw(reused) == expected and list(reused.buckets) == [(32, 128)]
    finally:
        handle.remove()
    assert len({len(r) for r in expected[0].response_ids}) >= 3  # ends at different steps


@pytest.mark.slow
def test_inductor_compiled_greedy_responses_are_the_loops():
    """The decode step compiled for real (inductor's C++ on a CPU: ~20 s)."""
    model = tiny("qwen2")
    eos = greedy_eos(model, PROMPTS)
    sampler = StaticSampler(model, compile=True)
    expected = generate(model, PROMPTS, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW,
                        greedy=True)  # fmt: skip
    out = sampler.generate(PROMPTS, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True)
    assert_same(out, expected, tol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_auto_is_the_compiled_step_with_cuda_graphs_and_matches_the_loop():
    model = tiny("qwen2").cuda()
    sampler = sampler_for(model, "auto")
    assert isinstance(sampler, StaticSampler)
    eos = greedy_eos(model, PROMPTS)
    options = dict(eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW)
    expected = generate(model, PROMPTS, greedy=True, **options)
    for _ in range(3):  # compiles, records the CUDA graphs, replays them
        assert_same(sampler.generate(PROMPTS, greedy=True, **options), expected, tol=1e-4)

    def draw():
        generator = torch.Generator(device="cuda").manual_seed(0)
        return sampler.generate(PROMPTS * 4, generator=generator, **options)

    first = draw()
    assert draw() == first
    with torch.no_grad():
        trainer, _ = token_logprobs(model, PROMPTS * 4, first.response_ids, pad_id=PAD)
    for row, logps in enumerate(first.token_logps):
        assert logps == pytest.approx(trainer[row, : len(logps)].tolist(), abs=1e-4)


# ---------------------------------------------------------------------------- choosing the path


def test_auto_is_the_loop_on_a_cpu_and_static_samplers_are_kept_per_model(model):
    assert resolve_sampler(model, "auto") == "loop"
    assert isinstance(sampler_for(model, "auto"), LoopSampler)
    static = sampler_for(model, "static")
    assert sampler_for(model, "static") is static and static.model is model
    engine = BuiltinEngine(model, eos_id=3, pad_id=PAD, seed=0, sampler="static")
    assert engine.sampler is static


def test_a_model_without_a_plain_static_cache_is_refused_in_one_line():
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
        max_window_layers=0,
    ))  # fmt: skip
    assert resolve_sampler(model, "auto") == "loop"
    with pytest.raises(ConfigError, match="policy.sampler=compiled"):
        resolve_sampler(model, "compiled")


def test_the_setting_reaches_the_searchers_and_evaluation():
    config = load_config(None, ["policy.sampler=compiled"])
    model = tiny("llama")
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=PAD)
    engine = BuiltinEngine.start(model, tokenizer, seed=0, model_dir=None, policy=config.policy,
                                 settings=config.searchers.engine)  # fmt: skip
    assert engine.sampler is sampler_for(model, "compiled")  # kept on the model per kind
    assert EvalSettings.from_config(config).sampler == "compiled"
    assert load_config(None, []).policy.sampler == "auto"
    with pytest.raises(ConfigError, match="policy.sampler"):
        load_config(None, ["policy.sampler=fast"])


def test_the_builtin_engine_on_the_static_path_resumes_its_random_state(model):
    def engine(seed):
        return BuiltinEngine(model, eos_id=3, pad_id=PAD, seed=seed, sampler="static")

    first = engine(0)
    first.generate(PROMPTS, max_new_tokens=4, temperature=1.0)
    state = first.state_dict()
    after = first.generate(PROMPTS, max_new_tokens=8, temperature=1.0)
    again = engine(99)
    again.load_state_dict(state)
    assert again.generate(PROMPTS, max_new_tokens=8, temperature=1.0) == after


# ---------------------------------------------------------------------------- the loop


def sliding_window_model() -> torch.nn.Module:
    """A Qwen2 whose layers all attend over a window of 4 positions (Hugging Face keeps their
    caches in sliding-window layers, which the static path does not serve)."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
        max_window_layers=0, initializer_range=0.3,
    )).eval()  # fmt: skip


def test_a_preallocated_layer_writes_in_place_and_shows_the_filled_positions():
    keys, values = torch.zeros(3, 2, 6, 4), torch.zeros(3, 2, 6, 4)
    layer = PreallocatedLayer(keys, values, filled=2)
    assert layer.get_seq_length() == 2 and layer.get_mask_sizes(1) == (3, 0)
    new = torch.randn(3, 2, 1, 4)
    got_keys, got_values = layer.update(new, -new)
    assert got_keys.data_ptr() == keys.data_ptr() and got_keys.shape == (3, 2, 3, 4)
    assert torch.equal(keys[:, :, 2:3], new) and torch.equal(values[:, :, 2:3], -new)
    assert layer.get_seq_length() == 3 and layer.get_max_length() == 6
    # A row selection (Hugging Face's) selects the buffers' rows: later tokens land in them.
    layer.batch_select_indices(torch.tensor([2, 0]))
    layer.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert torch.equal(layer.keys[:, :, 2], new[[2, 0], :, 0]) and layer.keys[:, :, 3].eq(1).all()
    with pytest.raises(ValueError, match="6 positions cannot hold 7"):
        layer.update(torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))


def test_the_prefill_is_copied_into_a_cache_for_the_whole_generation(model):
    p = prefill(model, PROMPTS, PAD)
    rows = torch.tensor(p.rows)
    cache = preallocated_cache(p.cache, rows, p.width + MAX_NEW)
    for layer, source in zip(cache.layers, p.cache.layers, strict=True):
        assert isinstance(layer, PreallocatedLayer)
        assert layer.key_buffer.shape[:3] == (len(PROMPTS), source.keys.size(1), 9 + MAX_NEW)
        assert torch.equal(layer.keys, source.keys[rows])
        assert torch.equal(layer.values, source.values[rows])
    # Layers that keep other state than plain keys and values: the dynamic cache is kept.
    windowed = prefill(sliding_window_model(), PROMPTS, PAD)
    assert preallocated_cache(windowed.cache, rows, windowed.width + MAX_NEW) is None


@pytest.mark.parametrize("variant", [LoopVariant(preallocate=False),
                                     LoopVariant(last_logits_only=False)])  # fmt: skip
def test_the_loops_cache_and_prefill_change_nothing_it_generates(model, variant):
    """The preallocated cache and the prefill's last logits give the responses and log-probs of
    the dynamic cache and of logits everywhere, greedy and sampled from one seed."""
    eos = greedy_eos(model, PROMPTS)
    for options in (dict(greedy=True), dict(temperature=0.8)):
        ours, theirs = (generate(model, PROMPTS * 2, eos_id=eos, pad_id=PAD,
                                 max_new_tokens=MAX_NEW, generator=torch.Generator().manual_seed(2),
                                 variant=v, **options)
                        for v in (LoopVariant(), variant))  # fmt: skip
        assert_same(ours, theirs, tol=1e-6)


def test_a_sliding_window_model_generates_on_the_dynamic_cache():
    model = sliding_window_model()
    options = dict(eos_id=-1, pad_id=PAD, max_new_tokens=MAX_NEW, greedy=True)
    ours = generate(model, PROMPTS, **options)
    assert_same(ours, generate(model, PROMPTS, variant=LoopVariant(preallocate=False), **options))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "lora"])
def test_the_prefill_runs_the_output_head_at_the_last_position_only(arch):
    if arch == "gpt2":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2,
                                           n_head=2)).eval()  # fmt: skip
    else:
        model = tiny("llama")
    if arch == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert logits_keyword(model) == "logits_to_keep"
    positions = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, output: positions.append(output.size(1)))
    try:
        last = prefill(model, PROMPTS, PAD)
        everywhere = prefill(model, PROMPTS, PAD, last_logits_only=False)
    finally:
        handle.remove()
    assert positions == [1, 9]  # the longest of the distinct prompts: 9 tokens
    torch.testing.assert_close(last.logits, everywhere.logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", [LoopVariant(), LoopVariant(inverse_draw=False)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loops_sampled_log_probs_are_the_trainers(model, variant, temperature):
    """Both draws (tba's, and torch.multinomial's kept to measure against)."""
    eos = 3
    handle = add_eos_bias(model, eos)
    try:
        prompts = PROMPTS * 4
        out = LoopSampler(model, variant).generate(
            prompts, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW, temperature=temperature,
            generator=torch.Generator().manual_seed(0))  # fmt: skip
        with torch.no_grad():
            trainer, mask = token_logprobs(model, prompts, out.response_ids, pad_id=PAD,
                                           temperature=temperature)  # fmt: skip
    finally:
        handle.remove()
    assert len({len(r) for r in out.response_ids}) >= 4 and any(out.truncated)
    for row, response in enumerate(out.response_ids):
        assert len(out.token_logps[row]) == len(response) == int(mask[row].sum())
        assert out.token_logps[row] == pytest.approx(trainer[row, : len(response)].tolist(),
                                                     abs=1e-5)  # fmt: skip


def test_one_seed_draws_the_same_samples_on_the_loop_and_the_static_path(model):
    """One uniform number a row on both paths, for the generation's own rows (here 12 in a bucket
    of 16): the same samples, up to the rounding of the logits."""
    eos = 3
    handle = add_eos_bias(model, eos)
    try:
        prompts, samplers = PROMPTS * 2, (LoopSampler(model), static_sampler(model, "static"))
        loop, static = (sampler.generate(prompts, eos_id=eos, pad_id=PAD, max_new_tokens=MAX_NEW,
                                         temperature=0.8,
                                         generator=torch.Generator().manual_seed(4))
                        for sampler in samplers)  # fmt: skip
    finally:
        handle.remove()
    assert len({len(r) for r in loop.response_ids}) >= 3
    assert_same(static, loop)
