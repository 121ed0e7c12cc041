"""The policy layer: character tokenizer, batched KV-cache sampling, sequence log-probs, weights."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tba.policy.logprobs import sequence_logprobs, token_logprobs
from tba.policy.model import frozen_copy, get_weights, load_model, set_weights
from tba.policy.sampling import generate

TEXT = "Ann has 12 pens , gets 7 more.\n12+7=19\n#### 19 ?"
PROMPT_TEXTS = [
    "Ann has 3 pens.\n",
    "Bob?\n",
    "Cy has 12 bags of 4 eggs. How many eggs?\n",
    "x\n",
    "12+7=19\n",
]
MAX_NEW = 12


@pytest.fixture
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


@pytest.fixture
def eos_prone_model(tiny_model, tokenizer):
    """The tiny policy with +2.5 added to the EOS logit, so that sampled responses of a few
    tokens end with EOS while others run into `max_new_tokens`. The hook is part of the model's
    forward, so sampling and `sequence_logprobs` see the same distribution."""
    model = copy.deepcopy(tiny_model)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 2.5
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return model


def sample(model, prompts, tokenizer, *, seed=0, temperature=1.0, max_new_tokens=MAX_NEW):
    return generate(
        model,
        prompts,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )


def reference_logprob(model64, prompt, response, temperature):
    """log pi(response | prompt) in float64: the model on the unpadded sequence alone, then a
    plain loop over response tokens (EOS included)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0].double()
    total = 0.0
    for offset, token in enumerate(response):
        position = len(prompt) - 1 + offset  # the logits at this position predict `token`
        total += torch.log_softmax(logits[position] / temperature, dim=-1)[token].item()
    return total


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_newlines_digits_hashes_and_spaces(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_tokenizer_is_one_token_per_character(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) == len(TEXT) + 1  # + BOS
    assert tokenizer.unk_token_id not in ids


def test_tokenizer_prepends_bos(tokenizer):
    ids = tokenizer("12+7")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_tokenizer_special_ids_are_distinct(tokenizer):
    specials = [
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ]
    assert len(set(specials)) == 4
    assert tokenizer.eos_token_id not in tokenizer(TEXT)["input_ids"]


def test_tokenizer_reloads_from_save_pretrained(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert reloaded.pad_token_id == tokenizer.pad_token_id
    assert reloaded.padding_side == "left"


def test_tokenizer_pads_on_the_left(tokenizer):
    batch = tokenizer(["ab", "abcd"], padding=True)
    pad, bos = tokenizer.pad_token_id, tokenizer.bos_token_id
    assert batch["input_ids"][0][:3] == [pad, pad, bos]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1]
    assert batch["attention_mask"][1] == [1, 1, 1, 1, 1]


# ---------------------------------------------------------------------------- generate


def test_generate_returns_one_response_per_prompt(tiny_model, tokenizer, prompts):
    out = sample(tiny_model, prompts, tokenizer)
    assert len(out.response_ids) == len(out.logps) == len(out.truncated) == len(prompts)
    assert all(1 <= len(r) <= MAX_NEW for r in out.response_ids)


def test_generate_ends_with_eos_exactly_when_not_truncated(eos_prone_model, tokenizer, prompts):
    out = sample(eos_prone_model, prompts * 3, tokenizer)
    eos = tokenizer.eos_token_id
    assert any(out.truncated) and not all(out.truncated)  # the fixture gives both kinds
    for response, truncated in zip(out.response_ids, out.truncated, strict=True):
        assert eos not in response[:-1]
        if truncated:
            assert len(response) == MAX_NEW
            assert response[-1] != eos
        else:
            assert response[-1] == eos


def test_generate_greedy_batch_equals_each_prompt_alone(tiny_model, tokenizer, prompts):
    def greedy(batch):
        return generate(
            tiny_model,
            batch,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            max_new_tokens=MAX_NEW,
            greedy=True,
        )

    batched = greedy(prompts)
    for i, prompt in enumerate(prompts):
        alone = greedy([prompt])
        assert batched.response_ids[i] == alone.response_ids[0]
        assert batched.logps[i] == pytest.approx(alone.logps[0], abs=1e-4)


def test_generate_sampling_is_reproducible_with_a_seeded_generator(
    eos_prone_model, tokenizer, prompts
):
    first = sample(eos_prone_model, prompts, tokenizer, seed=7)
    second = sample(eos_prone_model, prompts, tokenizer, seed=7)
    assert first == second


def test_generate_restores_training_mode(tiny_model, tokenizer, prompts):
    tiny_model.train()
    sample(tiny_model, prompts, tokenizer, max_new_tokens=2)
    assert tiny_model.training


def test_kv_cache_is_passed_without_deprecation_warnings(tiny_model, tokenizer, prompts):
    """transformers renamed `past_key_values` to `cache`; neither sampling nor log-probs may
    warn about it on any version we support."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sample(tiny_model, prompts, tokenizer, max_new_tokens=3)
        sequence_logprobs(tiny_model, prompts, out.response_ids, pad_id=tokenizer.pad_token_id)
    deprecations = [str(w.message) for w in caught
                    if issubclass(w.category, FutureWarning | DeprecationWarning)]  # fmt: skip
    assert not [m for m in deprecations if "past_key_values" in m or "cache" in m], deprecations


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_behaviour_logps_equal_sequence_logprobs(eos_prone_model, tokenizer, prompts, temperature):
    """Both sum log_softmax(logits / T) over every response token, EOS included."""
    out = sample(eos_prone_model, prompts * 2, tokenizer, temperature=temperature)
    assert not all(out.truncated)  # some responses end with EOS, so EOS is counted
    with torch.no_grad():
        scored = sequence_logprobs(
            eos_prone_model,
            prompts * 2,
            out.response_ids,
            pad_id=tokenizer.pad_token_id,
            temperature=temperature,
        )
    np.testing.assert_allclose(scored.numpy(), np.array(out.logps), rtol=0, atol=1e-4)


def test_behaviour_token_logps_equal_token_logprobs(eos_prone_model, tokenizer, prompts):
    out = sample(eos_prone_model, prompts * 2, tokenizer, temperature=0.8)
    with torch.no_grad():
        scored, mask = token_logprobs(
            eos_prone_model, prompts * 2, out.response_ids, pad_id=tokenizer.pad_token_id,
            temperature=0.8,
        )  # fmt: skip
    for row, (behaviour, total) in enumerate(zip(out.token_logps, out.logps)):
        assert len(behaviour) == len(out.response_ids[row]) == int(mask[row].sum())
        np.testing.assert_allclose(scored[row, : len(behaviour)], behaviour, rtol=0, atol=1e-4)
        assert sum(behaviour) == pytest.approx(total, abs=1e-4)
    assert float((scored * (1 - mask)).abs().sum()) == 0.0  # padding holds zeros


# ---------------------------------------------------------------------------- sequence_logprobs


def some_responses(tokenizer):
    eos = tokenizer.eos_token_id
    return [
        tokenizer("12+7=19", add_special_tokens=False)["input_ids"] + [eos],
        [eos],
        tokenizer("#### 5 pens and more text", add_special_tokens=False)["input_ids"],
        tokenizer("3*4", add_special_tokens=False)["input_ids"],
        tokenizer("a\nb", add_special_tokens=False)["input_ids"] + [eos],
    ]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sequence_logprobs_match_a_float64_per_token_loop(
    tiny_model, tokenizer, prompts, temperature
):
    responses = some_responses(tokenizer)
    with torch.no_grad():
        batched = sequence_logprobs(
            tiny_model, prompts, responses, pad_id=tokenizer.pad_token_id, temperature=temperature
        )
    model64 = copy.deepcopy(tiny_model).double()
    pairs = zip(prompts, responses, strict=True)
    expected = [reference_logprob(model64, p, r, temperature) for p, r in pairs]
    assert batched.dtype == torch.float32
    assert batched.shape == (len(prompts),)
    np.testing.assert_allclose(batched.numpy(), np.array(expected), rtol=0, atol=1e-4)


def test_sequence_logprobs_do_not_depend_on_batch_padding(tiny_model, tokenizer, prompts):
    responses = some_responses(tokenizer)
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        batched = sequence_logprobs(tiny_model, prompts, responses, pad_id=pad)
        alone = [
            sequence_logprobs(tiny_model, [p], [r], pad_id=pad).item()
            for p, r in zip(prompts, responses, strict=True)
        ]
    np.testing.assert_allclose(batched.numpy(), np.array(alone), rtol=0, atol=1e-5)


def test_sequence_logprobs_are_differentiable(tiny_model, tokenizer, prompts):
    tiny_model.train()
    logps = sequence_logprobs(
        tiny_model, prompts, some_responses(tokenizer), pad_id=tokenizer.pad_token_id
    )
    assert logps.requires_grad
    logps.sum().backward()
    grads = [p.grad for p in tiny_model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert tiny_model.lm_head.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- weights


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_get_weights_returns_numpy_arrays(tiny_model):
    weights = get_weights(tiny_model)
    assert set(weights) == set(tiny_model.state_dict())
    assert all(isinstance(array, np.ndarray) for array in weights.values())


def test_set_weights_round_trips_get_weights(tiny_model, tokenizer, prompts):
    source = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    weights = {name: array.copy() for name, array in get_weights(source).items()}
    set_weights(tiny_model, weights)
    for name, array in get_weights(tiny_model).items():
        np.testing.assert_array_equal(array, weights[name])
    torch.testing.assert_close(logits_of(tiny_model, prompts[2]), logits_of(source, prompts[2]))


def test_frozen_copy_has_no_grad_and_equal_outputs(tiny_model, prompts):
    frozen = frozen_copy(tiny_model)
    assert not frozen.training
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in tiny_model.parameters())
    torch.testing.assert_close(logits_of(frozen, prompts[2]), logits_of(tiny_model, prompts[2]))


def test_frozen_copy_is_independent_of_the_original(tiny_model):
    frozen = frozen_copy(tiny_model)
    before = frozen.lm_head.weight.clone()
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(1.0)
    torch.testing.assert_close(frozen.lm_head.weight, before)


def test_save_pretrained_then_load_model_gives_equal_logits(tiny_model, prompts, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.device("cpu")).eval()
    assert next(loaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(logits_of(loaded, prompts[2]), logits_of(tiny_model, prompts[2]))
