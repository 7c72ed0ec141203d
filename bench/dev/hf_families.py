"""Hugging Face model families the suite does not build, through the backend split at SDPA, against
eager: an inference call's logits, then a training step with gradient checkpointing (non-reentrant)
where the model supports it, loss and every parameter's gradient. Tiny configs, random weights,
float32 on the CPU; one table row per family.

    python bench/dev/hf_families.py                      # every family below (~15 min on 2 cores)
    python bench/dev/hf_families.py --families opt_dropout,t5

Dropout is off except in `opt_dropout` (its row checks that a training step runs; its numbers differ
from eager's, which draws other random numbers). GPT-J and BLOOM have no SDPA in transformers: they run
eager attention, so the backend says once that its splitting op matched nothing. Logs of each
torch_ext message appear above the table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import transformers as T  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext.backend import counters  # noqa: E402

H, LAYERS, HEADS, VOCAB = 64, 2, 4, 128


def _decoder(cls, **extra):
    return cls(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               intermediate_size=2 * H, max_position_embeddings=64, **extra)


def _opt(dropout: float):
    return T.OPTConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       ffn_dim=2 * H, max_position_embeddings=64, word_embed_proj_dim=H, dropout=dropout)


FAMILIES = {  # name -> (model class, config)
    "gemma": lambda: (T.GemmaForCausalLM, _decoder(T.GemmaConfig, num_key_value_heads=2, head_dim=16)),
    "gemma2": lambda: (T.Gemma2ForCausalLM, _decoder(T.Gemma2Config, num_key_value_heads=2, head_dim=16,
                                                     sliding_window=8)),
    "gemma3": lambda: (T.Gemma3ForCausalLM, _decoder(T.Gemma3TextConfig, num_key_value_heads=2, head_dim=16,
                                                     sliding_window=8)),
    "qwen3": lambda: (T.Qwen3ForCausalLM, _decoder(T.Qwen3Config, num_key_value_heads=2, head_dim=16)),
    "qwen2_moe": lambda: (T.Qwen2MoeForCausalLM, _decoder(T.Qwen2MoeConfig, num_key_value_heads=2, num_experts=4,
                                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                                          shared_expert_intermediate_size=32)),
    "mixtral": lambda: (T.MixtralForCausalLM, _decoder(T.MixtralConfig, num_key_value_heads=2, num_local_experts=4,
                                                       num_experts_per_tok=2)),
    "olmo2": lambda: (T.Olmo2ForCausalLM, _decoder(T.Olmo2Config, num_key_value_heads=2)),
    "starcoder2": lambda: (T.Starcoder2ForCausalLM, _decoder(T.Starcoder2Config, num_key_value_heads=2)),
    "cohere": lambda: (T.CohereForCausalLM, _decoder(T.CohereConfig, num_key_value_heads=2)),
    "granite": lambda: (T.GraniteForCausalLM, _decoder(T.GraniteConfig, num_key_value_heads=2)),
    "stablelm": lambda: (T.StableLmForCausalLM, _decoder(T.StableLmConfig, num_key_value_heads=2)),
    "phi": lambda: (T.PhiForCausalLM, _decoder(T.PhiConfig, resid_pdrop=0.0, embd_pdrop=0.0)),
    "falcon": lambda: (T.FalconForCausalLM, T.FalconConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS,
                                                           num_attention_heads=HEADS)),
    "gpt_neox": lambda: (T.GPTNeoXForCausalLM, _decoder(T.GPTNeoXConfig)),
    "gpt_bigcode": lambda: (T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptj": lambda: (T.GPTJForCausalLM, T.GPTJConfig(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                                     rotary_dim=8, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attn_pdrop=0.0)),
    "bloom": lambda: (T.BloomForCausalLM, T.BloomConfig(vocab_size=VOCAB, hidden_size=H, n_layer=LAYERS,
                                                        n_head=HEADS)),
    "opt": lambda: (T.OPTForCausalLM, _opt(0.0)),
    "opt_dropout": lambda: (T.OPTForCausalLM, _opt(0.1)),
    "bert": lambda: (T.BertForMaskedLM, T.BertConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS,
                                                     num_attention_heads=HEADS, intermediate_size=2 * H,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": lambda: (T.T5ForConditionalGeneration, T.T5Config(
        vocab_size=VOCAB, d_model=H, d_kv=16, d_ff=2 * H, num_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)),
}
NO_SDPA = ("gptj", "bloom")  # transformers refuses attn_implementation="sdpa" for these


def check(name: str) -> list:
    """[family, split, inference err, loss err, grad err, seconds] for one family."""
    start = time.perf_counter()
    cls, config = FAMILIES[name]()
    config._attn_implementation = "eager" if name in NO_SDPA else "sdpa"
    torch.manual_seed(0)
    model = cls(config).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    extra = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
    backend = torch_ext.backend(torch_ext.CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"],
                                                        cache_dir=None))
    counters.reset()
    with torch.no_grad():
        expected = model(input_ids=ids, **extra).logits
        torch._dynamo.reset()
        actual = torch.compile(model, backend=backend)(input_ids=ids, **extra).logits
    inference_err = (actual - expected).abs().max().item()
    split = counters.splitting_op_calls > 0
    model.train()
    if model.supports_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = []
    for run in (model, torch.compile(model, backend=backend)):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_e, grads_e), (loss_c, grads_c) = results
    if grads_e.keys() != grads_c.keys():
        raise AssertionError(f"parameters with a gradient differ: {sorted(grads_e.keys() ^ grads_c.keys())[:3]}")
    grad_err = max((grads_c[n] - g).abs().max().item() for n, g in grads_e.items())
    return [name, "yes" if split else "no", f"{inference_err:.1e}", f"{abs(loss_c - loss_e):.1e}", f"{grad_err:.1e}",
            f"{time.perf_counter() - start:.0f}"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args()
    rows = []
    for name in args.families.split(","):
        try:
            rows.append(check(name))
        except Exception as e:  # noqa: BLE001  (a row says what failed; the rest still run)
            traceback.print_exc()
            rows.append([name, "-", f"FAILED: {type(e).__name__}: {' '.join(str(e).split())[:120]}", "", "", ""])
    header = ["family", "split at SDPA", "inference max err", "loss err", "grad max err", "s"]
    print(f"\ntorch {torch.__version__}, transformers {T.__version__}")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
