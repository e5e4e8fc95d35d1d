"""The split attention (quant/split_attention.py) on CUDA, in bf16 and fp16 at Llama-7B and SmolLM2 shapes: within
rounding of SDPA with the step's mask, blocks no row sees never read, merged by a kernel of its own or in the split
kernel's launch, the same bits eagerly and inside a CUDA graph, and a captured decoding step through it running the
kernel. Skipped without CUDA: the runbook's cuda-tests stage runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="the split attention needs Triton: pip install triton")

from tiny import tree_decoding  # noqa: E402

from medusa_core.quant import split_attention as sa  # noqa: E402


def step_mask(rows: int, width: int, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, rows, width): the prefix and a chain of tree rows seen, the rest of the bucket hidden (dtype's min)."""
    seen = torch.zeros(rows, width, dtype=torch.bool, device="cuda")
    seen[:, :prefix] = True
    seen[:, prefix:prefix + rows] = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device="cuda"))
    return torch.zeros(rows, width, dtype=dtype, device="cuda").masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 128), (9, 3, 64)])
def test_it_is_sdpa_within_rounding_reads_no_hidden_block_and_replays_its_bits(dtype, rows, heads, kv_heads, dim):
    width, prefix = 1024, 530                                   # the bench's bucket and prefix
    gen = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(1, heads, rows, dim, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, width, dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    mask = step_mask(rows, width, prefix, dtype)
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(q.float(), k.repeat_interleave(group, 1).float(),
                                          v.repeat_interleave(group, 1).float(), attn_mask=mask.float()).transpose(1, 2)
    unseen = -(-(prefix + rows) // sa.BLOCK_W) * sa.BLOCK_W
    k[:, :, unseen:], v[:, :, unseen:] = float("nan"), float("nan")           # read, they would make NaN
    got = sa.split_attention(q, k, v, mask)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # the merge in the split kernel's launch, as the step runs it (each head's last split merges)
    arrivals = torch.zeros(heads, dtype=torch.int32, device="cuda")
    merged_in_launch = sa.split_attention(q, k, v, mask, None, arrivals)
    torch.testing.assert_close(merged_in_launch.float(), want, rtol=2e-2, atol=2e-2)
    same = torch.equal(merged_in_launch, got)
    print(f"merged in the launch: {'the merge kernel bit for bit' if same else 'other bits'}")
    for eager in (got, merged_in_launch):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = sa.split_attention(q, k, v, mask, None, arrivals if eager is merged_in_launch else None)
        for _ in range(20):              # the counts zero again after each replay, or a replay would not merge
            replayed.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, eager)
    assert not arrivals.any()


def test_a_captured_bf16_step_runs_through_it():
    model, decode = tree_decoding("cuda", torch.bfloat16, max_new_tokens=40, graphs=True)
    plain = decode()
    assert sa.use_split_attention(model, "split").startswith("attention: split over the keys")
    calls = []
    kernel = sa.split_attention
    sa.split_attention = lambda *a: calls.append(a[0].shape[2]) or kernel(*a)
    try:
        routed = decode()
    finally:
        sa.split_attention = kernel
        sa.use_split_attention(model, "sdpa")
    assert 15 in calls and len(routed) == len(plain)      # the 15-node tree's rows
    # bf16 sums in another order may tip a near-tie of this random model: most tokens agree, not necessarily all
    assert sum(a == b for a, b in zip(routed, plain)) >= len(plain) // 2, (routed, plain)


def test_auto_times_the_rotary_and_the_attention_on_this_gpu_and_says_both_sums():
    # quant/attention_routing.py's real timings (graphs, the kernels' own checks of their results): either answer
    # is right on a given GPU, and the line says both sums and routes as it says
    from tiny import tiny_model

    from medusa_core.quant import attention_routing as ar

    model = tiny_model("llama", hidden=256, vocab=64, seed=3).to("cuda", torch.bfloat16)
    try:
        rotary, attention = ar.use_rotary(model, "auto"), ar.use_attention(model, "auto")
        print(rotary, attention, sep="\n")          # the GPU session's record
        assert "(auto measured " in rotary and " over a 1-row and a 16-row step)" in rotary, rotary
        assert "(auto measured " in attention and " over a 1-row and a 16-row step)" in attention, attention
        assert ar.rotary_routed(model) == ("triton" if rotary.startswith("rotary: one Triton") else "torch")
        assert ar.attention_routed(model) == ("split" if attention.startswith("attention: split") else "sdpa")
    finally:
        ar.use_rotary(model, "torch")
        ar.use_attention(model, "sdpa")
