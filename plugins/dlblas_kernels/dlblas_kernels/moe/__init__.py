"""Mixture-of-experts layers: expert parallelism over a torch.distributed process group, routing, and
expert load balancing.

- :class:`EPMoE` (``layer``): the expert-parallel layer; each rank holds a contiguous shard of the
  experts and calls it with its own tokens.
- ``exchange`` / ``deepep``: how tokens reach their experts' ranks: ``all_to_all_single`` (NCCL,
  gloo), DeepEP's normal and low-latency kernels when ``deep_ep`` is installed.
- ``placement`` / ``eplb``: physical slots and replicas; per-expert load counts and the balanced
  placement (DeepSeek's EPLB design).
- ``routing``: router logits to ``(topk_weights, topk_ids)``.
- ``python -m dlblas_kernels.moe.bench``: tokens per second of the layer under ``torchrun``.
"""

from dlblas_kernels.moe.deepep import DeepEPExchange, DeepEPLowLatencyExchange, deepep_available
from dlblas_kernels.moe.eplb import ExpertLoadRecorder, balance, imbalance, rank_loads, routed_rank_loads
from dlblas_kernels.moe.exchange import AllToAllExchange, Exchange, ExchangeKind, ExchangeUnavailableError, Received
from dlblas_kernels.moe.layer import EPMoE, make_exchange
from dlblas_kernels.moe.placement import Placement
from dlblas_kernels.moe.routing import capacity_topk, softmax_topk

__all__ = [
    "EPMoE", "make_exchange",
    "Exchange", "ExchangeKind", "ExchangeUnavailableError", "Received", "AllToAllExchange",
    "DeepEPExchange", "DeepEPLowLatencyExchange", "deepep_available",
    "Placement", "ExpertLoadRecorder", "balance", "imbalance", "rank_loads", "routed_rank_loads",
    "softmax_topk", "capacity_topk",
]
