"""Tiny random-weight checkpoints of each supported architecture, written with transformers at test time."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 384
TINY_NAME = "tiny-llama"  # the tiny Llama that tests serve (conftest.tiny_model_dir)
# A longer context than the tiny checkpoint's 512, so streams can run long enough (thousands of tiny,
# fast steps) that tests can act on them mid-flight even on a busy machine.
TINY_CONTEXT = 4096

COMMON = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, initializer_range=0.15,
)

# name -> (transformers config class name, extra config fields)
TINY_ARCHS = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3.2": ("LlamaConfig", dict(
        rope_theta=500000.0, tie_word_embeddings=True, num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)),
    # Phi-4-mini's shape of rotary: a quarter of each head passes through unrotated.
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, pad_token_id=0, tie_word_embeddings=False)),
    # Phi-3.5 / Phi-4-mini's LongRoPE (short factors up to the original 256 positions; the parity prompts
    # stay inside them, where transformers uses the short factors too).
    "phi3_longrope": ("Phi3Config", dict(
        pad_token_id=0, tie_word_embeddings=False, max_position_embeddings=1024,
        original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                      "long_factor": [1.0, 1.5, 2.2, 3.3, 5.0, 7.5, 11.0, 16.0]})),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    # Layer 1 keeps a dense MLP (mlp_only_layers), as some Qwen MoE configs do.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, mlp_only_layers=[1], head_dim=16,
                                         tie_word_embeddings=True)),
    # gpt-oss: sinks, biases everywhere, a router with a bias, clamped experts (a limit low enough to bind on
    # random weights; real models use 7), YaRN over a short original context, alternating 24-token windows.
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=24,
                                     swiglu_limit=1.0, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64})),
    # Sliding windows short enough that the parity prompts (up to 130 tokens) cross them; caps low enough
    # that they bind on random weights.
    # Gemma 2's query scale from query_pre_attn_scalar, not head_dim (as in the 27B model).
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=20,
                                        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                                                          "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0}},
                                        pad_token_id=0)),
}


def tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE trained in-process on a little text, saved as tokenizer.json + a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "def f(x):\n    return x * 2", "paged attention keeps many sequences in memory"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant: {% endif %}",
    )
    fast.save_pretrained(folder)


def make_tiny_checkpoint(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    cls_name, extra = TINY_ARCHS[name]
    fields = {**COMMON, **extra, **overrides}
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # norms start at 1; give them some spread so every weight matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
            elif n.endswith("sinks"):  # gpt-oss: some heads whose sink outweighs their scores, some not
                p.uniform_(-2.0, 4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer(folder)
    return folder
