"""The building blocks the ops are made of, each shared by one or more op modules of
:mod:`dlblas_kernels.kernels`: the GEMM (:mod:`.gemm`, with ffn's SwiGLU pair :mod:`.swiglu_pair`,
weight streaming :mod:`.ffn_decode`, prefill :mod:`.ffn_prefill` and backward :mod:`.ffn_backward`),
attention (:mod:`.attention` with its rotary loads :mod:`.attention_rotary`, :mod:`.attention_grad`
with its kernels :mod:`.attention_grad_kernels`, :mod:`.attention_decode`, SDPA's backends
:mod:`.sdpa`), grouped GEMMs over experts (:mod:`.grouped`, with fused_moe's launches
:mod:`.moe_launches`, tiles :mod:`.moe_tiles` and copy-engine GEMMs :mod:`.grouped_tma`), topk_gating's
kernels (:mod:`.topk_routing`), the rotary embedding (:mod:`.rotary`), fp8 quantisation (:mod:`.fp8`),
fp8_gemm's scale granularity (:mod:`.fp8_scales`) and the npu's tile budget
(:mod:`.npu`). A block never imports an op module (an import-linter contract in the root
``pyproject.toml``); an op module declares its op and plans its launches from blocks.
"""
