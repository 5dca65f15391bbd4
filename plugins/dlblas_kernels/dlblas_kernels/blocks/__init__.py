"""The building blocks the ops are made of, each shared by one or more op modules of
:mod:`dlblas_kernels.kernels`: the GEMM (:mod:`.gemm`, with ffn's SwiGLU pair :mod:`.swiglu_pair`
and weight streaming :mod:`.ffn_decode`), attention (:mod:`.attention`, :mod:`.attention_grad`,
:mod:`.attention_decode`, SDPA's backends :mod:`.sdpa`), grouped GEMMs over experts
(:mod:`.grouped`), the rotary embedding (:mod:`.rotary`), fp8 quantisation (:mod:`.fp8`) and the
npu's tile budget (:mod:`.npu`). A block never imports an op module (an import-linter contract in
the root ``pyproject.toml``); an op module declares its op and plans its launches from blocks.
"""
