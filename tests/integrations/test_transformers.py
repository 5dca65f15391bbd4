"""dlcore inside transformers models: the patched model against the unpatched one, same weights.

Tiny random configs of each family (2 layers, hidden 64, vocabulary 128), float32, the kernels in
Triton's interpreter on a CPU. Llama runs in the fast lane; the other families, gradient
checkpointing and torch.compile are slow.
"""

from __future__ import annotations

import ast
import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dlblas_kernels.integrations import transformers as integration
from dlblas_kernels.integrations.transformers import (
    ModelFallbackWarning,
    apply,
    attention,
    experts,
    ops,
    register,
)
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, pad_token_id=0,
              bos_token_id=1, eos_token_id=None)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=32),  # a window no test sequence reaches
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),  # q and k norms
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, **MOE, num_experts=4, head_dim=16, mlp_only_layers=[0]),
    # MLA: query and key heads of 24 + 8 (rotary, interleaved), value heads of 16, as many key heads as
    # query heads (its keys are expanded from the latent); a dense first layer
    "deepseek_v3": lambda: DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **MOE, n_routed_experts=4,
                                            n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                                            kv_lora_rank=16, qk_nope_head_dim=24, qk_rope_head_dim=8,
                                            v_head_dim=16),
}
FAST = ["llama"]
NO_FALLBACK = pytest.mark.filterwarnings("error::dlblas_kernels.integrations.transformers.ModelFallbackWarning")
FAMILIES = [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in CONFIGS]


def models(family: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The unpatched model (SDPA attention, eager experts) and a patched deep copy of it."""
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="sdpa",
                                                 experts_implementation="eager").to(DEVICE, torch.float32)
    return reference, apply(copy.deepcopy(reference))


def tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 128, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


class OpSpy:
    """Counts the ops the integration asks ``get_op`` for, by name, with the kinds of the
    implementations that ran them (``triton`` for dlcore's kernels)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self.kinds: set[str] = set()
        monkeypatch.setattr(ops, "get_op", self._counting(ops.get_op))

    def _counting(self, get_op):
        def spy(name, args, *rest, **options):
            bound = get_op(name, args, *rest, **options)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.kinds.add(bound.impl.kind)
            return bound
        return spy


# --- the model, against the unpatched one ----------------------------------------------------------

@pytest.fixture
def unwarned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fallback warns again (each warns once per process): with the ``error`` filter, a test
    proves that no layer left dlcore's kernels."""
    monkeypatch.setattr(integration.fallback, "_warned", set())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_padded_batch_and_greedy_generate(family, unwarned):
    reference, patched = models(family)
    ids = tokens(3, 9)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ModelFallbackWarning)
        assert_close(patched(ids).logits, reference(ids).logits)

        # row 0 left-padded, row 1 right-padded, row 2 whole: flash_attention_v2 with kv_start and
        # kv_end. Every position matches, the padded ones too: a left-padded query sees no key and
        # gives 0 in both (SDPA's fully masked rows), a right-padded one the valid keys.
        mask = torch.ones_like(ids)
        mask[0, :3], mask[1, -2:] = 0, 0
        assert_close(patched(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)

        # prefill, then decoding steps of one query against the KV cache, all on dlcore's kernels:
        # a whole batch, and a left-padded one (as generate pads)
        prompt = tokens(2, 5, seed=2)
        left = torch.ones_like(prompt)
        left[1, :2] = 0
        for prompt_mask in (torch.ones_like(prompt), left):
            generated = patched.generate(prompt, attention_mask=prompt_mask, max_new_tokens=4, do_sample=False,
                                         pad_token_id=0)
            expected = reference.generate(prompt, attention_mask=prompt_mask, max_new_tokens=4, do_sample=False,
                                          pad_token_id=0)
            assert torch.equal(generated, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_every_gradient(family, unwarned):
    reference, patched = models(family)
    ids = tokens(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelFallbackWarning)
        loss = patched(ids, labels=ids).loss
    expected = reference(ids, labels=ids).loss
    assert_close(loss, expected)
    loss.backward()
    expected.backward()
    named = dict(reference.named_parameters())
    checked = 0
    for name, parameter in patched.named_parameters():
        if named[name].grad is None:
            assert parameter.grad is None, name
            continue
        assert parameter.grad is not None, f"{name} gets no gradient"
        torch.testing.assert_close(parameter.grad, named[name].grad, rtol=1e-4, atol=1e-5, msg=name)
        checked += 1
    assert checked == sum(p.grad is not None for p in reference.parameters()) > 10


@pytest.mark.slow
@NO_FALLBACK
def test_gradient_checkpointing(unwarned):
    reference, patched = models("qwen3")
    for model in (reference, patched):
        model.train()
        model.gradient_checkpointing_enable()
    ids = tokens(2, 8)
    loss, expected = patched(ids, labels=ids).loss, reference(ids, labels=ids).loss
    loss.backward()
    expected.backward()
    assert_close(loss, expected)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@NO_FALLBACK
def test_torch_compile(unwarned):
    torch._dynamo.reset()
    reference, patched = models("llama")
    compiled = torch.compile(patched, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    ids = tokens(2, 8)
    loss, expected = compiled(ids, labels=ids).loss, reference(ids, labels=ids).loss
    loss.backward()
    expected.backward()
    assert_close(loss, expected)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


# --- what ran ------------------------------------------------------------------------------------

@NO_FALLBACK
def test_dlcore_kernels_run(monkeypatch, unwarned):
    spy = OpSpy(monkeypatch)
    reference, patched = models("llama")
    ids = tokens(1, 6)
    with torch.no_grad():
        assert_close(patched(ids).logits, reference(ids).logits)
    # per layer: attention, rotary, the input norm, the post-attention norm inside ffn; the final norm
    assert spy.calls == {"flash_attention_v2": 2, "rms_norm": 3, "ffn": 2, "apply_rotary_pos_emb": 2}
    assert spy.kinds == {"triton"}


@pytest.mark.slow
@NO_FALLBACK
def test_training_loss_is_fused_linear_cross_entropy_without_logits(monkeypatch, unwarned):
    """In training with labels the loss is fused_linear_cross_entropy's (no logits made), equal to
    the unpatched model's with its gradients; num_items_in_batch divides a sum as transformers
    does; evaluation and a forward without labels keep their logits."""
    spy = OpSpy(monkeypatch)
    reference, patched = models("llama")
    patched.train()
    reference.train()
    ids = tokens(2, 8)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt's tokens, ignored
    out = patched(ids, labels=labels)
    expected = reference(ids, labels=labels)
    assert out.logits is None and spy.calls["fused_linear_cross_entropy"] == 1
    assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    items = torch.tensor(11)
    assert_close(patched(ids, labels=labels, num_items_in_batch=items).loss,
                 reference(ids, labels=labels, num_items_in_batch=items).loss)
    assert patched(ids).logits.shape == (2, 8, 128)
    patched.eval()
    with torch.no_grad():
        assert_close(patched(ids, labels=labels).logits, reference(ids, labels=labels).logits)
    assert spy.calls["fused_linear_cross_entropy"] == 2


@pytest.mark.slow
@NO_FALLBACK
def test_fused_moe_runs_the_experts(monkeypatch, unwarned):
    spy = OpSpy(monkeypatch)
    reference, patched = models("qwen3_moe")
    ids = tokens(1, 6)
    with torch.no_grad():
        assert_close(patched(ids).logits, reference(ids).logits)
    # layer 0 is dense: its post-attention norm inside ffn; layer 1's experts, its norm before them
    # alone; the input, q and k norms of both layers; the final norm
    assert spy.calls == {"fused_moe": 1, "flash_attention_v2": 2, "ffn": 1, "rms_norm": 3 + 4 + 1,
                         "apply_rotary_pos_emb": 2}
    assert spy.kinds == {"triton"}


def test_parameters_and_state_dict_unchanged():
    reference, patched = models("llama")
    parameters = [id(p) for p in patched.parameters()]
    state = patched.state_dict()
    apply(patched)  # again: nothing changes
    assert [id(p) for p in patched.parameters()] == parameters
    assert patched.state_dict().keys() == state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name


def test_register_is_idempotent_and_from_config_takes_the_name():
    register()
    register()
    assert ALL_MASK_ATTENTION_FUNCTIONS["dlcore"] is attention.dlcore_mask
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["mixtral"](), attn_implementation="dlcore",
                                             experts_implementation="dlcore")
    assert model.config._attn_implementation == "dlcore"
    assert model.config._experts_implementation == "dlcore"


# --- never silently wrong ------------------------------------------------------------------------

def test_what_the_kernels_cannot_take_runs_transformers_path_and_says_so(unwarned):
    """A sliding window the sequence reaches: SDPA with the window's mask, one warning naming the
    layer and the reason; the results are the unpatched model's."""
    torch.manual_seed(0)
    config = MistralConfig(**{**COMMON, "num_hidden_layers": 1}, sliding_window=4)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(DEVICE)
    patched = apply(copy.deepcopy(reference))
    ids = tokens(2, 9)
    with torch.no_grad(), pytest.warns(ModelFallbackWarning) as caught:
        got = patched(ids).logits
        patched(ids)  # said once
    messages = [str(w.message) for w in caught if w.category is ModelFallbackWarning]
    assert len(messages) == 1
    assert "MistralAttention (layer 0)" in messages[0] and "sliding window" in messages[0]
    assert_close(got, reference(ids).logits)

    with pytest.warns(ModelFallbackWarning, match="eager attention.*output_attentions"), torch.no_grad():
        out = patched(ids[:, :3], output_attentions=True)
    assert out.attentions[0].shape == (2, 4, 3, 3)


def test_experts_in_another_form_run_their_own_forward_and_say_so(unwarned):
    """Experts with GELU gates: fused_moe computes SiLU's, so the module's own forward runs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    module = Qwen3MoeExperts(Qwen3MoeConfig(**COMMON, **MOE, num_experts=4, hidden_act="gelu")).to(DEVICE)
    for weight in (module.gate_up_proj, module.down_proj):
        torch.nn.init.normal_(weight, std=0.1)
    hidden = torch.randn(5, 64, device=DEVICE)
    index = torch.randint(0, 4, (5, 2), device=DEVICE)
    weights = torch.rand(5, 2, device=DEVICE)
    with pytest.warns(ModelFallbackWarning, match="Qwen3MoeExperts runs its own forward.*SiLU-gated"):
        got = experts.dlcore_experts(module, hidden, index, weights)
    assert_close(got, experts.original_forward(module)(module, hidden, index, weights))
    module.act_fn = torch.nn.SiLU()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelFallbackWarning)
        assert_close(experts.dlcore_experts(module, hidden, index, weights),
                     experts.original_forward(module)(module, hidden, index, weights))


def test_mask_function_skips_only_the_plain_causal_mask():
    ones = torch.ones(2, 9, dtype=torch.bool)
    padded = ones.clone()
    padded[0, :3] = False
    holed = ones.clone()
    holed[1, 4] = False  # a row whose keys are two runs

    def mask(**kwargs):
        return attention.dlcore_mask(**{"batch_size": 2, "q_length": 9, "kv_length": 9, **kwargs})

    assert mask() is None
    assert mask(attention_mask=ones) is None
    assert mask(q_length=1, q_offset=8, attention_mask=ones) is None  # decoding against a dynamic cache
    assert mask(q_length=3, q_offset=6, attention_mask=ones) is None  # a chunk against the cache
    window = sliding_window_causal_mask_function(16)
    assert mask(mask_function=window, local_size=16) is None  # a window no position reaches
    left = mask(attention_mask=padded)
    assert isinstance(left, attention.KeyPadding) and left.kv_end is None
    assert left.kv_start.dtype == torch.int32 and left.kv_start.tolist() == [3, 0]
    right = mask(attention_mask=padded.flip(1))
    assert right.kv_start is None and right.kv_end.tolist() == [6, 9]
    both = padded.clone()
    both[1, 7:] = False
    both[1, :2] = False
    both = mask(attention_mask=both)
    assert both.kv_start.tolist() == [3, 2] and both.kv_end.tolist() == [9, 7]
    decoding = mask(q_length=1, q_offset=8, attention_mask=padded)  # decoding a left-padded batch
    assert decoding.kv_start.tolist() == [3, 0]
    built = mask(attention_mask=holed)
    assert built.dtype == torch.bool and built.shape == (2, 1, 9, 9) and not built[1, :, :, 4].any()
    dense = left.dense(9, 9, True)
    assert torch.equal(dense, attention.sdpa_mask(batch_size=2, q_length=9, kv_length=9, attention_mask=padded,
                                                  allow_is_causal_skip=False))
    assert mask(mask_function=sliding_window_causal_mask_function(4), local_size=4) is not None
    assert mask(q_length=1, q_offset=3, kv_length=9) is not None  # a static cache's empty slots
    assert mask(allow_is_causal_skip=False) is not None
    assert mask(mask_function=lambda b, h, q, kv: kv <= q, local_size=None) is not None  # someone else's mask
    assert mask(mask_function=causal_mask_function, q_offset=torch.tensor(0)) is not None
    assert mask(mask_function=sliding_window_causal_mask_function(4), local_size=4, attention_mask=padded
                ).dtype == torch.bool


@pytest.mark.parametrize(("sq", "sk"), [(9, 9), (3, 9), (1, 9)], ids=["prefill", "chunk", "decode"])
def test_attention_takes_key_padding(sq, sk):
    """A KeyPadding mask runs flash_attention_v2 with its bounds: SDPA with the same mask, the
    rows that see no key 0 in both."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, sq, 16, generator=gen).to(DEVICE)
    k = torch.randn(3, 2, sk, 16, generator=gen).to(DEVICE)
    v = torch.randn(3, 2, sk, 16, generator=gen).to(DEVICE)
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, 2
    padding = attention.KeyPadding(torch.tensor([3, 0, 0], dtype=torch.int32, device=DEVICE),
                                   torch.tensor([9, 7, 9], dtype=torch.int32, device=DEVICE))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelFallbackWarning)
        out, weights = attention.dlcore_attention(layer, q, k, v, padding, scaling=0.3)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=padding.dense(sq, sk, sq > 1), scale=0.3)
    assert weights is None
    assert_close(out, expected.transpose(1, 2))


@pytest.mark.parametrize(("sq", "sk", "dq", "dv"), [(3, 7, 16, 16), (1, 7, 16, 16), (5, 5, 24, 16)])
def test_attention_is_causal_bottom_right_and_pads_unequal_heads(sq, sk, dq, dv):
    """More keys than queries (a chunk or a decoding step against the cache), and MLA's query/key
    heads wider than its value heads, against SDPA with the explicit mask."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, sq, dq, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, sk, dq, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, sk, dv, generator=gen).to(DEVICE)
    layer = torch.nn.Module()
    layer.is_causal, layer.num_key_value_groups = True, 2
    out, weights = attention.dlcore_attention(layer, q, k, v, None, scaling=0.3)
    allowed = torch.arange(sq)[:, None] + sk - sq >= torch.arange(sk)[None, :]
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=allowed.to(DEVICE), scale=0.3)
    assert weights is None and out.shape == (2, sq, 4, dv)
    assert_close(out, expected.transpose(1, 2))


def test_only_the_integrations_import_transformers():
    """The core and the kernels never import transformers; the integration package alone does."""
    roots = [REPO / "dlcore", REPO / "plugins" / "dlblas_kernels" / "dlblas_kernels"]
    offenders = []
    for root in roots:
        for path in root.rglob("*.py"):
            if "integrations" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert not offenders
