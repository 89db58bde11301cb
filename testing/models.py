"""Tiny random Llamas and what a learner step on them takes: ``tiny_policy`` (vocabulary 64)
and ``make_batch`` (its 4×10 batch), ``tiny_base`` with ``byte_tokenizer`` (vocabulary 258, the
gate's), and ``make_config`` (the ``cpu`` preset with fields set). No engine, no model files."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from learner.config import LearnerConfig, OptimizerConfig, build_config
from learner.data.batch import Batch, policy_logprobs

# SmolLM2's chat template (var/model/chat_template.jinja), so the probes render as served.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def byte_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    """256 byte tokens (no merges) plus <|im_start|> = 256 and <|im_end|> = 257 (end of sequence)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    special = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"} if eos else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    out.chat_template = CHAT_TEMPLATE
    return out


EOS = 257


def tiny_llama(vocab_size: int, seed: int = 0, **config) -> LlamaForCausalLM:
    """A random Llama seeded with ``seed``, in eval mode: 2 layers, hidden 32, 4 attention heads
    over 2 key/value heads, 128 positions, tied embeddings; ``config`` sets more fields."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
        }
        | config
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_base(seed: int = 0) -> LlamaForCausalLM:
    """The gate's tiny Llama: the byte tokenizer's 258 tokens, 1024 positions, larger weights."""
    return tiny_llama(
        258,
        seed,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )


FAST = dict(policy_lr=1e-2, critic_lr=1e-2, critic_warmup_steps=0)


def make_config(algorithm: str = "sao", **fields) -> LearnerConfig:
    """The ``cpu`` preset with ``fields`` set, each in its section: the optimiser's (policy_lr,
    adam_beta1, ...), the top-level ones (autocast_bf16, ...) and the algorithm's (the rest)."""
    overrides: dict = {"optimizer": {}, "algorithm": {}}
    for k, v in fields.items():
        if k in OptimizerConfig.model_fields:
            overrides["optimizer"][k] = v
        elif k in LearnerConfig.model_fields:
            overrides[k] = v
        else:
            overrides["algorithm"][k] = v
    return build_config(algorithm=algorithm, overrides=overrides)


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    """The learner tests' tiny Llama: 64 tokens (``make_batch`` draws from them)."""
    return tiny_llama(64, seed)


def make_batch(policy, rewards=(1.0, 0.0, 1.0, 0.0), seed=0) -> Batch:
    """4 rows x 10 tokens: prompt 3, actions, one row with an observation gap, one right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 10), generator=g)
    attn = torch.ones(4, 10, dtype=torch.long)
    attn[3, 8:] = 0
    act = torch.zeros(4, 10)
    act[:, 3:] = 1
    act[1, 5:7] = 0  # observation tokens between two actions
    act[3, 8:] = 0
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3])
    with torch.no_grad():
        rollout = policy_logprobs(policy, ids, attn, temps) * act
    return Batch(
        input_ids=ids,
        attention_mask=attn,
        action_mask=act,
        rollout_logprobs=rollout,
        rewards=torch.tensor(rewards),
        temperatures=temps,
        prompt_ids=["p0", "p1", "p0", "p2"],
    )
