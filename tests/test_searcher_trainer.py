"""Searcher and trainer as components: what a generation produces, and what one step does."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from pydantic import Field

from tba.config import RunConfig, TrainConfig
from tba.core import Sample
from tba.objectives import OBJECTIVES, LossInputs, Needs, Objective
from tba.policy.logprobs import sequence_logprobs, token_logprobs
from tba.policy.model import build_tiny_llama, frozen_copy
from tba.searcher import PromptStream, Searcher
from tba.section import Section
from tba.trainer import Trainer

ROWS = [{"prompt": f"Q{i}\n", "answer": str(i)} for i in range(5)]


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def train(learning_rate: float = 1e-3, **settings) -> TrainConfig:
    """The config's `train` section with `settings`; a `learning_rate` of 0 (a step's gradient
    without its update, which a run's config refuses) is set past its validation."""
    return TrainConfig(**settings).model_copy(update={"learning_rate": learning_rate})


def small_run(policy: dict | None = None, searchers: dict | None = None, **train) -> RunConfig:
    """A run's config as the searchers here read it: groups of 3 responses of up to 6 tokens,
    and `policy`, `searchers` and `train` settings."""
    return RunConfig(policy={"max_new_tokens": 6, **(policy or {})}, searchers=searchers or {},
                     train={"group_size": 3, **train})  # fmt: skip


def test_prompt_stream_covers_every_row_once_per_pass():
    stream = PromptStream(5, seed=0)
    first, second = stream.take(5), stream.take(5)
    assert sorted(first) == sorted(second) == list(range(5))
    assert PromptStream(5, seed=1).take(5) != first or PromptStream(5, seed=2).take(5) != first


def test_generate_tags_samples_and_matches_reference_at_version_zero(tiny_model, tokenizer):
    searcher = Searcher(tiny_model, tokenizer, ROWS, [always_one], small_run(truncated="penalize"),
                        seed=0)  # fmt: skip
    samples, stats = searcher.generate(num_prompts=2)
    assert len(samples) == 2 * 3
    assert len({s.prompt_id for s in samples}) == 2
    assert all(s.version == 0 and s.searcher_id == 0 for s in samples)
    for s in samples:
        assert s.prompt_ids == tokenizer(ROWS[s.prompt_id]["prompt"])["input_ids"]
        # Policy and reference are the same weights before any sync.
        assert s.ref_logp == pytest.approx(s.behaviour_logp, abs=1e-4)
        if s.truncated:
            assert s.reward == -1.0 and len(s.response_ids) == 6
        else:
            assert s.reward == 1.0 and s.response_ids[-1] == tokenizer.eos_token_id
    assert stats["gen_tokens"] == sum(len(s.response_ids) for s in samples)


def test_reference_scoring_never_exceeds_the_trainers_micro_batch(tiny_model, tokenizer,
                                                                  monkeypatch):  # fmt: skip
    """With `train.micro_batch_groups` = 1 (groups of 3), the searcher scores the reference in
    passes of 3 samples, and gets what one pass over the whole batch gets."""
    import tba.searcher

    sizes: list[int] = []

    def counted(model, prompts, responses, **kwargs):
        sizes.append(len(prompts))
        return token_logprobs(model, prompts, responses, **kwargs)

    monkeypatch.setattr(tba.searcher, "token_logprobs", counted)
    passes = {}
    for score_batch, micro_batch_groups in ((None, None), (3, 1)):
        # PPO's objective needs each token's reference log-prob: they are scored alike.
        scoring = small_run(loss="ppo", micro_batch_groups=micro_batch_groups)
        searcher = Searcher(tiny_model, tokenizer, ROWS, [always_one], scoring, seed=0)
        assert searcher.score_batch == score_batch and searcher.token_ref_logps
        sizes.clear()
        samples, _ = searcher.generate(num_prompts=4)
        passes[score_batch] = (list(sizes), samples)
    assert passes[None][0] == [12] and passes[3][0] == [3, 3, 3, 3]
    for whole, parted in zip(passes[None][1], passes[3][1]):
        assert parted.ref_logp == pytest.approx(whole.ref_logp, abs=1e-5)
        assert parted.ref_token_logps == pytest.approx(whole.ref_token_logps, abs=1e-5)


def test_an_exploration_temperature_changes_the_sampler_not_the_reference(tiny_model, tokenizer):
    searcher = Searcher(
        tiny_model, tokenizer, ROWS, [always_one], small_run(searchers={"temperature": 2.0}),
        seed=0,
    )
    samples, _ = searcher.generate(num_prompts=2)
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    pad = tokenizer.pad_token_id
    at_one = sequence_logprobs(tiny_model, prompts, responses, pad_id=pad, temperature=1.0)
    at_two = sequence_logprobs(tiny_model, prompts, responses, pad_id=pad, temperature=2.0)
    # TB's target uses pi_ref at the policy's temperature; the behaviour log-prob is the sampler's.
    assert [s.ref_logp for s in samples] == pytest.approx(at_one.tolist(), abs=1e-4)
    assert [s.behaviour_logp for s in samples] == pytest.approx(at_two.tolist(), abs=1e-4)
    assert not torch.allclose(at_one, at_two)


def test_truncated_responses_can_be_dropped(tiny_model, tokenizer):
    searcher = Searcher(
        tiny_model, tokenizer, ROWS, [always_one],
        small_run(policy={"max_new_tokens": 1}, truncated="drop"),
    )
    samples, stats = searcher.generate(num_prompts=2)
    assert all(not s.truncated for s in samples)
    assert stats["dropped"] == 6 - len(samples)


def test_new_weights_change_the_version_and_the_policy(tiny_model, tokenizer):
    searcher = Searcher(tiny_model, tokenizer, ROWS, [always_one], small_run(truncated="penalize"))
    weights = {k: v * 0.5 for k, v in searcher.policy.state_dict().items()}
    searcher.set_weights({k: v.numpy() for k, v in weights.items()}, version=3, step=3)
    samples, _ = searcher.generate(num_prompts=1)
    assert all(s.version == 3 for s in samples)
    assert any(abs(s.ref_logp - s.behaviour_logp) > 1e-3 for s in samples)


@pytest.mark.parametrize("trust_region", ["sequence", "token", "none"])
def test_one_tb_step_raises_the_rewarded_response(tiny_model, tokenizer, trust_region):
    prompt = tokenizer("Q\n")["input_ids"]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["12", "34", "56"]]
    with torch.no_grad():
        before = sequence_logprobs(tiny_model, [prompt] * 3, responses, pad_id=0)
        tokens, _ = token_logprobs(tiny_model, [prompt] * 3, responses, pad_id=0)
    group = [
        Sample(7, prompt, r, reward=float(i == 0), ref_logp=float(lp), behaviour_logp=float(lp),
               behaviour_token_logps=tokens[i, : len(r)].tolist(), version=0)
        for i, (r, lp) in enumerate(zip(responses, before))
    ]  # fmt: skip
    trainer = Trainer(tiny_model, train(tb={"trust_region": trust_region}),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    metrics = trainer.step([group], beta=0.5)
    with torch.no_grad():
        after = sequence_logprobs(tiny_model, [prompt] * 3, responses, pad_id=0)
    change = after - before
    assert change[0] > change[1] and change[0] > change[2]
    assert metrics["loss"] > 0 and trainer.step_count == 1


@pytest.mark.parametrize("trust_region", ["sequence", "none"])
def test_micro_batches_give_the_same_gradient(tokenizer, trust_region):
    def model():
        return build_tiny_llama(
            len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2,
            hidden_size=32, num_layers=1, num_heads=2, seed=0,
        )  # fmt: skip

    prompt_a, prompt_b = tokenizer("A\n")["input_ids"], tokenizer("BB\n")["input_ids"]
    groups = [
        [Sample(pid, p, tokenizer(t, add_special_tokens=False)["input_ids"], reward=r,
                ref_logp=-3.0, behaviour_logp=-3.0, behaviour_token_logps=[-3.0 / len(t)] * len(t),
                version=0)
         for t, r in [("1", 1.0), ("22", 0.0), ("3", 0.5)]]
        for pid, p in [(0, prompt_a), (1, prompt_b)]
    ]  # fmt: skip
    grads = []
    for micro in (None, 1):
        trainer = Trainer(
            model(), train(0.0, max_grad_norm=1e9, micro_batch_groups=micro,
                           tb={"trust_region": trust_region}), pad_id=0, temperature=1.0,
        )  # fmt: skip
        trainer.step(groups, beta=0.1)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss", ["tb", "dr_grpo", "grpo", "rloo", "proximal_rloo", "online_dpo"])
def test_every_loss_trains_on_searcher_samples(tiny_model, tokenizer, loss):
    searcher = Searcher(frozen_copy(tiny_model), tokenizer, ROWS, [always_one],
                        small_run(truncated="penalize"))  # fmt: skip
    samples, _ = searcher.generate(num_prompts=2)
    for i, s in enumerate(samples):
        s.reward = float(i % 3)  # distinct rewards in every group (a random policy rarely stops)
    groups = [[s for s in samples if s.prompt_id == pid] for pid in {s.prompt_id for s in samples}]
    trainer = Trainer(tiny_model, train(1e-2, loss=loss), pad_id=tokenizer.pad_token_id,
                      temperature=1.0)  # fmt: skip
    before = [p.detach().clone() for p in tiny_model.parameters()]
    metrics = trainer.step(groups, beta=0.1)
    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))


def by_prompt(samples: list[Sample]) -> list[list[Sample]]:
    return [[s for s in samples if s.prompt_id == p] for p in dict.fromkeys(
        s.prompt_id for s in samples)]  # fmt: skip


@pytest.mark.parametrize("loss", list(OBJECTIVES))
def test_each_objective_is_given_exactly_what_its_needs_ask_for(tiny_model, tokenizer, loss,
                                                                monkeypatch):  # fmt: skip
    """The searchers and the trainer read the registry's `Needs`, not the name: every objective
    gets what its needs ask for and nothing it does not (each setting its needs read is set)."""
    objective = OBJECTIVES[loss]
    needs = objective.needs
    given: list[LossInputs] = []

    def spy(x: LossInputs):
        given.append(x)
        return objective(x)

    monkeypatch.setitem(OBJECTIVES, loss, Objective(spy, needs, objective.settings))
    sections = {}
    if needs.learned_log_z:
        sections["tb"] = {"log_z": "learned"}
    if needs.step_values:
        sections["vineppo"] = {"rollouts": 2, "delimiter": "1"}
    config = small_run(loss=loss, **sections)
    searcher = Searcher(frozen_copy(tiny_model), tokenizer, ROWS, [always_one], config, seed=0)
    samples, _ = searcher.generate(num_prompts=2)
    for i, s in enumerate(samples):
        s.reward = float(i % 3)
    assert [s.ref_token_logps is not None for s in samples] == [needs.token_ref_logp] * 6
    assert [s.step_values is not None for s in samples] == [needs.step_values] * 6
    trainer = Trainer(frozen_copy(tiny_model).requires_grad_(True), config.train,
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    metrics = trainer.step(by_prompt(samples), beta=0.1)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    (x,) = given
    assert x.settings is config.train and x.samples == samples
    assert (x.values is not None) == ("critic" in trainer.providers) == needs.critic
    assert ("value_grad_norm" in metrics) == needs.critic
    assert (x.ref_token_logp is not None) == needs.token_ref_logp
    assert (x.log_z is not None) == ("learned_log_z" in trainer.providers) == needs.learned_log_z
    # Beside the policy's optimizer state, a checkpoint keeps its needs' providers' tensors alone,
    # each under its provider's key.
    state = trainer.state_dict()
    parts = {key.split(".")[0] for key in state["optimizer"]} - {"master", "kahan"}
    assert {part for part in parts if not part.isdigit()} == {
        provider.key for provider in trainer.providers.values() if provider.state_tensors()}
    # Context samples join their groups' statistics only where the objective has them.
    group = by_prompt(samples)[0]
    if needs.group_statistics:
        assert math.isfinite(trainer.step([group[:2]], beta=0.1, context=[group[2:]])["loss"])
    else:
        with pytest.raises(ValueError, match=f"{loss} has no group statistics"):
            trainer.step([group[:2]], beta=0.1, context=[group[2:]])


class ValueRegressionSettings(Section):
    """A made-up objective's own settings: the section `train.value_regression`."""

    value_weight: float = Field(1.0, gt=0, description="weight of the value loss")


def value_regression(x: LossInputs):
    """A made-up objective: REINFORCE with a mean baseline, and a critic regressed on the
    reward, weighted by its own setting."""
    advantage = x.rewards - x.rewards.mean()
    value_loss = ((x.values - x.rewards[:, None]).pow(2) * x.mask).sum() / len(x.rewards)
    kl = ((x.token_logp.detach() - x.ref_token_logp) * x.mask).sum(dim=1)
    weight = x.settings.value_regression.value_weight
    loss = -(advantage * x.token_logp.sum(dim=1)).mean() + weight * value_loss
    return loss, {"value_loss": value_loss.detach(), "kl": kl.mean(), "weight": weight}


VALUE_REGRESSION = Objective(value_regression, Needs(critic=True, token_ref_logp=True),
                             ValueRegressionSettings)  # fmt: skip


def test_a_new_objective_is_its_registry_entry_alone(tiny_model, tokenizer, monkeypatch):
    """An objective that the config, the searchers, the trainer and its checkpoints never heard
    of trains from its entry alone: its own settings (`train.value_regression`), a critic and
    per-token reference log-probs, as its needs ask."""
    monkeypatch.setitem(OBJECTIVES, "value_regression", VALUE_REGRESSION)
    config = small_run(loss="value_regression", value_regression={"value_weight": 2.0})
    searcher = Searcher(frozen_copy(tiny_model), tokenizer, ROWS, [always_one], config, seed=0)
    samples, _ = searcher.generate(num_prompts=2)
    for i, s in enumerate(samples):
        s.reward = float(i % 3)
    assert all(s.ref_token_logps is not None for s in samples)
    trainer = Trainer(frozen_copy(tiny_model).requires_grad_(True), config.train,
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step(by_prompt(samples), beta=0.1)
    assert metrics["value_loss"] > 0 and metrics["value_grad_norm"] > 0
    assert metrics["weight"] == 2.0  # the loss read its own setting
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-5)  # policy and reference: one model yet
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.providers["critic"].critic.head.weight.abs().sum() > 0
    assert trainer.state_dict()["optimizer"]["value.head.weight"].abs().sum() > 0


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss\n  Input should be 'tb', 'dr_grpo'"):
        train(loss="a2c")


@pytest.mark.parametrize("loss", ["rloo", "dr_grpo"])
def test_baseline_kl_behaviour_reads_the_sampled_log_prob(tiny_model, tokenizer, loss):
    """The KL term fixed at sampling: equal to the current one where the stored behaviour log-prob
    is the policy's own, different once it drifted."""
    prompt = tokenizer("Q\n")["input_ids"]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12", "34", "567")]
    with torch.no_grad():
        tokens, mask = token_logprobs(tiny_model, [prompt] * 3, responses, pad_id=0)
    own = [row[m.bool()].tolist() for row, m in zip(tokens, mask)]  # ratios 1: nothing clipped

    def gradient(baseline_kl: str, drift: float) -> torch.Tensor:
        group = [
            Sample(0, prompt, ids, reward=r, ref_logp=-2.0, behaviour_logp=sum(lps) + drift * i,
                   behaviour_token_logps=lps, version=0)
            for i, (ids, r, lps) in enumerate(zip(responses, [1.0, 0.0, 0.5], own))
        ]  # fmt: skip
        trainer = Trainer(copy.deepcopy(tiny_model),
                          train(0.0, max_grad_norm=1e9, loss=loss, baseline_kl=baseline_kl),
                          pad_id=0, temperature=1.0)  # fmt: skip
        trainer.step([group], beta=0.5)
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    current = gradient("current", drift=1.0)
    assert torch.allclose(gradient("behaviour", drift=0.0), current, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(gradient("behaviour", drift=1.0), current, atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="baseline_kl\n  Input should be 'current' or 'behaviour'"):
        train(baseline_kl="old")


def test_clipped_losses_need_per_token_behaviour_logps(tiny_model, tokenizer):
    prompt = tokenizer("Q\n")["input_ids"]
    group = [Sample(0, prompt, [5, 6], reward=float(i), ref_logp=-2.0, behaviour_logp=-2.0,
                    version=0) for i in range(2)]  # fmt: skip
    trainer = Trainer(tiny_model, train(loss="dr_grpo"), pad_id=0, temperature=1.0)
    with pytest.raises(ValueError, match="per-token behaviour log-probs"):
        trainer.step([group], beta=0.1)


def test_learned_log_z_starts_at_vargrad_and_survives_a_checkpoint(tiny_model, tokenizer):
    prompt = tokenizer("Q\n")["input_ids"]
    group = [
        Sample(7, prompt, tokenizer(t, add_special_tokens=False)["input_ids"], reward=r,
               ref_logp=-2.0, behaviour_logp=-2.0, behaviour_token_logps=[-1.0, -1.0], version=0)
        for t, r in [("12", 1.0), ("34", 0.0), ("56", 0.5)]
    ]  # fmt: skip
    with torch.no_grad():
        responses = [s.response_ids for s in group]
        logp = sequence_logprobs(tiny_model, [prompt] * 3, responses, pad_id=0)
    beta = 0.5
    vargrad = float((torch.tensor([1.0, 0.0, 0.5]) / beta - logp - 2.0).mean())  # ref_logp -2
    settings = train(0.0, tb={"log_z": "learned"})
    settings.tb = settings.tb.model_copy(update={"log_z_lr": 0.0})  # past its validation too
    trainer = Trainer(tiny_model, settings, pad_id=tokenizer.pad_token_id, temperature=1.0)
    trainer.step([group], beta=beta)
    assert trainer.providers["learned_log_z"].ready
    assert trainer.providers["learned_log_z"].head.bias.item() == pytest.approx(vargrad, abs=1e-4)
    other = Trainer(tiny_model, train(0.0, tb={"log_z": "learned"}),
                    pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    other.load_state_dict(trainer.state_dict())
    assert other.providers["learned_log_z"].ready
    assert other.providers["learned_log_z"].head.bias.item() == pytest.approx(vargrad, abs=1e-4)


@pytest.mark.parametrize("loss", ["tb", "rloo"])
def test_context_samples_enter_the_group_statistics_without_gradient(tokenizer, loss):
    """A step on 2 of a group's 4 samples with the other 2 as context: the gradient of the mean
    loss over the 2 trained, with log Z (TB) or the leave-one-out baseline (RLOO) over all 4,
    against a float64 reference."""
    beta = 0.5
    model = build_tiny_llama(len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             hidden_size=32, num_layers=1, num_heads=2, seed=0)  # fmt: skip
    prompt = tokenizer("Q\n")["input_ids"]
    texts, rewards = ["1", "22", "333", "4"], [1.0, 0.0, 0.5, 0.25]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    samples = [Sample(3, prompt, r, reward=w, ref_logp=-2.0 - i, behaviour_logp=-3.0, version=0)
               for i, (r, w) in enumerate(zip(responses, rewards))]  # fmt: skip

    reference_model = copy.deepcopy(model).double()
    tokens, _ = token_logprobs(reference_model, [prompt] * 4, responses, pad_id=0)
    trained = torch.tensor([True, True, False, False])
    logp = torch.where(trained, tokens.sum(dim=1), tokens.sum(dim=1).detach())
    ref = torch.tensor([s.ref_logp for s in samples], dtype=torch.float64)
    reward = torch.tensor(rewards, dtype=torch.float64)
    if loss == "tb":  # log Z = -mean of delta over all 4
        delta = logp - ref - reward / beta
        terms = (beta * (delta - delta.detach().mean())).pow(2) / (2 * beta)
    else:  # A_i = K/(K-1) (r~_i - mean r~), K = 4
        shaped = reward - beta * (logp.detach() - ref)
        terms = -4 / 3 * (shaped - shaped.mean()) * logp
    terms[trained].mean().backward()
    expected = torch.cat([p.grad.flatten() for p in reference_model.parameters()]).float()

    def step_gradient(groups: list[list[Sample]],
                      context: list[list[Sample]] | None) -> torch.Tensor:  # fmt: skip
        plain = {"tb": {"trust_region": "none"}} if loss == "tb" else {}  # TB's own setting
        trainer = Trainer(copy.deepcopy(model), train(0.0, max_grad_norm=1e9, loss=loss, **plain),
                          pad_id=0, temperature=1.0)  # fmt: skip
        trainer.step(groups, beta=beta, context=context)
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    assert torch.allclose(step_gradient([samples[:2]], [samples[2:]]), expected, rtol=1e-4,
                          atol=1e-6)  # fmt: skip
    assert not torch.allclose(step_gradient([samples[:2]], None), expected, rtol=1e-2,
                              atol=1e-4)  # fmt: skip
    # The same 2 drawn as groups of one (group_size=1), each with its generation's other 3:
    # every sample enters the statistics once, the gradient is the same.
    singles = step_gradient([samples[:1], samples[1:2]],
                            [[samples[1], *samples[2:]], [samples[0], *samples[2:]]])
    assert torch.allclose(singles, expected, rtol=1e-4, atol=1e-6)
