"""The exchanges on DeepEP (``deep_ep.Buffer``): its normal and its low-latency dispatch and combine.

DeepEP is not on the package index: it is built from https://github.com/deepseek-ai/DeepEP against
the local CUDA and NVSHMEM, and needs NVLink between the GPUs of a host (RDMA between hosts).
These classes use the Buffer interface its documentation describes (``docs/legacy.md``, DeepEP 1.x):

- **normal** (training, prefill): ``get_dispatch_layout`` then ``dispatch``, which delivers each token
  once to every rank serving one of its choices, with ``recv_topk_idx`` local to that rank (``-1``
  for the choices served elsewhere) and their weights: exactly :class:`~dlblas_kernels.moe.exchange.Received`.
  ``combine`` adds each token's rows without weights (the computation weighed them). The tokens
  must be bfloat16.
- **low latency** (decoding): ``low_latency_dispatch`` delivers ``[local experts, max tokens * W, H]``
  with the valid count per expert; the rows are gathered into one ``[N, H]`` with one choice each
  (weight 1), and scattered back for ``low_latency_combine``, which applies the weights. At most
  ``max_tokens_per_rank`` tokens per rank per call, the same bound on every rank.

The buffers are allocated on first use and grown when a call needs more. These exchanges run the
forward only (DeepEP's backward, a combine for a dispatch and the reverse, is not wired to autograd
here); the all-to-all exchange is the one to train through.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch
import torch.distributed as dist

from dlblas_kernels.moe.exchange import Exchange, ExchangeKind, ExchangeUnavailableError, Received
from dlcore.api import InvalidInputError

INSTALL = ("build it from https://github.com/deepseek-ai/DeepEP (it needs CUDA, NVSHMEM and NVLink between the "
           "GPUs), or use exchange='all_to_all', which needs only torch.distributed")


def deepep_available() -> bool:
    """Whether ``deep_ep`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("deep_ep") is not None
    except ValueError:  # in sys.modules without a spec: whatever put it there made it importable
        return True


def load_deepep() -> ModuleType:
    """``deep_ep``, or an :class:`ExchangeUnavailableError` saying why not and what to do."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as error:
        raise ExchangeUnavailableError(f"the DeepEP exchange needs the deep_ep module, which does not import "
                                       f"({error}): {INSTALL}") from error


def check_bfloat16(hidden: torch.Tensor, name: str) -> None:
    if hidden.dtype != torch.bfloat16:
        raise InvalidInputError(name, "hidden", f"has dtype {hidden.dtype}", "torch.bfloat16 (what DeepEP sends)",
                                hint="use exchange='all_to_all' for other dtypes")


class DeepEPExchange(Exchange):
    """DeepEP's normal (high-throughput) dispatch and combine."""

    kind = ExchangeKind.DEEPEP

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__(group)
        self.deep_ep = load_deepep()
        self.group = group if group is not None else dist.group.WORLD
        self.buffer = None

    def _buffer(self, hidden: torch.Tensor):
        hidden_bytes = hidden.shape[1] * max(hidden.element_size(), 2)
        Buffer = self.deep_ep.Buffer
        nvl_bytes = rdma_bytes = 0
        for config in (Buffer.get_dispatch_config(self.world_size), Buffer.get_combine_config(self.world_size)):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, self.world_size))
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, self.world_size))
        buffer = self.buffer
        if buffer is None or buffer.num_nvl_bytes < nvl_bytes or buffer.num_rdma_bytes < rdma_bytes:
            self.buffer = buffer = Buffer(self.group, nvl_bytes, rdma_bytes)
        return buffer

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor,
                 slots_per_rank: int) -> Received:
        check_bfloat16(hidden, "EPMoE (DeepEP)")
        buffer = self._buffer(hidden)
        num_slots = slots_per_rank * self.world_size
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(slot_ids, num_slots)
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            hidden, topk_idx=slot_ids, topk_weights=topk_weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        return Received(hidden=recv_x, topk_weights=recv_weights, topk_ids=recv_ids, handle=handle)

    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        combined, _, _ = self.buffer.combine(out, received.handle)
        return combined


class DeepEPLowLatencyExchange(Exchange):
    """DeepEP's low-latency dispatch and combine, for at most ``max_tokens_per_rank`` tokens per rank
    (the same on every rank)."""

    kind = ExchangeKind.DEEPEP_LOW_LATENCY

    def __init__(self, group: dist.ProcessGroup | None = None, max_tokens_per_rank: int = 128):
        super().__init__(group)
        self.deep_ep = load_deepep()
        self.group = group if group is not None else dist.group.WORLD
        self.max_tokens_per_rank = max_tokens_per_rank
        self.buffer = None

    def _buffer(self, hidden: torch.Tensor, num_slots: int, slots_per_rank: int):
        Buffer = self.deep_ep.Buffer
        rdma_bytes = Buffer.get_low_latency_rdma_size_hint(self.max_tokens_per_rank, hidden.shape[1],
                                                           self.world_size, num_slots)
        buffer = self.buffer
        if buffer is None or buffer.num_rdma_bytes < rdma_bytes:
            # DeepEP's guidance: one queue pair per local expert
            self.buffer = buffer = Buffer(self.group, 0, rdma_bytes, low_latency_mode=True,
                                          num_qps_per_rank=slots_per_rank)
        return buffer

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor,
                 slots_per_rank: int) -> Received:
        check_bfloat16(hidden, "EPMoE (DeepEP low latency)")
        if hidden.shape[0] > self.max_tokens_per_rank:
            raise InvalidInputError("EPMoE (DeepEP low latency)", "hidden", f"has {hidden.shape[0]} tokens",
                                    f"at most max_tokens_per_rank = {self.max_tokens_per_rank} per rank",
                                    hint="raise max_tokens_per_rank (the same on every rank) or use exchange='deepep'")
        num_slots = slots_per_rank * self.world_size
        buffer = self._buffer(hidden, num_slots, slots_per_rank)
        packed, counts, handle, _, _ = buffer.low_latency_dispatch(hidden, slot_ids, self.max_tokens_per_rank,
                                                                   num_slots, use_fp8=False)
        valid = torch.arange(packed.shape[1], device=packed.device) < counts.unsqueeze(1)
        local = torch.arange(packed.shape[0], device=packed.device).unsqueeze(1).expand_as(valid)
        ids = local[valid].unsqueeze(1)
        return Received(hidden=packed[valid], topk_weights=torch.ones(ids.shape, device=ids.device),
                        topk_ids=ids, handle=(handle, valid, packed.shape, slot_ids, topk_weights.float()))

    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        handle, valid, shape, slot_ids, topk_weights = received.handle
        packed = out.new_zeros(shape)
        packed[valid] = out
        combined, _, _ = self.buffer.low_latency_combine(packed, slot_ids, topk_weights, handle)
        return combined
