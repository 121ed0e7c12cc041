"""Micro-batches bounded by tokens (`train.micro_batch_tokens`) and their rows packed end to end:
the same log-probs and the same gradients as padded rows, for every objective, with LoRA, the
chunked and the plain log-probs, context samples and gradient checkpointing; the budget's cut
at group boundaries; the padded share of a step (`padded_frac`); padded rows for a model that
does not keep packed rows apart."""

from __future__ import annotations

import random

import pytest
import torch
from test_chunked_logprobs import MODELS, PROMPTS, RESPONSES
from transformers.models.llama import modeling_llama

from tba import trainer as trainer_module
from tba.config import LoraConfig, TrainConfig
from tba.core import Sample
from tba.objectives import OBJECTIVES
from tba.policy import chunked_logprobs
from tba.policy import logprobs as logprobs_module
from tba.policy.batching import first_fit_decreasing, pack_rows, padded_positions
from tba.policy.logprobs import packs_rows, token_logprobs_and_states
from tba.policy.micro_batches import micro_batch_runs
from tba.policy.model import add_lora, build_tiny_llama, disable_dropout, enable_checkpointing
from tba.trainer import Trainer

VOCAB = 40
# Each group's response lengths: mixed, so that padded rows are mostly padding.
LENGTHS = [[1, 9, 3, 14], [6, 2, 11, 4], [20, 5, 1, 8]]


def mixed_batch(seed: int = 0) -> list[list[Sample]]:
    """Groups of K = 4 responses of very different lengths after prompts of 2 to 4 tokens, with
    everything any objective reads: per-token behaviour and reference log-probs, and VinePPO's
    steps with their Monte Carlo values."""
    rng = random.Random(seed)
    groups = []
    for prompt_id, lengths in enumerate(LENGTHS):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(1 + prompt_id)]
        group = []
        for length in lengths:
            behaviour = [-rng.uniform(1, 4) for _ in range(length)]
            reference = [-rng.uniform(1, 4) for _ in range(length)]
            ends = sorted({max(1, length // 2), length})
            group.append(Sample(
                prompt_id, prompt, [rng.randrange(3, VOCAB) for _ in range(length)],
                reward=rng.random(), ref_logp=sum(reference), behaviour_logp=sum(behaviour),
                version=0, behaviour_token_logps=behaviour, ref_token_logps=reference,
                step_ends=ends, step_values=[rng.random() for _ in ends],
            ))  # fmt: skip
        groups.append(group)
    return groups


def tiny_llama():
    return build_tiny_llama(VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            hidden_size=32, num_layers=2, num_heads=2, seed=0)  # fmt: skip


# Every objective of the registry, each trust region of TB and its learned log Z, PPO's critic
# as a head and as a separate LM.
CASES = {
    **{f"tb-{level}": {"tb": {"trust_region": level}} for level in ("sequence", "token", "none")},
    "tb-learned_log_z": {"tb": {"log_z": "learned"}},
    **{name: {"loss": name} for name in OBJECTIVES if name not in ("tb", "ppo")},
    "ppo-head": {"loss": "ppo"},
    "ppo-critic": {"loss": "ppo", "ppo": {"value_model": "critic"}},
}


def test_the_cases_cover_every_objective():
    assert {case.get("loss", "tb") for case in CASES.values()} == set(OBJECTIVES)


def stepped(settings: dict, budget: int | None, *, lora: bool = False,
            context: bool = False) -> tuple[Trainer, dict[str, float]]:  # fmt: skip
    """A trainer on the tiny Llama after one step on `mixed_batch`, with or without a token
    budget (one that holds the whole batch: the same single micro-batch either way)."""
    model = tiny_llama()
    if lora:
        model = add_lora(model, LoraConfig(r=4))
        for name, param in model.named_parameters():  # adapters that change the outputs
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(1))
    config = TrainConfig(learning_rate=1e-3, max_grad_norm=1e6, micro_batch_tokens=budget,
                         **settings)  # fmt: skip
    trainer = Trainer(model.train(), config, pad_id=0, temperature=0.9)
    if "critic" in trainer.providers:  # a head whose gradient reaches the policy's states
        with torch.no_grad():
            trainer.providers["critic"].critic.head.weight.fill_(0.05)
            trainer.providers["critic"].critic.head.bias.fill_(0.1)
    groups = mixed_batch()
    if context:  # each group's first two trained, the others in its statistics only
        stats = trainer.step([g[:2] for g in groups], beta=0.1, context=[g[2:] for g in groups])
    else:
        stats = trainer.step(groups, beta=0.1)
    return trainer, stats


def gradients(trainer: Trainer) -> list[torch.Tensor]:
    """Every gradient the step left: the policy's, then its needs' providers' (a learned log
    Z's, the critic's)."""
    params = list(trainer.model.parameters())
    for provider in trainer.providers.values():
        params += [p for group in provider.groups for p in group["params"]
                   if p not in set(params)]  # fmt: skip
    return [p.grad for p in params if p.grad is not None]


def assert_same_step(padded: tuple[Trainer, dict], packed: tuple[Trainer, dict]) -> None:
    (a, stats_a), (b, stats_b) = padded, packed
    grads_a, grads_b = gradients(a), gradients(b)
    assert len(grads_a) == len(grads_b) and any(g.abs().max() > 0 for g in grads_a)
    for got, want in zip(grads_b, grads_a):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    for key in stats_a.keys() - {"train_seconds", "train_tokens_per_s", "padded_frac"}:
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    # The packed step ran far fewer padding positions.
    assert stats_b["padded_frac"] < stats_a["padded_frac"] / 2


@pytest.fixture
def packed_calls(monkeypatch) -> list[int]:
    """How many rows each packed forward pass ran."""
    calls: list[int] = []
    packed = logprobs_module.packed_token_logprobs_and_states

    def counted(model, prompts, responses, **kwargs):
        calls.append(len(prompts))
        return packed(model, prompts, responses, **kwargs)

    monkeypatch.setattr(logprobs_module, "packed_token_logprobs_and_states", counted)
    return calls


@pytest.mark.parametrize("case", CASES)
def test_packed_rows_give_every_objective_the_padded_gradient(case, packed_calls):
    padded = stepped(CASES[case], None)
    assert packed_calls == []
    packed = stepped(CASES[case], 10_000)
    assert packed_calls == [12]  # the whole batch, packed
    assert_same_step(padded, packed)


def test_packed_rows_give_lora_adapters_the_padded_gradient(packed_calls):
    padded, packed = stepped({}, None, lora=True), stepped({}, 10_000, lora=True)
    assert packed_calls == [12]
    assert_same_step(padded, packed)


def test_the_plain_full_logits_computation_packs_alike(monkeypatch, packed_calls):
    monkeypatch.setattr(logprobs_module, "output_layer", lambda model: None)
    assert_same_step(stepped({"loss": "grpo"}, None), stepped({"loss": "grpo"}, 10_000))
    assert packed_calls == [12]


def test_chunked_log_probs_in_many_blocks_pack_alike(monkeypatch, packed_calls):
    """Blocks of 8 tokens x 16 vocabulary entries: every row of logits spans several."""
    monkeypatch.setitem(chunked_logprobs.BLOCK_VOCAB, "cpu", 16)
    monkeypatch.setitem(chunked_logprobs.BLOCK_ELEMENTS, "cpu", 8 * 16)
    assert_same_step(stepped({}, None), stepped({}, 10_000))
    assert packed_calls == [12]


def test_context_samples_are_packed_with_their_groups(packed_calls):
    settings = {"group_baseline": "generation", "samples_per_prompt": 4, "group_size": 2}
    padded = stepped(settings, None, context=True)
    packed = stepped(settings, 10_000, context=True)
    assert packed_calls == [6, 6]  # the trained rows, then (without gradient) the context
    assert_same_step(padded, packed)


def test_context_samples_go_with_their_groups_into_each_micro_batch(monkeypatch):
    """A budget that cuts the batch into one group a micro-batch: each micro-batch gets its
    groups' context samples, and the gradient is the whole batch's (TB: a mean over rows)."""
    seen = []
    loss = Trainer._loss

    def spied(self, trained, beta, context):
        seen.append(({s.prompt_id for s in trained}, {s.prompt_id for s in context}))
        return loss(self, trained, beta, context)

    monkeypatch.setattr(Trainer, "_loss", spied)
    settings = {"group_baseline": "generation", "samples_per_prompt": 4, "group_size": 2}
    whole = stepped(settings, None, context=True)
    split = stepped(settings, 25, context=True)
    assert seen == [({0, 1, 2}, {0, 1, 2}), ({0}, {0}), ({1}, {1}), ({2}, {2})]
    for got, want in zip(gradients(split[0]), gradients(whole[0])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_packed_log_probs_and_states_equal_the_padded_ones(name):
    """float64, temperature 0.9, Llama, Qwen2 and GPT-2 (absolute positions), tied and untied
    output layers, LoRA; with and without checkpointed layers."""
    torch.manual_seed(0)
    model = MODELS[name]().double().train()
    disable_dropout(model)
    assert packs_rows(model)
    for checkpointing in (False, True):
        if checkpointing:
            enable_checkpointing(model)
        padded = token_logprobs_and_states(model, PROMPTS, RESPONSES, pad_id=0, temperature=0.9)
        packed = token_logprobs_and_states(model, PROMPTS, RESPONSES, pad_id=0, temperature=0.9,
                                           packed=True)  # fmt: skip
        assert torch.equal(packed[1], padded[1])
        mask = padded[1].bool()
        torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(packed[2][mask], padded[2][mask], rtol=0, atol=1e-6)
        assert bool((packed[0][~mask] == 0).all()) and bool((packed[2][~mask] == 0).all())


def causal_only_attention(module, query, key, value, attention_mask, **kwargs):
    """Llama's eager attention under a plain causal mask, whatever mask it is given: a model
    whose attention does not keep packed rows apart."""
    queries, keys = query.size(-2), key.size(-2)
    allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    causal = torch.zeros(queries, keys, dtype=query.dtype).masked_fill(~allowed, -torch.inf)
    return EAGER(module, query, key, value, causal[None, None], **kwargs)


EAGER = modeling_llama.eager_attention_forward


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["llama-tied", "qwen2-tied", "gpt2", "llama-lora"])
def test_which_models_keep_packed_rows_apart(name, attention, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]()
    disable_dropout(model)
    model.set_attn_implementation(attention)
    assert packs_rows(model) and packs_rows(model.to(torch.bfloat16))
    if name.startswith("llama") and attention == "eager":
        monkeypatch.setattr(modeling_llama, "eager_attention_forward", causal_only_attention)
        assert not packs_rows(model)
    if name == "gpt2":  # GPT-2's dropout draws other masks in each pass: padded rows
        assert not packs_rows(MODELS[name]().train())


def test_a_model_that_does_not_pack_keeps_padded_rows(monkeypatch, packed_calls):
    """Under a token budget, a policy that does not keep packed rows apart runs padded rows:
    the same step as without the budget."""
    monkeypatch.setattr(trainer_module, "packs_rows", lambda model: False)
    (padded, stats), (budgeted, budgeted_stats) = stepped({}, None), stepped({}, 10_000)
    assert packed_calls == [] and budgeted._packing is False
    assert budgeted_stats["padded_frac"] == stats["padded_frac"]
    for got, want in zip(gradients(budgeted), gradients(padded)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_with_checkpointing_packed_rows_give_the_padded_gradient(monkeypatch, packed_calls):
    """Checkpointed, padded rows run each response with its prompt: packing always runs fewer
    positions then, and the gradient is the same."""
    monkeypatch.setattr(trainer_module, "checkpointing_choice",
                        lambda *args, **kwargs: (True, "checkpointing on"))  # fmt: skip
    padded, packed = stepped({}, None), stepped({}, 10_000)
    assert packed_calls == [12]
    assert padded[1]["checkpointing"] == packed[1]["checkpointing"] == 1.0
    assert padded[0].checkpointing_note == "checkpointing on"
    assert_same_step(padded, packed)


# ----------------------------------------------------------------- micro-batches of a budget


def group_tokens(group: list[Sample]) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in group)


def test_a_budget_cuts_the_batch_between_whole_groups():
    groups = mixed_batch() * 2  # 6 groups of 35, 35 and 50 tokens
    sizes = [group_tokens(g) for g in groups]
    assert sizes == [35, 35, 50] * 2
    assert micro_batch_runs(groups, None) == [slice(0, 6)]
    assert micro_batch_runs(groups, 4) == [slice(0, 4), slice(4, 6)]
    assert micro_batch_runs(groups, None, 80) == [slice(0, 2), slice(2, 3), slice(3, 5),
                                                  slice(5, 6)]  # fmt: skip
    assert micro_batch_runs(groups, None, 120) == [slice(0, 3), slice(3, 6)]
    # Both bounds hold; a group over the budget is a micro-batch alone.
    assert micro_batch_runs(groups, 2, 120) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert micro_batch_runs(groups, None, 10) == [slice(i, i + 1) for i in range(6)]
    assert micro_batch_runs([], 2, 10) == []


def test_a_budget_of_micro_batches_gives_the_whole_batchs_tb_gradient(packed_calls):
    """TB's loss is a mean over rows of group terms: split between whole groups, the gradient
    accumulated is the whole batch's."""
    whole, split = stepped({}, None), stepped({}, 40)
    assert packed_calls == [4, 4, 4]  # one group a micro-batch
    for got, want in zip(gradients(split[0]), gradients(whole[0])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------- the padded share


def test_padded_frac_counts_the_positions_run_that_held_no_token():
    """One prompt of 2 tokens, responses of 1 and 3: padded, the prompt runs once and the
    responses as 2 rows of 3 (8 positions, 6 real); packed, 2 rows of 5 hold 3 + 5 tokens."""
    group = [Sample(0, [1, 5], [7] * n, reward=float(n), ref_logp=-3.0, behaviour_logp=-3.0,
                    version=0, behaviour_token_logps=[-1.0] * n) for n in (1, 3)]  # fmt: skip
    padded = Trainer(tiny_llama(), TrainConfig(learning_rate=1e-3), pad_id=0, temperature=1.0)
    assert padded.step([group], beta=0.1)["padded_frac"] == pytest.approx(2 / 8)
    assert padded_positions([[1, 5]] * 2, [[7], [7] * 3], share_prompts=True) == 8
    rows = pack_rows([[1, 5]] * 2, [[7], [7] * 3], pad_id=0)
    assert rows.positions == 10 and rows.ids.tolist() == [[1, 5, 7, 7, 7], [1, 5, 7, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert rows.predicting.tolist() == [6, 1, 2, 3]  # row 0 is in the second packed row


def test_first_fit_decreasing_fills_rows_as_long_as_the_longest():
    bins = first_fit_decreasing([5, 1, 3, 2, 4, 5])
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert len(bins) == 4 and all(sum([5, 1, 3, 2, 4, 5][i] for i in b) <= 5 for b in bins)
