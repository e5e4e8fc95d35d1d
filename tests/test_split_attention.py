"""The step's attention split over the keys (quant/split_attention.py), under Triton's interpreter in fp32: it
computes SDPA's attention with the step's additive mask, never reads a block of keys that no row sees, and a
model routed through it decodes what SDPA decodes; the calls it does not compute go to SDPA. Its bf16 on a GPU:
tests/test_cuda_split_attention.py."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the split attention needs Triton")

from tiny import tiny_model, tree_decoding  # noqa: E402


HIDDEN = torch.finfo(torch.float32).min       # what the step's masks hold for a hidden slot (kv_cache.tree_step_mask)


@pytest.fixture
def sa(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from medusa_core.quant import split_attention

    return split_attention


def step_mask(rows: int, width: int, prefix: int, seed: int) -> torch.Tensor:
    """(1, 1, rows, width) additive: every row sees the first ``prefix`` slots and, among the next ``rows``, itself
    and some earlier rows (a tree's ancestors); every later slot is hidden, as in a step over a capacity bucket."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tril(torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    seen = torch.zeros(rows, width, dtype=torch.bool)
    seen[:, :prefix] = True
    seen[:, prefix:prefix + rows] = allowed
    return torch.zeros(rows, width).masked_fill_(~seen, HIDDEN)[None, None]


@pytest.mark.parametrize("rows,width,heads,kv_heads,dim,prefix", [
    (1, 256, 4, 2, 64, 100),        # a plain step: 1 row, most of the bucket empty
    (3, 200, 4, 4, 48, 130),        # a width and a head size off the block and power-of-two sizes
    (16, 256, 2, 1, 64, 120),       # a 16-node tree over GQA
    (33, 128, 2, 2, 32, 30),        # rows padded to 64
])
def test_it_computes_sdpas_attention_and_never_reads_a_block_no_row_sees(sa, rows, width, heads, kv_heads, dim, prefix):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(1, heads, rows, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, width, dim, generator=gen) for _ in range(2))
    mask = step_mask(rows, width, prefix, rows)
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask).transpose(1, 2)                   # (1, T, heads, D)
    # NaN in every block past the last seen slot: a block read would put NaN into the output (0 * NaN)
    unseen = -(-(prefix + rows) // sa.BLOCK_W) * sa.BLOCK_W
    assert unseen < width, "the case has a block no row sees"
    k[:, :, unseen:], v[:, :, unseen:] = float("nan"), float("nan")
    got = sa.split_attention(q, k, v, mask)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # split over several programs, merged: the interpreter's device asks for 8 programs
    assert sa.split_count(heads, width, q.device)[0] > 1


@pytest.mark.parametrize("rows,width,heads,kv_heads,dim",
                         [(1, 256, 4, 2, 64), (16, 200, 2, 1, 48), (33, 128, 2, 2, 32)])
def test_the_last_split_of_a_head_merges_in_the_same_launch_to_the_merge_kernels_bits(sa, rows, width, heads,
                                                                                          kv_heads, dim):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(1, heads, rows, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, width, dim, generator=gen) for _ in range(2))
    mask = step_mask(rows, width, width // 2, rows)
    two_launches = sa.split_attention(q, k, v, mask)
    arrivals = torch.zeros(heads, dtype=torch.int32)
    for _ in range(2):              # the counts are zero again after a call: the next call merges too
        sa.split_attention(2 * q, k, v, mask)       # other partials in the memory the next call's may reuse
        launches = []
        real = sa.launchable
        sa.launchable = lambda fn, interpret: launches.append(fn.__name__) or real(fn, interpret)
        try:
            one_launch = sa.split_attention(q, k, v, mask, None, arrivals)
        finally:
            sa.launchable = real
        assert launches == ["_split_kernel"]
        assert torch.equal(one_launch, two_launches)
        assert not arrivals.any()


def test_arrival_counts_of_the_wrong_kind_are_refused_in_one_line(sa):
    q, k, mask = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16), step_mask(1, 64, 10, 0)
    with pytest.raises(ValueError) as err:
        sa.split_attention(q, k, k, mask, None, torch.zeros(4, dtype=torch.int64))
    assert str(err.value) == ("split_attention's arrivals must be 4 int32 counts on cpu; got 4 torch.int64 on cpu: "
                              "pass zeros of that shape, or None")


def test_a_model_routed_through_it_decodes_the_tokens_sdpa_decodes_and_goes_back(sa):
    model, decode = tree_decoding()
    before = decode()
    assert sa.use_split_attention(model, "split") == "attention: split over the keys in Triton, hidden key blocks skipped"
    calls = []
    kernel = sa.split_attention
    sa.split_attention = lambda *a: calls.append((a[0].shape[2], a[5] is not None and not a[5].any())) or \
        kernel(*a)
    try:
        assert decode() == before
    finally:
        sa.split_attention = kernel
    assert calls.count((15, True)) >= 2, "the steps' rows (the 15-node tree's) went through the kernel, merged in it"
    assert all(merged for _, merged in calls), "every call had its layer's arrival counts, zero"
    assert sa.use_split_attention(model, "sdpa") == "attention: transformers' SDPA"
    assert model.config._attn_implementation == "sdpa"


def test_what_it_does_not_compute_goes_to_sdpa(sa, monkeypatch):
    monkeypatch.setattr(sa, "split_attention", lambda *a: pytest.fail("the kernel ran"))
    model = tiny_model("llama", hidden=64, vocab=64, seed=3)
    module = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    mask = step_mask(3, 8, 2, 0)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=mask).transpose(1, 2)
    out, _ = sa.split_attention_forward(module, q, k, v, mask == 0)       # a bool mask
    torch.testing.assert_close(out, want)
    sa.split_attention_forward(module, q, k, v, None)                      # no mask (transformers' causal)
    rows = sa.MAX_ROWS + 1                                                 # a prefill
    sa.split_attention_forward(module, torch.randn(1, 4, rows, 16), torch.randn(1, 2, rows, 16),
                               torch.randn(1, 2, rows, 16), step_mask(rows, rows, 0, 0))
    grad_q = q.clone().requires_grad_(True)                                # training: no backward here
    with torch.enable_grad():
        assert sa.split_attention_forward(module, grad_q, k, v, mask)[0].requires_grad


def test_its_routing_says_what_it_cannot_do_in_one_line(sa):
    model = tiny_model("llama", hidden=64, vocab=64, seed=3)
    with pytest.raises(ValueError) as err:
        sa.use_split_attention(model, "flash")
    assert str(err.value) == "attention kernel 'flash' is unknown: use one of sdpa, split"
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError) as err:
        sa.use_split_attention(model, "split")
    assert str(err.value) == ("--attention-kernel split: this model's attention is 'eager', not SDPA (exact mode keeps "
                              "its own): use --attention-kernel auto")
    assert model.config._attn_implementation == "eager"
