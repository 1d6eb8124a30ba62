"""The models ``megatrain-plan calibrate`` runs: their config.json fields, sequence length, batch and micro-batch size.

Dense Llama-shaped runs fit the layers' rate by width and its dependence on tokens per micro-batch; a tiny one
fits the per-block overhead; one small mixture of experts fits the sparse factor (the routed experts' time over
their matmul FLOPs at the dense rate). Data only.
"""
from __future__ import annotations

# (name, config.json fields, seq, batch, micro-batch size): widths 256 .. 1024, sizes ~6M .. ~110M parameters;
# h512 twice, at 1024 and 256 tokens per micro-batch, for the rate's dependence on t.
# The overhead run is so small that per-block costs, not FLOPs, make its step.
OVERHEAD_RUN = ("overhead", dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1), 16, 4, 1)
RUNS = (
    ("h256", dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2), 256, 4, 4),
    ("h512", dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4), 256, 4, 4),
    ("h512-mb1", dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4), 256, 4, 1),
    ("h768", dict(model_type="qwen2", vocab_size=24576, hidden_size=768, intermediate_size=2048,
                  num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4), 256, 2, 2),
    ("h1024", dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8), 256, 2, 2),
)
# A qwen3_moe-shaped model, 8 experts of 448 with top-2 at width 320 (~12M parameters, 256 tokens to each expert
# on average), for the sparse factor; its step a few seconds on a CPU as the dense runs'.
SPARSE_RUN = ("moe-h320", dict(model_type="qwen3_moe", vocab_size=8192, hidden_size=320, intermediate_size=896,
                               num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=64,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=448,
                               norm_topk_prob=True), 256, 4, 4)
