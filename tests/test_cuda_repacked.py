"""The repacked NF4 kernel on CUDA in bf16: what Triton's CPU interpreter cannot show (issue 22).
The layout dequantizes to the bits bitsandbytes' CUDA kernel gives (through the table compiled in as
constants too); every path multiplies within
bf16 rounding; exact mode gives each bf16 row the bits it gets alone, its attention kernel too, and
(where this GPU keeps the norms row-invariant) bf16 greedy Medusa decodes plain decoding's tokens; and a
captured decoding step through the fused, repacked layers, or through the Triton norms, decodes what the eager
step decodes (fp32). Skipped without CUDA: run
``python -m pytest -q tests/test_cuda_repacked.py`` on a GPU whenever you have one."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="the NF4 kernels need Triton: pip install triton")
bnbf = pytest.importorskip("bitsandbytes.functional")

from tiny import copied_heads, tiny_model, tree_seen  # noqa: E402

from medusa_core.decoding.config import DecodeConfig  # noqa: E402
from medusa_core.decoding.generate import generate  # noqa: E402
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree  # noqa: E402
from medusa_core.quant import nf4_repack as rp  # noqa: E402
from medusa_core.quant import nf4_repacked_configs as rc  # noqa: E402
from medusa_core.quant import nf4_repacked_kernel as rk  # noqa: E402
from medusa_core.quant import nf4_repacked_matmul as rm  # noqa: E402
from medusa_core.heads.quantize import quantize_projections  # noqa: E402
from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_heads, use_nf4_kernel  # noqa: E402

ROWS = (1, 2, 3, 4, 8, 16, 33, 64)


def quantized(n: int, k: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")


@pytest.mark.parametrize("n,k", [(1000, 4096), (512, 4160)])     # N off the tiles; K off the 128-column group
def test_repacked_weights_dequantize_to_bitsandbytes_cuda_bits(n, k):
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)])
    theirs = bnbf.dequantize_4bit(packed, state)                      # (N, K) bf16: fp32 product, then cast
    assert torch.equal(rm.dequantize_repacked(w).to(theirs.dtype), theirs)
    assert torch.equal(rp.bitsandbytes_bytes(w), packed)


@pytest.mark.parametrize("decode,dtype", [("select", torch.bfloat16), ("prmt", torch.bfloat16),
                                          ("scaled", torch.bfloat16), ("scaled", torch.float16)])
def test_the_table_compiled_for_this_gpu_as_constants_gives_every_weight_bitsandbytes_bits(decode, dtype):
    # decode select and prmt put the 16 values in the machine code as constants, and scaled builds each scale
    # block's table of cast weights in registers from them (prmt and scaled through inline PTX, whose programs the
    # CPU tests run only in a Python model): identity rows make each output one weight times 1 plus zeros, so
    # the dot hands back the weight it decoded, which must be bitsandbytes' fp32 weight cast to x's dtype
    n, k = 1000, 4096
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)])
    cfg = rc.RepackedConfig(True, 64, 64, 1, plane_lookup=True, decode=decode)
    eye = torch.eye(k, device="cuda", dtype=dtype)
    fp32 = copy.copy(state)
    fp32.dtype = torch.float32                    # bitsandbytes' dequantized weight before its cast: (N, K) fp32
    assert torch.equal(rm.repacked_matmul(eye, w, config=cfg).T, bnbf.dequantize_4bit(packed, fp32).to(dtype))


def test_a_weight_of_smaller_scale_blocks_gets_the_same_bits_where_the_tuner_kept_the_scaled_tile(monkeypatch):
    # the tuners time bitsandbytes' blocks of 64, and a config is kept per shape; a checkpoint quantized in blocks
    # of 32 gets that config, and where it is the scaled tile (whose lookups need a block per 4 planes), it looks
    # its codes up in shared memory instead: the same weights into the same dots
    n, k = 1000, 4096
    gen = torch.Generator(device="cuda").manual_seed(4)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w = rp.repack_bnb([bnbf.quantize_4bit(dense, blocksize=32, compress_statistics=True, quant_type="nf4")])
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    scaled = rc.RepackedConfig(True, 16, 64, 2, plane_lookup=True, decode="scaled")
    monkeypatch.setitem(rm._TUNED, rm._key(16, n, k, torch.bfloat16, torch.device("cuda"), 128), scaled)
    assert torch.equal(rm.repacked_matmul(x, w), rm.repacked_matmul(x, w, config=dataclasses.replace(scaled,
                                                                                                   decode="gather")))


@pytest.mark.parametrize("m", ROWS)
def test_every_path_multiplies_within_bf16_rounding(m):
    n, k = 1000, 4096
    packed, state = quantized(n, k)
    w = rp.repack_bnb([(packed, state)])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(m))
    ref = x.float() @ bnbf.dequantize_4bit(packed, state).float().T
    plane = rc.RepackedConfig(True, max(16, rc.row_class(m)), 64, 2, plane_lookup=True)
    gemv = rc.RepackedConfig(False, min(rc.row_class(m), 4), 16, 1)     # the GEMV at any M, as fast mode never runs it
    group = rc.RepackedConfig(True, max(16, rc.row_class(m)), 64, 2, whole_group=True)
    register = {d: dataclasses.replace(plane, decode=d) for d in rc.REGISTER_DECODES}
    for name, kw in (("fast", {}), ("exact", {"exact": True}), ("plane_lookup", {"config": plane}),
                     ("gemv", {"config": gemv}), ("whole_group", {"config": group}),
                     *((f"gemv prefetch{d} x", {"config": dataclasses.replace(gemv, prefetch=d, x_ahead=True)})
                       for d in (1, 2, 3)),
                     # K split 11 ways: the last split has 2 of the 32 groups, fewer than prefetch 3 keeps in flight,
                     # which only the compiled pipeliner's prologue handles (review: the interpreter ignores the
                     # depth), with the reduce kernel and with the sum in the same launch
                     *((f"gemv prefetch3 x split11{' serial' * serial}",
                        {"config": dataclasses.replace(gemv, prefetch=3, x_ahead=True, split_k=11, serial=serial)})
                       for serial in (False, True)),
                     *((f"decode {d}", {"config": c}) for d, c in register.items())):
        y = rm.repacked_matmul(x, w, **kw)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16, name
        rel = float((y.float() - ref).norm() / ref.norm())
        assert rel < 1e-2, f"{name}: relative error {rel:.1e}"
    # the same codes in the same dots, read from registers where the plane tile reads them from shared memory
    for d, cfg in register.items():
        assert torch.equal(rm.repacked_matmul(x, w, config=cfg), rm.repacked_matmul(x, w, config=plane)), (d, m)


def test_exact_mode_gives_every_bf16_row_the_bits_it_gets_alone():
    n, k = 1000, 4096
    w = rp.repack_bnb([quantized(n, k)])
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(1))
    alone = torch.cat([rm.repacked_matmul(x[i:i + 1], w, exact=True) for i in range(64)])
    for m in ROWS[1:]:
        assert torch.equal(rm.repacked_matmul(x[:m], w, exact=True), alone[:m]), f"M={m}"


def test_every_exact_candidate_is_checked_on_this_gpu_and_the_one_kept_gives_every_row_its_bits_alone(capsys):
    # tune_exact on the GPU: each candidate's rows are checked before it is timed; the one kept is row-exact at
    # every row count, one row and 65 (a second row tile) included
    n, k = 1000, 4096
    chosen = rm.tune_exact(n, k, torch.bfloat16, torch.device("cuda"))
    log = rm.TUNING_LOG[rm._exact_key(n, k, torch.bfloat16, torch.device("cuda"), 128)]
    print(chosen.describe(), log)               # the GPU session's record: which tile exact mode keeps here
    assert chosen in rc.exact_candidates(n, k // 128, torch.cuda.get_device_properties(0).multi_processor_count)
    w = rp.repack_bnb([quantized(n, k, seed=2)])
    x = torch.randn(65, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(3))
    alone = torch.cat([rm.repacked_matmul(x[i:i + 1], w, exact=True) for i in range(65)])
    for m in (*ROWS[1:], 65):
        assert torch.equal(rm.repacked_matmul(x[:m], w, exact=True), alone[:m]), f"M={m} with {chosen.describe()}"


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_the_last_split_sums_the_partials_in_one_launch_to_the_reduce_kernels_bits_on_this_gpu(m):
    # what the interpreter (one program at a time) cannot show: the arrival counts and the partials' reads
    # across SMs, at a 7B shape's tile count, eagerly and replayed in a CUDA graph again and again
    from medusa_core.decoding.graphs import captured

    n, k = 11008, 4096
    w = rp.repack_bnb([quantized(n, k)])
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    configs = [rc.RepackedConfig(m > 4, rc.row_class(m) if m <= 4 else 16, 64, 8, prefetch=m <= 4)]
    if m == 1:      # three groups in flight with x ahead, a one-row candidate since 11-30 (review)
        configs.append(dataclasses.replace(configs[0], prefetch=3, x_ahead=True))
    if 1 < m <= 16:     # the three-stage scaled tile the H200 kept at 16 rows, a candidate at 2 and 4 too (review)
        configs.append(rc.RepackedConfig(True, 16, 64, 8, num_stages=3, plane_lookup=True, decode="scaled"))
    for cfg in configs:
        serial = dataclasses.replace(cfg, serial=True)
        want = rm.repacked_matmul(x, w, bias, config=cfg)
        for _ in range(20):
            assert torch.equal(rm.repacked_matmul(x, w, bias, config=serial), want), cfg.describe()
        out = torch.empty_like(want)
        graph, _ = captured(lambda: out.copy_(rm.repacked_matmul(x, w, bias, config=serial)), torch.device("cuda"))
        for _ in range(50):
            out.zero_()
            graph.replay()
            assert torch.equal(out, want), cfg.describe()
        assert not w.arrivals.any()


def graphed_and_eager(model, tree_spec: str, tokens: int, heads=None) -> list[list[int]]:
    """Greedy tokens of ``heads`` (default: copied heads) over ``tree_spec``, through a captured step and eagerly."""
    heads = copied_heads(model, num_heads=3).cuda() if heads is None else heads
    tree = build_tree_buffers(resolve_tree(tree_spec), 3, device="cuda")
    return [[t for s in generate(model, [1, 5, 7, 9, 3], heads=heads, tree=tree,
                                 config=DecodeConfig(max_new_tokens=tokens), graphs=graphs) for t in s.tokens]
            for graphs in (True, False)]


def test_auto_times_both_kernels_on_this_gpu_and_decodes_in_a_graph_what_it_decodes_eagerly():
    # auto's measured choice (quant/bnb.py _use_measured) on a real GPU: both sums in its line, and
    # whichever routing it kept decodes the same in a graph as eagerly (fp32, as below)
    model = tiny_model("llama", hidden=64, vocab=64, seed=3).cuda()
    quantize_linear_nf4_(model, torch.float32)
    described = use_nf4_kernel(model, "auto")
    print(described)                        # the GPU session's record of what auto chose
    assert ("auto measured" in described or "(auto: no " in described) and "for 14 NF4 layers" in described, described
    runs = graphed_and_eager(model, "cartesian-2x2x2", 24)
    assert runs[0] == runs[1] and len(runs[0]) == 24


@pytest.mark.parametrize("choice", ["repacked", "repacked-exact"])
def test_a_captured_step_through_fused_repacked_layers_decodes_what_the_eager_step_does(choice):
    # the fused q/k/v and gate/up slices hand their columns over inside the graph as they do eagerly. fp32,
    # as test_cuda_graphs: the graph attends over the whole cache bucket, the eager step over the used
    # slots, and bf16 may round those two differently
    model = tiny_model("llama", hidden=64, vocab=64, seed=3).cuda()
    quantize_linear_nf4_(model, torch.float32)
    described = use_nf4_kernel(model, choice)
    assert "fused" in described and "for 14 NF4 layers" in described, described
    for spec in ("baseline", "cartesian-2x2x2"):
        runs = graphed_and_eager(model, spec, 40)
        assert runs[0] == runs[1], spec
        assert len(runs[0]) == 40


@pytest.mark.parametrize("choice", ["auto", "repacked"])
def test_nf4_heads_on_this_gpu_go_where_it_times_them_faster_and_decode_in_a_graph_as_eagerly(choice):
    # --heads-quant nf4 (quant/bnb.py use_nf4_heads): auto keeps the repacked kernel for the heads only where this
    # GPU times it faster than bitsandbytes at one row, and says both; a captured step through them decodes what
    # the eager step decodes (fp32, as above)
    from medusa_core.quant.nf4_fused import RepackedNF4Linear

    model = tiny_model("llama", hidden=64, vocab=64, seed=3).cuda()
    quantize_linear_nf4_(model, torch.float32)
    use_nf4_kernel(model, "repacked")
    heads = quantize_projections(copied_heads(model, num_heads=3).cuda(), torch.float32)
    described = use_nf4_heads(heads, choice)
    print(described)                        # the GPU session's record of the two timings
    repacked_us, bnb_us = (float(t) for t in
                           re.search(r"\(([\d.]+) µs a head against ([\d.]+) on bitsandbytes", described).groups())
    on_repacked = all(type(head[-1]) is RepackedNF4Linear for head in heads.heads)
    if choice == "repacked" or abs(repacked_us - bnb_us) >= 0.1:     # the line's figures are rounded to 0.1 µs
        assert on_repacked == (choice == "repacked" or repacked_us < bnb_us), described
    runs = graphed_and_eager(model, "cartesian-2x2x2", 24, heads)
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_a_second_start_on_this_gpu_routes_as_the_first_from_the_remembered_timings(monkeypatch, tmp_path):
    # loading/kernel_memory.py on a real GPU: the first load's auto routing times and keeps its timings, a
    # second (in-process caches emptied, as in a new process) reads them all, times nothing and routes alike
    from medusa_core.loading.load import route_kernels
    from medusa_core.loading.spec import LoadSpec
    from medusa_core.quant import bnb as qb
    from medusa_core.quant import nf4_matmul as nm

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))
    lines = []
    for _ in range(2):
        for module, cache in ((rm, "_TUNED"), (nm, "_TUNED"), (qb, "_TIMED")):
            monkeypatch.setattr(module, cache, {})
        model = tiny_model("llama", hidden=64, vocab=64, seed=3).cuda()
        quantize_linear_nf4_(model, torch.float32)
        lines.append(route_kernels(model, LoadSpec(device="cuda"), "nf4", "cuda"))
    print(*lines, sep="\n")                # the GPU session's record, with the first start's tuning seconds
    first, _, note_1 = lines[0].rpartition("; kernel timings: ")
    second, _, note_2 = lines[1].rpartition("; kernel timings: ")
    assert first == second and " measured now in " in note_1 and " read from those kept " in note_2, lines
    # the second start reads what its routing asks for. The first also kept the Triton tuner's results that
    # timing a layer with that kernel measured inside its timing; the second reads the layer's timing and
    # never asks for them (H100, 2026-11-27: 43 measured, 39 read, routed alike)
    assert 0 < int(note_2.split()[0]) <= int(note_1.split()[0]), lines


def test_auto_times_the_norms_on_this_gpu_and_a_captured_step_through_the_triton_norms_decodes_as_eager():
    from medusa_core.quant.norm_routing import norms_routed, use_norm_kernel

    model = tiny_model("llama", hidden=64, vocab=64, seed=3).cuda()
    line = use_norm_kernel(model, "auto")           # timed here: either answer is right, and says both sums
    assert "auto measured" in line, line
    assert line.startswith("norms: one Triton kernel") == (norms_routed(model) == "triton"), line
    assert use_norm_kernel(model, "triton").startswith("norms: one Triton kernel for each of 5 RMSNorms")
    runs = graphed_and_eager(model, "cartesian-2x2x2", 40)
    assert runs[0] == runs[1] and len(runs[0]) == 40


def test_the_row_exact_attention_gives_a_bf16_tree_row_the_bits_it_gets_alone():
    from medusa_core.quant.rows_alone_attention import rows_alone_attention

    gen = torch.Generator(device="cuda").manual_seed(5)
    heads, kv_heads, dim, prefix, parents = 32, 8, 128, 300, [-1, 0, 0, 1, 1, 2, 3]
    width = prefix + len(parents) + 20
    q = torch.randn(1, heads, len(parents), dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, width, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    seen = tree_seen(parents, prefix, width, "cuda")
    tree = rows_alone_attention(q, k, v, seen)
    mask = torch.zeros(seen.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~seen, float("-inf"))[None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(tree, ref, rtol=2e-2, atol=2e-2)
    for i in range(len(parents)):
        slots = seen[i].nonzero().squeeze(1)
        k_plain, v_plain = torch.zeros_like(k), torch.zeros_like(v)
        k_plain[:, :, :len(slots)], v_plain[:, :, :len(slots)] = k[:, :, slots], v[:, :, slots]
        alone_seen = torch.zeros(1, width, dtype=torch.bool, device="cuda")
        alone_seen[0, :len(slots)] = True
        assert torch.equal(rows_alone_attention(q[:, :, i:i + 1].contiguous(), k_plain, v_plain, alone_seen)[0, 0],
                           tree[0, i]), f"row {i}"


def test_bf16_exact_mode_decodes_plain_decodings_tokens_where_this_gpu_keeps_the_rest_row_invariant():
    # what the comparison toggle's "identical" rests on: bf16, graphs, a tree, the heads
    from medusa_core.quant import nf4_fused
    from medusa_core.quant.formats import weights_format

    model = tiny_model("llama", hidden=64, vocab=64, seed=4).cuda().to(torch.bfloat16)
    quantize_linear_nf4_(model, torch.bfloat16)
    described = use_nf4_kernel(model, "repacked-exact")
    checks = nf4_fused.row_invariance(model)
    print(described, checks)                # the GPU session's record of what this GPU keeps row-invariant
    if not all(checks.values()):
        pytest.skip(f"not row-invariant on this GPU: {checks} ({described})")
    assert weights_format(model) == "NF4-exact"
    heads = copied_heads(model, num_heads=3).cuda().to(torch.bfloat16)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3, device="cuda")
    config = DecodeConfig(max_new_tokens=48)
    for prompt in ([1, 5, 7, 9, 3], [2, 4, 6], [11, 13, 17, 19, 23, 29]):
        plain = [t for s in generate(model, prompt, config=config, graphs=True) for t in s.tokens]
        medusa = [t for s in generate(model, prompt, heads=heads, tree=tree, config=config, graphs=True)
                  for t in s.tokens]
        assert medusa == plain, prompt


def test_the_row_exact_norm_gives_a_bf16_row_the_bits_it_gets_alone():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from medusa_core.quant.rows_alone_norm import RowsAloneRMSNorm

    norm = LlamaRMSNorm(4096, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4096, device="cuda") * 0.1 + 1)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    exact = RowsAloneRMSNorm(norm)
    together = exact(x)
    with torch.no_grad():
        torch.testing.assert_close(together, norm(x), rtol=2e-2, atol=2e-2)
    for rows in (1, 2, 3, 4, 5, 16, 33, 64):
        assert torch.equal(exact(x[:rows]), together[:rows]), rows
    assert torch.equal(torch.cat([exact(x[i:i + 1]) for i in range(64)]), together)


def test_the_row_exact_head_gives_a_bf16_row_the_bits_it_gets_alone():
    from medusa_core.quant.rows_alone_linear import rows_alone_linear

    gen = torch.Generator(device="cuda").manual_seed(6)
    w = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    together = rows_alone_linear(x, w)
    torch.testing.assert_close(together.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in (1, 2, 3, 4, 5, 16, 33, 64):                   # row tiles of 1, 2, 4 and 8
        assert torch.equal(rows_alone_linear(x[:rows], w), together[:rows]), rows
    assert torch.equal(torch.cat([rows_alone_linear(x[i:i + 1], w) for i in range(64)]), together)


def test_the_tuner_compiles_its_candidates_side_by_side_and_its_timing_loop_compiles_none(monkeypatch, tmp_path):
    # kernel_timing.compile_ahead on a real GPU, from an empty Triton cache as at a first start: the launches the
    # tuner then times (the matmul kernel's; the split-K sum is another kernel) find every kernel compiled
    import threading

    from medusa_core.quant import kernel_timing as kt
    from medusa_core.quant.triton_runtime import launchable

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kt, "compile_workers", lambda: 4)
    monkeypatch.setattr(rm, "_TUNED", {})
    monkeypatch.setattr(rm, "TUNING_LOG", {})
    launchable.cache_clear()
    fn = launchable(rk.repacked_kernel, False)
    fn.device_caches[torch.cuda.current_device()]
    inner, threads, in_timing = fn.compile, set(), []

    def counted(*args, **kwargs):
        threads.add(threading.get_ident())
        in_timing.append(timing[0])
        return inner(*args, **kwargs)
    fn.compile = counted
    timing = [False]
    pick = rm.pick_fastest

    def timed(*args, **kwargs):
        timing[0] = True
        return pick(*args, **kwargs)
    monkeypatch.setattr(rm, "pick_fastest", timed)
    try:
        best = rm.tune_shape(16, 1024, 4096, torch.bfloat16, torch.device("cuda"))
    finally:
        launchable.cache_clear()
    assert best is not None and in_timing and not any(in_timing), in_timing    # compiled ahead, none in the loop
    assert len(threads) > 1 and threading.get_ident() not in threads
