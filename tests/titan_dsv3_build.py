"""torchtitan 0.3.0's own DeepSeek-V3 model (``DeepSeekV3Model`` from its ``build_mla_moe_layers`` with DeepSeek-V3's
inits, ``_build_dsv3_layers``) at small dims, for the save worker (tests/titan_save_worker.py, the fixture
``titan_dsv3_ws2``) and the load worker (tests/moe_dcp_worker.py's ``titan`` case): MLA attention (``wq`` when
``q_lora_rank`` is 0, else ``wq_a`` / ``q_norm`` / ``wq_b``; ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``), the first
``n_dense`` layers dense (``feed_forward``), the rest ``MoE`` of ``GroupedExperts`` (w1_EFD / w2_EDF / w3_EFD), a
``TokenChoiceTopKRouter`` and a shared expert, ``expert_bias_E`` when ``load_balance_coeff`` is set.

``DIMS`` are the AutoEP DeepSeek-V3 fixtures' config.json (fixtures/moe_autoep_z2_bf16_ws4_ep2_dsv3) as
torchtitan's config says them."""

from __future__ import annotations

DIMS = {"vocab": 32, "dim": 16, "layers": 3, "n_dense": 1, "heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8,
        "qk_nope": 4, "qk_rope": 4, "v_head": 8, "hidden": 16, "moe_hidden": 8, "experts": 8, "shared": 1,
        "top_k": 2}


def dsv3_config(d: dict, load_balance_coeff: float | None = 1e-3):
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    layers = D._build_dsv3_layers(
        n_layers=d["layers"], n_dense_layers=d["n_dense"], dim=d["dim"], n_heads=d["heads"],
        q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope"],
        qk_rope_head_dim=d["qk_rope"], v_head_dim=d["v_head"], mscale=1.0, dense_hidden_dim=d["hidden"],
        moe_hidden_dim=d["moe_hidden"], num_experts=d["experts"], num_shared_experts=d["shared"],
        router_top_k=d["top_k"], router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=d["qk_rope"], max_seq_len=64, theta=10000.0))
    for layer in layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = load_balance_coeff
    return DeepSeekV3Model.Config(
        vocab_size=d["vocab"], dim=d["dim"],
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=d["dim"],
                                        param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d["dim"], param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=d["dim"], out_features=d["vocab"],
                              param_init=D._output_linear_init(d["dim"])),
        layers=layers, mtp_layers=[])
