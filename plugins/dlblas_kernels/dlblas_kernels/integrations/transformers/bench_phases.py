"""The end-to-end benchmark's phases and their timing: the settings every column measures with,
CUDA events (the clock on a CPU) around warmed-up runs, peak memory, and the ``train``, ``prefill``
and ``decode_bN`` phases of one built model. :mod:`dlblas_kernels.integrations.transformers.bench`
runs them per column.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dlblas_kernels.integrations.transformers.bench_presets import PHASES

# -- settings and timing ------------------------------------------------------------------------------------


@dataclass
class Settings:
    """What every column of a run measures, and how."""

    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    layers: int = 2
    batch: int = 1
    tokens: int = 4096
    decode_batches: tuple[int, ...] = (1, 32)
    cache_tokens: int = 4096
    decode_steps: int = 1
    warmup: int = 2
    iters: int = 5
    seed: int = 0
    phases: tuple[str, ...] = PHASES
    #: ``time.monotonic()`` after which no further column or phase starts (None: no limit)
    deadline: float | None = None

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(run: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``run``: CUDA events on a GPU (the device idle before it), else the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    run()
    return (time.perf_counter() - begin) * 1e3


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def release(device: torch.device) -> None:
    """Free what the last column left: its tensors, compiled graphs and cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(run: Callable[[], object], settings: Settings, before: Callable[[], object] | None = None,
            ) -> dict[str, Any]:
    """``run`` warmed up, then timed ``settings.iters`` times, ``before`` (untimed) ahead of each call:
    every time, their median, the warm-up's seconds and the peak memory of the timed runs."""
    device = settings.device
    begin = time.perf_counter()
    for _ in range(settings.warmup):
        if before is not None:
            before()
        run()
    synchronize(device)
    warmup_s = time.perf_counter() - begin
    reset_peak(device)
    runs = []
    for _ in range(settings.iters):
        if before is not None:
            before()
        runs.append(timed_ms(run, device))
    return {"status": "ok", "ms": statistics.median(runs), "runs_ms": runs, "warmup_s": round(warmup_s, 3),
            "peak_memory_bytes": peak_bytes(device)}


# -- the phases -----------------------------------------------------------------------------------------------


def token_ids(vocab: int, batch: int, tokens: int, settings: Settings, offset: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(settings.seed + offset)
    return torch.randint(0, vocab, (batch, tokens), generator=generator).to(settings.device)


def train_phase(model: Any, settings: Settings) -> dict[str, Any]:
    ids = token_ids(model.config.vocab_size, settings.batch, settings.tokens, settings)
    model.train()

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    result = measure(step, settings, before=lambda: model.zero_grad(set_to_none=True))
    model.zero_grad(set_to_none=True)
    result["tokens_per_s"] = settings.batch * settings.tokens / (result["ms"] / 1e3)
    return result


def prefill_phase(model: Any, settings: Settings) -> dict[str, Any]:
    from transformers import DynamicCache

    ids = token_ids(model.config.vocab_size, settings.batch, settings.tokens, settings, offset=1)
    model.eval()

    cache = cache_keyword(model)

    def prefill() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache: DynamicCache(config=model.config)})

    result = measure(prefill, settings)
    result["tokens_per_s"] = settings.batch * settings.tokens / (result["ms"] / 1e3)
    return result


def filled_cache(model: Any, batch: int, settings: Settings) -> Any:
    """A ``DynamicCache`` holding ``settings.cache_tokens`` random keys and values in every layer.

    It is filled with ``decode_steps`` tokens more, then cropped, as it is after every timed run: each
    run starts from the same layout (``torch.compile`` guards on strides)."""
    from transformers import DynamicCache

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, config.num_key_value_heads, settings.cache_tokens + settings.decode_steps, head_dim)
    generator = torch.Generator(settings.device).manual_seed(settings.seed + 2)
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator, device=settings.device, dtype=settings.dtype)
                        for _ in range(2))
        cache.update(keys, values, layer)
    cache.crop(-settings.decode_steps)
    return cache


def cache_keyword(model: Any) -> str:
    """The forward's name for the KV cache: ``cache`` since transformers 5.25 (``past_key_values`` before,
    and in forwards that Liger-Kernel puts in place)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_phase(model: Any, batch: int, settings: Settings) -> dict[str, Any]:
    cache = filled_cache(model, batch, settings)
    steps = [token_ids(model.config.vocab_size, batch, 1, settings, offset=3 + i)
             for i in range(settings.decode_steps)]
    keyword = cache_keyword(model)
    model.eval()
    runs = []

    def decode() -> None:
        with torch.no_grad():
            for ids in steps:
                model(input_ids=ids, use_cache=True, **{keyword: cache})
        runs.append(cache.get_seq_length())

    def check() -> None:
        # a forward that dropped the cache argument would time decoding without the cache
        if runs and runs[-1] != settings.cache_tokens + settings.decode_steps:
            raise RuntimeError(f"the model's cache holds {runs[-1]} tokens after {settings.decode_steps} decode "
                               f"steps from {settings.cache_tokens}: the forward did not use it")

    def crop() -> None:
        check()
        grown = cache.get_seq_length() - settings.cache_tokens
        if grown > 0:
            cache.crop(-grown)

    result = measure(decode, settings, before=crop)
    check()
    result["ms_per_token"] = result["ms"] / settings.decode_steps
    result["tokens_per_s"] = batch / (result["ms_per_token"] / 1e3)
    return result


def phase_names(settings: Settings) -> list[str]:
    names = [p for p in ("train", "prefill") if p in settings.phases]
    if "decode" in settings.phases:
        names += [f"decode_b{b}" for b in settings.decode_batches]
    return names


def run_phase(name: str, model: Any, settings: Settings) -> dict[str, Any]:
    if name == "train":
        return train_phase(model, settings)
    if name == "prefill":
        return prefill_phase(model, settings)
    return decode_phase(model, int(name.removeprefix("decode_b")), settings)
