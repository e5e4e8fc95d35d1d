"""Loading heads in every published layout, the backbone (float32 and NF4), and every
user-facing failure as its own one-line LoadError. Tiny checkpoints are written in
each layout inside the tests; nothing touches the network."""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import char_tokenizer, copied_heads, tiny_model

from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate
from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.heads.files import save_proposal_vocab
from medusa_core.heads.files import HeadsLoadError, load_heads_dir, save_heads
from medusa_core.loading.assets import CPU_DEFAULT_HEADS, CPU_DEFAULT_TREE, cpu_default_backbone
from medusa_core.loading.load import LoadError, check_before_load, default_spec, load
from medusa_core.loading.spec import LoadSpec
from medusa_core.loading.policy import choose_tree, resolve_dtype
from medusa_core.decoding.step import DecodeStep
from medusa_core.training.evaluation import rank_histogram
from medusa_core.decoding.tree import TreeError, build_tree_buffers, resolve_tree

VOCAB = len(char_tokenizer())
HIDDEN = 64   # a multiple of bitsandbytes' 64-value block (see test_nf4_backbone)


class Evil:
    """A pickle payload that would create a directory when unpickled without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def decode(model, heads, tree: str, n: int = 24) -> list[int]:
    buffers = None
    if tree != "baseline":
        paths = resolve_tree(tree)
        buffers = build_tree_buffers(paths, heads.config.num_heads)
    prompt = [1, 40, 41, 42, 43, 44]
    return [t for s in generate(model, prompt, heads=heads, tree=buffers, config=DecodeConfig(max_new_tokens=n)) for t in s.tokens]


def assert_greedy_identical(loaded, n: int = 24, chain: bool = True) -> None:
    base = decode(loaded.model, None, "baseline", n)
    if chain:
        assert decode(loaded.model, loaded.heads, "chain-3", n) == base
    assert decode(loaded.model, loaded.heads, "small-8" if loaded.heads.config.num_heads >= 4 else "chain-2", n) == base


def noisy_heads(model, num_heads=5, own_projection=True, seed=3) -> MedusaHeads:
    """Copied heads with small residual weights: they propose plausible, not always right, tokens."""
    torch.manual_seed(seed)
    c = model.config
    if own_projection:
        heads = copied_heads(model, num_heads)
    else:
        heads = MedusaHeads(HeadsConfig(num_heads, 1, c.hidden_size, c.vocab_size, own_projection=False))
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() == 2 and p.shape[0] == p.shape[1]:
                p.copy_(0.05 * torch.randn_like(p))
    return heads.eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One tiny backbone (saved) and heads written in every layout next to it."""
    root = tmp_path_factory.mktemp("ckpt")
    tok = char_tokenizer()
    model = tiny_model("llama", vocab=len(tok), hidden=HIDDEN)
    model.save_pretrained(root / "backbone")
    tok.save_pretrained(root / "backbone")
    heads = noisy_heads(model)
    state = heads.published_state_dict()
    base = str(root / "backbone")

    # Medusa-1 as published: bf16 pickle, config claiming 2 heads where the file holds 5
    d = root / "medusa1_pt"
    d.mkdir()
    torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, d / "medusa_lm_head.pt")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": base}))

    # Medusa-1 mirror with safetensors, plus a malicious .pt next to it: safetensors must win
    d = root / "medusa1_st"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "medusa_lm_head.safetensors"))
    torch.save({"0.0.linear.weight": Evil(root / "pwned_st")}, d / "medusa_lm_head.pt")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": base}))

    # version 2: residual blocks only, reuse the backbone's lm_head
    d = root / "v2"
    d.mkdir()
    v2 = noisy_heads(model, 4, own_projection=False)
    save_file({k: v.contiguous() for k, v in v2.published_state_dict().items()}, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"version": "2", "medusa_num_heads": 4, "base_model_name_or_path": base}))

    # Medusa-2: a full model whose two safetensors shards also hold medusa_head.* keys
    d = root / "medusa2"
    model.save_pretrained(d, max_shard_size="100KB")
    tok.save_pretrained(d)
    shards = sorted(d.glob("model*.safetensors"))
    assert len(shards) >= 2
    from safetensors.torch import load_file
    last = load_file(str(shards[-1]))
    last.update({f"medusa_head.{k}": v.contiguous() for k, v in state.items()})
    save_file(last, str(shards[-1]), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"medusa_head.{k}": shards[-1].name for k in state})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))

    # the project's own layout
    save_heads(heads, root / "own", base_model=base)
    return root


def test_medusa1_pt_bf16_counts_heads_from_weights(root):
    loaded = load(LoadSpec(heads=str(root / "medusa1_pt"), device="cpu"))   # backbone from base_model_name_or_path
    assert loaded.heads.config.num_heads == 5                                # config said 2
    assert loaded.heads.heads[0][0].linear.weight.dtype == torch.float32     # backbone's compute dtype
    assert_greedy_identical(loaded)
    assert "\n" not in loaded.description and "5 medusa-1 heads" in loaded.description
    assert "RSS" in loaded.memory and loaded.stop_ids == (2,)


def test_a_tree_deeper_than_a_published_config_says_runs_on_the_heads_the_file_holds(root):
    """FasterDecoding's Vicuna heads say medusa_num_heads 2 and hold 5: a local copy of them with --tree of depth 4
    was refused before the load (review), where a hub id's ran; the check before the load trusts only this
    project's own config, which the load checks against the weights."""
    spec = LoadSpec(model=str(root / "backbone"), heads=str(root / "medusa1_pt"), tree="chain-4", device="cpu")
    check_before_load(spec)
    assert load(spec).default_tree == "chain-4"
    own = replace(spec, heads=str(root / "own"), tree="chain-6")       # the own layout holds 5 heads and says so
    with pytest.raises(TreeError, match="tree depth 6 is more than the model's 5 Medusa heads"):
        check_before_load(own)


def test_safetensors_preferred_and_pickle_never_run(root):
    loaded = load(LoadSpec(model=str(root / "backbone"), heads=str(root / "medusa1_st"), device="cpu"))
    assert loaded.heads.config.num_heads == 5
    assert not (root / "pwned_st").exists()
    assert_greedy_identical(loaded)


def test_version2_heads_reuse_lm_head(root):
    loaded = load(LoadSpec(heads=str(root / "v2"), device="cpu"))
    assert not loaded.heads.config.own_projection and loaded.heads.config.num_heads == 4
    assert_greedy_identical(loaded)


def test_medusa2_backbone_and_heads_from_one_repo(root):
    loaded = load(LoadSpec(heads=str(root / "medusa2"), device="cpu"))
    assert loaded.heads.config.num_heads == 5 and "medusa-2" in loaded.description
    ref = load(LoadSpec(model=str(root / "backbone"), heads=str(root / "own"), device="cpu"))
    torch.testing.assert_close(loaded.heads.heads[2][1].weight, ref.heads.heads[2][1].weight)
    assert_greedy_identical(loaded)


def test_a_heads_config_that_is_not_utf8_is_one_line_before_the_load(root, tmp_path):
    """An editor's UTF-16 config.json ended launch's flag check in a traceback (review)."""
    heads = tmp_path / "utf16"
    heads.mkdir()
    (heads / "medusa_lm_head.safetensors").write_bytes((root / "own" / "medusa_lm_head.safetensors").read_bytes())
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 5}), encoding="utf-16")
    with pytest.raises(HeadsLoadError, match=f"^{heads / 'config.json'} is not UTF-8 text \\(byte 0\\): save it as "
                                             "UTF-8 JSON"):
        check_before_load(LoadSpec(model=str(root / "backbone"), heads=str(heads), tree="chain-2", device="cpu"))


def test_own_layout_and_its_config_is_checked(root, tmp_path):
    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu"))
    assert_greedy_identical(loaded)
    bad = tmp_path / "own"
    bad.mkdir()
    (bad / "medusa_lm_head.safetensors").write_bytes((root / "own" / "medusa_lm_head.safetensors").read_bytes())
    config = json.loads((root / "own" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3}))
    with pytest.raises(HeadsLoadError, match="medusa_num_heads=3 but the weights hold 5"):
        load_heads_dir(bad, loaded.model)


def test_nf4_backbone_on_cpu(root):
    # bitsandbytes 0.50 runs NF4 on the CPU; float32 compute keeps the comparison exact enough
    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu", quant="nf4", dtype="float32"))
    import bitsandbytes as bnb

    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    assert "nf4" in loaded.description
    assert_greedy_identical(loaded, n=12, chain=False)   # 4-bit matmuls are slow on CPU: keep it short


def test_a_heads_error_names_the_page_box_with_the_flag(tmp_path):
    """The page shows load errors too: '--heads' alone pointed a page user at a flag they cannot set there."""
    with pytest.raises(LoadError) as refused:
        load(LoadSpec(heads=str(tmp_path), device="cpu"))
    assert "point --heads (the page's Medusa heads box) at" in str(refused.value), refused.value


def test_bitsandbytes_hub_kernel_probe_line_is_not_shown(caplog):
    """bitsandbytes, imported on a CPU with AVX-512 bf16, logs that it failed to fetch a CPU kernel from the
    hub ("pip install kernels"), which nothing here runs: an NF4 start must not open with a failure line.
    Logged by hand, so the test does not depend on this machine's CPU; the logger's other lines still show."""
    import logging

    import medusa_core.quant  # noqa: F401  (every path to bitsandbytes here goes through it)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                       "already `pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        logger.warning("another bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["another bitsandbytes warning"]


def test_heads_quant_nf4(root):
    import bitsandbytes as bnb

    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu", heads_quant="nf4"))
    assert isinstance(loaded.heads.heads[0][1], bnb.nn.Linear4bit)
    assert_greedy_identical(loaded, n=12, chain=False)   # heads only propose: verification keeps the output exact



def test_heads_quant_nf4_runs_the_heads_on_the_kernel_nf4_kernel_names(root, monkeypatch):
    pytest.importorskip("triton", reason="the repacked NF4 kernel needs Triton")
    from medusa_core.quant.nf4_fused import RepackedNF4Linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")         # the kernel on CPU tensors
    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu", heads_quant="nf4", nf4_kernel="repacked"))
    assert all(type(head[-1]) is RepackedNF4Linear for head in loaded.heads.heads)
    assert "; heads: repacked Triton kernel for 5 NF4 projections" in loaded.description, loaded.description


def test_a_load_without_nf4_anywhere_never_imports_bitsandbytes(root):
    """Heads that are not NF4 are not routed (a review found every load with heads importing bitsandbytes: 2 s of a
    CPU start, and a load that failed outright where bitsandbytes is broken)."""
    import subprocess
    import sys

    script = ("import sys\n"
              "from medusa_core.loading.load import load\n"
              "from medusa_core.loading.spec import LoadSpec\n"
              "load(LoadSpec(heads=sys.argv[1], device='cpu'))\n"
              "print('bitsandbytes' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(root / "own")], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stdout


def test_a_tree_tuned_beside_nf4_heads_on_the_repacked_kernel_is_kept_apart(root, monkeypatch):
    """The tuned-tree cache's key names the NF4 heads' kernel where it is not bitsandbytes (until 2026-11-30 their
    only one): a tree tuned with the heads on bitsandbytes does not fit heads 26 µs faster each."""
    pytest.importorskip("triton", reason="the repacked NF4 kernel needs Triton")
    from medusa_core.loading.policy import tuning_mode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu", heads_quant="nf4", nf4_kernel="repacked"))
    spec = LoadSpec(heads=str(root / "own"), device="cpu", heads_quant="nf4")
    mode = json.loads(tuning_mode(spec, loaded.model, "cpu", "none", torch.float32, loaded.heads))
    assert mode["heads_kernel"] == "repacked"
    plain = load(LoadSpec(heads=str(root / "own"), device="cpu", heads_quant="nf4"))      # auto off CUDA: bnb
    assert "heads_kernel" not in json.loads(tuning_mode(spec, plain.model, "cpu", "none", torch.float32, plain.heads))


def test_heads_quant_nf4_on_heads_without_projections_is_refused_before_the_backbone_loads(root, monkeypatch):
    load_module = importlib.import_module("medusa_core.loading.load")

    def no_backbone(*args, **kwargs):
        raise AssertionError("the backbone loaded (minutes for a 7B) before a refusal the heads' files alone show")

    monkeypatch.setattr(load_module, "load_backbone", no_backbone)
    with pytest.raises(LoadError, match="reuse the backbone's lm_head and have no projection to quantize: drop --heads-quant"):
        load(LoadSpec(heads=str(root / "v2"), device="cpu", heads_quant="nf4"))


# ---------------------------------------------------------------- failures, each its own line

def _heads_dir(tmp_path: Path, state: dict, base: str) -> Path:
    d = tmp_path / "heads"
    d.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "medusa_lm_head.safetensors"))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "base_model_name_or_path": base}))
    return d


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_shape_mismatch_names_both_sizes_and_file(root, tmp_path):
    other = tiny_model("llama", vocab=VOCAB, hidden=48)
    d = _heads_dir(tmp_path, copied_heads(other).published_state_dict(), str(root / "backbone"))
    with pytest.raises(HeadsLoadError) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    assert "hidden size 48" in _one_line(err) and "has 64" in str(err.value) and "medusa_lm_head.safetensors" in str(err.value)

    wide = tiny_model("llama", vocab=200, hidden=HIDDEN)
    d = _heads_dir(tmp_path, copied_heads(wide).published_state_dict(), str(root / "backbone"))
    with pytest.raises(HeadsLoadError, match=f"vocabulary size 200 but the backbone has {VOCAB}"):
        load(LoadSpec(heads=str(d), device="cpu"))


def test_missing_key(root, tmp_path):
    state = noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict()
    del state["3.0.linear.bias"]
    d = _heads_dir(tmp_path, state, str(root / "backbone"))
    with pytest.raises(HeadsLoadError) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    assert "missing keys ['3.0.linear.bias']" in _one_line(err)


def test_missing_projections_without_version2(root, tmp_path):
    state = {k: v for k, v in noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict().items()
             if not k.endswith(".1.weight")}
    d = _heads_dir(tmp_path, state, str(root / "backbone"))
    with pytest.raises(HeadsLoadError, match=r"missing keys \['0.1.weight'.*version"):
        load(LoadSpec(heads=str(d), device="cpu"))


def test_unexpected_key(root, tmp_path):
    state = noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict()
    state["0.0.linear.scale"] = torch.ones(3)
    d = _heads_dir(tmp_path, state, str(root / "backbone"))
    with pytest.raises(HeadsLoadError) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    assert "unexpected keys ['0.0.linear.scale']" in _one_line(err)


def test_malicious_pickle_is_refused_and_nothing_runs(root, tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"0.0.linear.weight": Evil(marker)}, d / "medusa_lm_head.pt")
    (d / "config.json").write_text(json.dumps({"base_model_name_or_path": str(root / "backbone")}))
    with pytest.raises(HeadsLoadError) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    assert "refused" in _one_line(err) and "medusa_lm_head.pt" in str(err.value)
    assert not marker.exists()


def test_a_heads_file_that_is_no_torch_file_is_named_for_what_it_is(tmp_path):
    """Review: a Git LFS pointer (a clone without git-lfs: FasterDecoding's heads are .pt files in LFS) and an
    error page saved as the file were refused as pickles that "could run code"; a file cut short raised a bare
    OSError ("[Errno 22] Invalid argument", no file, no fix)."""
    from medusa_core.heads.files import read_heads_file

    whole = tmp_path / "whole.pt"
    torch.save({"0.0.linear.weight": torch.zeros(4, 4)}, whole)
    cases = {
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1349693067\n":
            "is a Git LFS pointer, not the weights (cloned without git-lfs): run `git lfs pull` in its folder, or "
            "download the file again",
        "<!DOCTYPE html><html>rate limited</html>": "is not a torch file (it begins b'<!DOCTYPE html><'): download "
                                                   "it again",
        whole.read_bytes()[:len(whole.read_bytes()) * 2 // 3]: "is not a readable torch file (",
    }
    for i, (content, said) in enumerate(cases.items()):
        for suffix in (".pt", ".safetensors") if i == 0 else (".pt",):
            path = tmp_path / f"medusa_lm_head{i}{suffix}"
            (path.write_text if isinstance(content, str) else path.write_bytes)(content)
            with pytest.raises(HeadsLoadError) as err:
                read_heads_file(path)
            assert str(err.value).startswith(f"{path} {said}") and "\n" not in str(err.value), str(err.value)
    with pytest.raises(HeadsLoadError, match="download it again$"):
        read_heads_file(tmp_path / "medusa_lm_head2.pt")


def test_loads_in_two_threads_at_once_keep_their_tied_weights(tmp_path):
    """A full test run saw the CPU default's lm_head left on the meta device ("Tensor on device meta is not on the
    expected device cpu") when its load overlapped another test's: transformers' from_pretrained is not safe in two
    threads at once, and two loads of a model with tied embeddings left both heads untied on meta (18 of 20 here
    before loads took turns)."""
    import threading

    from medusa_core.loading.load import load_backbone

    tok = char_tokenizer()
    model = tiny_model("llama", vocab=len(tok), hidden=HIDDEN)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    untied = []

    def load_some() -> None:
        for _ in range(5):
            loaded, _ = load_backbone(str(tmp_path), "cpu", "none", torch.float32)
            head = loaded.get_output_embeddings().weight
            untied.append(head.device.type == "meta" or head is not loaded.get_input_embeddings().weight)

    threads = [threading.Thread(target=load_some) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(untied) == 10 and not any(untied), untied


def test_missing_heads_file(root, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"base_model_name_or_path": str(root / "backbone")}))
    with pytest.raises(HeadsLoadError) as err:
        load(LoadSpec(heads=str(tmp_path), device="cpu"))
    assert "has no medusa_lm_head.safetensors" in _one_line(err)


def test_nonexistent_paths(root, tmp_path):
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model=str(tmp_path / "nope"), device="cpu"))
    assert "does not exist" in _one_line(err)
    with pytest.raises(LoadError, match="has no config.json"):
        load(LoadSpec(model=str(tmp_path), device="cpu"))
    with pytest.raises(LoadError, match="no backbone is named for these heads \\(base_model_name_or_path in a "
                                        "config.json beside them\\): name it \\(--model"):
        d = _heads_dir(tmp_path, noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict(), "")
        (d / "config.json").write_text("{}")
        load(LoadSpec(heads=str(d), device="cpu"))
    # a backbone the heads name that is not there (train wrote the --model path as typed, relative to where it
    # ran): said as theirs, with the way to name another; one typed with --model is said as it was
    (d / "config.json").write_text(json.dumps({"base_model_name_or_path": "./out/backbone"}))
    with pytest.raises(LoadError) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    said = _one_line(err)
    assert said.startswith("./out/backbone does not exist") and said.endswith(
        f"(the backbone the heads in {d / 'medusa_lm_head.safetensors'} name as their base_model_name_or_path: name "
        "another with --model, or the page's backbone box)"), said
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model="./out/backbone", heads=str(d), device="cpu"))
    assert "base_model_name_or_path" not in _one_line(err)


def test_a_heads_folder_given_as_the_backbone_is_said_so(tmp_path):
    """QA: ``--model HEADS_DIR`` (an easy slip) ended in transformers' tokenizer error asking for sentencepiece."""
    d = _heads_dir(tmp_path, noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict(),
                   "owner/base")
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model=str(d), device="cpu"))
    assert _one_line(err) == (f"{d} holds Medusa heads, not a backbone: give it as --heads (the page's Medusa heads "
                              "box), where alone it loads its base model, owner/base")


def test_a_file_given_for_a_folder_is_told_what_the_folder_holds(tmp_path):
    """QA: a heads file given as --heads was told to give the folder of a backbone (config.json and weights)."""
    d = _heads_dir(tmp_path, noisy_heads(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN)).published_state_dict(),
                   "owner/base")
    weights = d / "medusa_lm_head.safetensors"
    for spec, holds in ((LoadSpec(heads=str(weights), device="cpu"), "config.json and medusa_lm_head.safetensors"),
                        (LoadSpec(model=str(weights), device="cpu"), "config.json and weights")):
        with pytest.raises(LoadError) as err:
            load(spec)
        assert _one_line(err) == f"{weights} is a file: give the directory that holds it ({holds})"


def test_a_directory_that_is_not_a_model_gets_local_advice(root, tmp_path):
    """A local directory whose config names no model: the hint is about the directory, not the hub."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model=str(tmp_path), device="cpu"))
    line = _one_line(err)
    assert "check that the directory holds a transformers model" in line and "hf download" not in line


def test_a_model_folder_without_its_tokenizer_says_so(tmp_path):
    """CLI QA: transformers asked for sentencepiece or tiktoken, to convert a tokenizer that was not there."""
    tiny_model().save_pretrained(tmp_path / "no_tokenizer")
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model=str(tmp_path / "no_tokenizer"), device="cpu"))
    assert _one_line(err) == (f"{tmp_path / 'no_tokenizer'} has no tokenizer files (tokenizer.json, "
                              "tokenizer_config.json, tokenizer.model, vocab.json): save the model's tokenizer into "
                              "that folder too (tokenizer.save_pretrained)")


def sentencepiece_model_dir(directory: Path, weights: bool = True) -> Path:
    """A model laid out as lmsys/vicuna-7b-v1.3 is: its tokenizer only a SentencePiece tokenizer.model, no
    tokenizer.json, and no chat template (the vicuna prompt)."""
    import io

    import sentencepiece

    text = ["A chat between a curious user and an artificial intelligence assistant.",
            "USER: What is the capital of France? ASSISTANT: The capital of France is Paris."] * 40
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=64,
                                             model_type="bpe", unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    directory.mkdir(parents=True)
    if weights:
        tiny_model("llama", vocab=64).save_pretrained(directory)
    else:
        (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "legacy": False}))
    return directory


def test_a_sentencepiece_tokenizer_like_the_cuda_defaults_loads(tmp_path):
    """Review: vicuna v1.3 ships only tokenizer.model; transformers 5 reads it only with sentencepiece and protobuf,
    which no requirement installed, so the product's default model failed after its 13 GB download."""
    loaded = load(LoadSpec(model=str(sentencepiece_model_dir(tmp_path / "vicuna")), device="cpu"))
    ids = loaded.tokenizer("The capital of France is Paris.").input_ids
    assert ids[0] == 1 and loaded.tokenizer.decode(ids, skip_special_tokens=True) == "The capital of France is Paris."
    assert 2 in loaded.stop_ids                                   # </s> ends a turn


def test_a_tokenizer_that_cannot_be_read_fails_before_the_model_loads_and_names_the_packages(tmp_path):
    """Without sentencepiece transformers says "`tiktoken` is required", which names neither package; and the
    tokenizer is read first, so the error comes in seconds, not after the weights (here: there are none)."""
    import subprocess
    import sys

    directory = sentencepiece_model_dir(tmp_path / "vicuna", weights=False)
    script = ("import sys; sys.modules['sentencepiece'] = None\n"
              "from medusa_core.loading.load import LoadError, load\n"
              "from medusa_core.loading.spec import LoadSpec\n"
              f"try:\n    load(LoadSpec(model={str(directory)!r}, device='cpu'))\n"
              "except LoadError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    line = done.stdout.strip()
    assert line.startswith(f"{directory}: could not load the model") and line.endswith(
        "its tokenizer is a SentencePiece tokenizer.model: pip install sentencepiece protobuf (requirements.txt "
        "lists both) to read it"), done.stdout + done.stderr[-2000:]


def test_damaged_weights_are_one_line_that_says_so(root, tmp_path):
    """A weights file cut short by an interrupted copy, or weights that config.json does not describe: a
    LoadError naming the directory and the fix (they escaped the loader's errors, and a page load of
    either stayed "loading" for good)."""
    import shutil

    cut, wrong = tmp_path / "cut", tmp_path / "wrong"
    shutil.copytree(root / "backbone", cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    shutil.copytree(root / "backbone", wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    for directory in (cut, wrong):
        with pytest.raises(LoadError) as err:
            load(LoadSpec(model=str(directory), device="cpu"))
        line = _one_line(err)
        assert line.startswith(f"{directory}: could not load the model") and \
            "damaged or does not match its config.json: copy or download it again" in line, line


def test_a_gpu_smaller_than_the_cuda_defaults_weights_is_told_before_the_download(monkeypatch):
    """A 4 GB laptop GPU downloaded Vicuna-7B (15 GB), then ran out of memory, and the fix never named the CPU
    (review): a GPU with less memory in all than the default's weights is told so first, by launch.py and by the
    load itself (the page's Load of the default)."""
    from types import SimpleNamespace

    import medusa_core.loading.load as load_module

    monkeypatch.setattr(load_module, "resolve_device", lambda device: "cuda:0")
    memory = {}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=memory["gb"] * 1e9))
    memory["gb"] = 4.0
    for check in (check_before_load, load):
        with pytest.raises(LoadError, match="^this GPU has 4.0 GB, and the CUDA default, lmsys/vicuna-7b-v1.3 in 4 "
                                            "bits with its Medusa heads, needs 5.4 GB for its weights alone: run "
                                            "--device cpu for SmolLM2-135M-Instruct, or give a smaller --model$"):
            check(LoadSpec(device="cuda"))
    memory["gb"] = 5.0
    with pytest.raises(LoadError, match="SmolLM2-135M-Instruct \\(or --heads-quant nf4, whose load needs 4.8 GB\\)"):
        check_before_load(LoadSpec(device="cuda"))
    check_before_load(LoadSpec(device="cuda", heads_quant="nf4"))
    memory["gb"] = 8.0
    check_before_load(LoadSpec(device="cuda"))


def test_a_folder_that_shadows_a_hub_id_is_named_as_the_cause(tmp_path, monkeypatch):
    """A folder in the working directory named as a hub id is read instead of the hub: one without config.json
    was told to give "a hub id", which the user had given (review)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lmsys" / "vicuna-7b-v1.3").mkdir(parents=True)
    with pytest.raises(LoadError, match=f"^lmsys/vicuna-7b-v1.3 is a hub id, and a folder of that name here, "
                                        f"{re.escape(str(tmp_path))}/lmsys/vicuna-7b-v1.3, holds no config.json"):
        check_before_load(LoadSpec(model="lmsys/vicuna-7b-v1.3", device="cpu"))
    with pytest.raises(LoadError, match="has no config.json: give a directory written by save_pretrained"):
        check_before_load(LoadSpec(model="./lmsys/vicuna-7b-v1.3", device="cpu"))


def test_a_fault_that_is_no_damaged_file_is_not_called_one(root, monkeypatch, capsys):
    """A CUDA or driver fault while loading (bitsandbytes on a GPU it has no kernels for) was told to download
    the weights again (review): the console has the traceback, the line says so."""
    from transformers import AutoModelForCausalLM

    def faulty(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", faulty)
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model=str(root / "backbone"), device="cpu"))
    line = _one_line(err)
    assert line.endswith("no kernel image is available for execution on the device): the console has the details")
    assert "download it again" not in line and "Traceback" in capsys.readouterr().err


def test_out_of_memory_while_loading_is_not_called_a_damaged_file(root, monkeypatch):
    """torch.OutOfMemoryError is a RuntimeError: it reaches the app as itself (which says how to fit the
    model), not as a damaged weights file to download again."""
    from transformers import AutoModelForCausalLM

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        load(LoadSpec(model=str(root / "backbone"), device="cpu"))


def test_a_tree_for_a_model_without_heads_is_said_to_go_unused(root):
    loaded = load(LoadSpec(model=str(root / "backbone"), device="cpu", tree="chain-2"))
    assert loaded.default_tree == "baseline"
    assert loaded.tree_note == ("--tree chain-2 is not used: this model has no Medusa heads, so it runs plain "
                                "decoding (add --heads)")
    assert load(LoadSpec(model=str(root / "backbone"), device="cpu")).tree_note == ""


def test_a_tree_the_heads_cannot_run_keeps_the_model_and_says_so(root):
    """--tree deeper than the heads: the model that loaded is kept with the tree it gets without --tree, and the
    line says --tree's part (the load failed: the model was thrown away, leaving none)."""
    without = load(LoadSpec(heads=str(root / "own"), device="cpu"))
    loaded = load(LoadSpec(heads=str(root / "own"), device="cpu", tree="chain-9"))
    assert loaded.default_tree == without.default_tree
    assert loaded.tree_note == ("--tree chain-9 cannot run with these heads (tree depth 9 is more than the model's 5 "
                                f"Medusa heads: use a tree of depth <= 5); instead: {without.tree_note}")


def test_bad_options():
    with pytest.raises(LoadError, match="quant 'q3' is unknown"):
        load(LoadSpec(model="x/y", device="cpu", quant="q3"))
    with pytest.raises(LoadError, match="dtype 'fp8' is unknown"):
        load(LoadSpec(model="x/y", device="cpu", dtype="fp8"))


# ---------------------------------------------------------------- hub path, offline

@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _cache_repo(cache: Path, repo_id: str, src: Path) -> None:
    """Lay out ``src`` the way huggingface_hub caches a downloaded repo."""
    commit = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())


def test_hub_ids_from_the_cache_offline(root, offline_cache):
    _cache_repo(offline_cache, "tiny/backbone", root / "backbone")
    _cache_repo(offline_cache, "tiny/medusa-heads", root / "medusa1_pt")
    cfg = offline_cache / "models--tiny--medusa-heads" / "snapshots" / ("0" * 40) / "config.json"
    cfg.write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "tiny/backbone"}))
    loaded = load(LoadSpec(heads="tiny/medusa-heads", device="cpu"))
    assert loaded.heads.config.num_heads == 5 and "tiny/backbone" in loaded.description
    assert_greedy_identical(loaded)


def test_hub_heads_cut_short_offline_and_a_backbone_given_as_heads_are_said_before_any_shard(root, offline_cache,
                                                                                              monkeypatch, tmp_path):
    """Offline, a heads repo whose download stopped after its config.json was told it has no heads (review); a
    backbone's hub id given as the heads downloaded every shard (13.5 GB for lmsys/vicuna-7b-v1.3) before it was
    refused, where its shard index shows no medusa_head.* weights (review)."""
    import medusa_core.loading.load as load_module

    cut = tmp_path / "cut_heads"
    cut.mkdir()
    (cut / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "base_model_name_or_path": "tiny/backbone"}))
    _cache_repo(offline_cache, "tiny/cut-heads", cut)
    with pytest.raises(LoadError, match="^tiny/cut-heads: its heads' weights are not in the local cache and the hub "
                                        "cannot be reached: download them"):
        load(LoadSpec(heads="tiny/cut-heads", device="cpu"))
    plain = tmp_path / "plain_index"
    plain.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        (plain / name).write_bytes((root / "medusa2" / name).read_bytes())
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("medusa_head.")}
    (plain / "model.safetensors.index.json").write_text(json.dumps(index))
    _cache_repo(offline_cache, "tiny/plain-sharded", plain)
    monkeypatch.setattr(load_module, "fetch_snapshot", lambda *a: pytest.fail("the shards were fetched"))
    with pytest.raises(LoadError, match="^tiny/plain-sharded holds a full model without medusa_head"):
        load(LoadSpec(model="tiny/backbone", heads="tiny/plain-sharded", device="cpu"))


def test_a_backbone_larger_than_this_machines_memory_is_refused_before_its_shards(offline_cache, tmp_path, monkeypatch):
    """The Vicuna-7B entry picked on a CPU machine would load 27 GB of fp32 weights: where that is more than the
    machine has, the OS killed the app mid-load (every open chat with it). Said from the shard index first."""
    import transformers

    import medusa_core.loading.policy as policy

    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    (big / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 13_476_839_424},
                                                                  "weight_map": {}}))
    _cache_repo(offline_cache, "tiny/big", big)
    monkeypatch.setattr(policy, "machine_memory", lambda: 16e9)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: pytest.fail("the weights were loaded"))
    for name in ("tiny/big", str(big)):
        with pytest.raises(LoadError, match=f"^{re.escape(name)}: its weights take 27.0 GB in float32 on the CPU, "
                                            "more than this machine's 16.0 GB of memory: load it on a CUDA GPU "
                                            r"\(in 4 bits\), or pick a smaller model \(SmolLM2-135M-Instruct runs "
                                            r"here\)$"):
            load(LoadSpec(model=name, device="cpu"))
    # in bfloat16 it fits: the load goes on (to the weights, here none)
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model="tiny/big", device="cpu", dtype="bfloat16"))
    assert "memory" not in str(err.value), err.value


def test_hub_medusa2_from_the_cache_offline(root, offline_cache):
    _cache_repo(offline_cache, "tiny/medusa2", root / "medusa2")
    loaded = load(LoadSpec(heads="tiny/medusa2", device="cpu"))
    assert loaded.heads.config.num_heads == 5


def test_an_unreachable_hub_is_read_from_the_cache_without_waiting_on_it(root, tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE, a hub that cannot be reached made huggingface_hub retry each request for
    ~23 s before it read its cache, once per file a repo may lack (here the heads' safetensors, before
    the .pt). Unreachable, every request is cache-only, and a repo not cached is the one-line error."""
    import huggingface_hub
    from huggingface_hub import constants

    from medusa_core.loading import hub

    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")      # nothing listens: refused
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "_probed", None)
    asked = []
    real = huggingface_hub.hf_hub_download

    def spy(*args, local_files_only=False, **kwargs):
        asked.append(local_files_only)
        return real(*args, local_files_only=local_files_only, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    _cache_repo(tmp_path / "hub", "tiny/backbone", root / "backbone")
    _cache_repo(tmp_path / "hub", "tiny/medusa-heads", root / "medusa1_pt")
    loaded = load(LoadSpec(model="tiny/backbone", heads="tiny/medusa-heads", device="cpu"))
    assert loaded.heads.config.num_heads == 5
    assert asked and all(asked), "a request went to the unreachable hub"
    with pytest.raises(LoadError, match="not in the local cache and the hub cannot be reached"):
        load(LoadSpec(model="someone/not-cached", device="cpu"))


def test_offline_missing_model_is_one_line(offline_cache):
    with pytest.raises(LoadError) as err:
        load(LoadSpec(heads="FasterDecoding/medusa-vicuna-7b-v1.3", device="cpu"))
    assert "hf download FasterDecoding/medusa-vicuna-7b-v1.3" in _one_line(err)
    with pytest.raises(LoadError) as err:
        load(LoadSpec(model="lmsys/vicuna-7b-v1.3", device="cpu"))
    assert "hf download lmsys/vicuna-7b-v1.3" in _one_line(err)
    assert "there is no folder" not in _one_line(err)


def test_a_local_path_typed_wrong_is_said_before_the_hub(offline_cache, tmp_path, monkeypatch):
    """out/heds (for out/heads) reads as a hub id: the error spoke of the hub and `hf download` only (review)."""
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoadError) as err:
        load(LoadSpec(heads="out/heds", device="cpu"))
    assert _one_line(err).startswith("there is no folder out/heds (though out is one: check the path); out/heds is "
                                     "not in the local cache"), _one_line(err)


# ---------------------------------------------------------------- defaults

def test_default_spec_and_tree_table():
    assert default_spec("cpu") == LoadSpec(model=str(cpu_default_backbone()), heads=str(CPU_DEFAULT_HEADS), device="cpu")
    assert default_spec("cuda").heads == "FasterDecoding/medusa-vicuna-7b-v1.3"
    heads5 = MedusaHeads(HeadsConfig(5, 1, 8, 16))
    assert choose_tree("FasterDecoding/medusa-vicuna-7b-v1.3", heads5, "cpu", False) == "mc_sim_7b_63"
    assert choose_tree("FasterDecoding/medusa-vicuna-13b-v1.3", heads5, "cuda", False) == "mc_sim_7b_63"
    # no substring guessing: a look-alike id gets the device-sized preset
    assert choose_tree("someone/medusa-vicuna-7b-v1.3-copy", heads5, "cpu", False) == "small-16"
    assert choose_tree("x/y", heads5, "cuda", False) == "mc_sim_7b_63"
    # over a 4-bit backbone on CUDA every verified row costs: the 64-node tree's best 16 nodes
    assert choose_tree("FasterDecoding/medusa-vicuna-7b-v1.3", heads5, "cuda", False, "nf4") == "mc_sim_7b_16"
    assert choose_tree("x/y", heads5, "cuda", False, "nf4") == "mc_sim_7b_16"
    # fewer heads over NF4: still a small tree (3 heads were given a 103-node one, bigger than any tree timed)
    for n, nf4, bf16 in ((3, "mc_sim_7b_16", "cartesian-6x4x3"), (2, "cartesian-4x2", "cartesian-6x4"),
                         (1, "cartesian-4", "cartesian-6")):
        heads = MedusaHeads(HeadsConfig(n, 1, 8, 16))
        got = (choose_tree("x/y", heads, "cuda", False, "nf4"), choose_tree("x/y", heads, "cuda", False))
        assert got == (nf4, bf16), got
        assert len(resolve_tree(nf4)) + 1 <= 16 and build_tree_buffers(resolve_tree(nf4), n).num_heads <= n
    assert choose_tree("FasterDecoding/medusa-vicuna-7b-v1.3", heads5, "cpu", False, "nf4") == "mc_sim_7b_63"
    assert choose_tree("x/y", MedusaHeads(HeadsConfig(3, 1, 8, 16)), "cpu", False) == "chain-3"
    assert choose_tree(None, None, "cpu", False) == "baseline"
    # the bundled heads come with their calibrated tree, on any device
    assert choose_tree(str(CPU_DEFAULT_HEADS), heads5, "cpu", True) == str(CPU_DEFAULT_TREE)
    assert choose_tree(str(CPU_DEFAULT_HEADS), heads5, "cuda", True, "nf4") == str(CPU_DEFAULT_TREE)


def test_bundled_heads_alone_load_the_local_smollm2():
    """Their config names the hub id HuggingFaceTB/SmolLM2-135M-Instruct; offline, its converted copy serves."""
    loaded = load(LoadSpec(heads=str(CPU_DEFAULT_HEADS), device="cpu"))
    assert loaded.cpu_default and loaded.description.startswith("SmolLM2-135M-Instruct")
    assert "assets/smollm2/heads" in loaded.description and loaded.tuned is not None


def test_a_copy_of_the_bundled_heads_loads_the_local_smollm2(tmp_path, monkeypatch, default_loaded):
    """Other heads made for SmolLM2 (here a copy of the bundled ones) name its hub id too: with SmolLM2
    converted here, the local copy serves, with the network cut off (they were looked for on the hub)."""
    import shutil
    import socket

    copy = tmp_path / "heads"
    shutil.copytree(CPU_DEFAULT_HEADS, copy)

    def no_network(*args, **kwargs):
        raise OSError("the network is cut off in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    loaded = load(LoadSpec(heads=str(copy), device="cpu"))
    assert loaded.description.startswith("SmolLM2-135M-Instruct") and str(copy) in loaded.description


def test_heads_quant_refuses_a_broken_quantization(monkeypatch):
    # bitsandbytes 0.50.2 mis-scales some row widths on some CPUs (hidden 48 on an AVX-512 one, not on an
    # AVX2 one): the self-check must catch such a quantization, not decode with it. The test breaks the
    # quantization itself, so it fails the same way on every CPU.
    import bitsandbytes as bnb

    from medusa_core.heads.quantize import quantize_projections

    model = tiny_model("llama", vocab=VOCAB, hidden=64)
    quantize_projections(noisy_heads(model), torch.float32)     # quantized right: accepted
    real = bnb.functional.quantize_4bit

    def mis_scaled(*args, **kwargs):
        packed, state = real(*args, **kwargs)
        (state.state2.absmax if state.nested else state.absmax).mul_(1.5)   # every block's scale off by half
        return packed, state

    monkeypatch.setattr(bnb.functional, "quantize_4bit", mis_scaled)
    with pytest.raises(HeadsLoadError, match="quantized a .* projection wrongly.*drop --heads-quant"):
        quantize_projections(noisy_heads(model), torch.float32)


def test_a_proposal_vocab_restricts_the_guesses_and_never_the_output(root, tmp_path):
    """proposal_vocab.json beside version-2 heads: they guess only among its tokens, their guesses
    are the full-vocabulary ranking with every other token left out, and greedy output stays the
    baseline's."""
    d = tmp_path / "v2_vocab"
    d.mkdir()
    for name in ("medusa_lm_head.safetensors", "config.json"):
        (d / name).write_bytes((root / "v2" / name).read_bytes())
    keep = list(range(VOCAB - 1, 2, -2))                 # every other token, highest id first
    save_proposal_vocab(d, keep, {"about": "test"})
    loaded = load(LoadSpec(heads=str(d), device="cpu"))
    heads, lm_head = loaded.heads, loaded.model.get_output_embeddings()
    assert heads.proposal_vocab_size == len(keep)
    hidden = torch.randn(3, HIDDEN)
    guesses = heads.guesses(hidden, lm_head, top_k=4)                    # (K, 3, 4)
    masked = heads(hidden, lm_head).clone()                              # (K, 3, V)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    masked[..., outside] = float("-inf")
    assert torch.equal(guesses, torch.topk(masked, 4, dim=-1).indices)
    full = load(LoadSpec(heads=str(root / "v2"), device="cpu")).heads
    assert full.proposal_vocab_size is None
    assert torch.equal(full.guesses(hidden, lm_head, 4), torch.topk(full(hidden, lm_head), 4, dim=-1).indices)

    proposed = []                                      # what the decoding step writes as the next tree
    propose = DecodeStep.propose
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeStep, "propose", lambda self, root, row: proposed.append(propose(self, root, row)) or proposed[-1])
        assert_greedy_identical(loaded)
    guessed = torch.cat([tree[1:] for tree in proposed]).tolist()       # node 0 is the backbone's own token
    assert guessed and set(guessed) <= set(keep)

    # calibrate's accuracies rank the same guesses: targets outside the vocabulary are never hit
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    counts = rank_histogram(heads, loaded.model, [(ids, torch.full_like(ids, 4))], top_k=3)   # 4 is not in keep
    assert counts[:, :3].sum() == 0 and counts[:, 3].tolist() == [8 - k - 2 for k in range(heads.config.num_heads)]
    with pytest.raises(ValueError, match="top 9 guesses but the proposal vocabulary holds 2 tokens"):
        heads.restrict_proposals(torch.tensor([5, 7]), lm_head)
        heads.guesses(hidden, lm_head, top_k=9)


@pytest.mark.parametrize("content, message", [
    ('{"ids": [1, 2]}', 'is not {"token_ids": \\[...\\]}'),
    ('{"token_ids": 5}', "token_ids is '5', not a list"),
    ('{"token_ids": [3, 4, 3]}', "holds 3, a repeat"),
    ('{"token_ids": [3, "a"]}', "holds 'a', not a token id"),
    ('{"token_ids": [3, 100000]}', "outside the backbone's vocabulary"),
])
def test_a_broken_proposal_vocab_is_one_line(root, tmp_path, content, message):
    d = tmp_path / "v2_bad"
    d.mkdir()
    for name in ("medusa_lm_head.safetensors", "config.json"):
        (d / name).write_bytes((root / "v2" / name).read_bytes())
    (d / "proposal_vocab.json").write_text(content)
    with pytest.raises(HeadsLoadError, match=message) as err:
        load(LoadSpec(heads=str(d), device="cpu"))
    assert "\n" not in str(err.value) and "proposal_vocab.json" in str(err.value)


def test_a_proposal_vocab_needs_heads_that_share_the_lm_head(root, tmp_path):
    d = tmp_path / "own_vocab"
    d.mkdir()
    for name in ("medusa_lm_head.safetensors", "config.json"):
        (d / name).write_bytes((root / "own" / name).read_bytes())
    save_proposal_vocab(d, [3, 4, 5], {})
    with pytest.raises(HeadsLoadError, match="share the backbone's lm_head"):
        load(LoadSpec(heads=str(d), device="cpu"))


def test_proposals_keep_the_lm_heads_bias():
    """An lm_head with a bias (Phi-2 has one): restricted guesses rank exactly as the full
    projection does with the other tokens left out."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50)
    heads = MedusaHeads(HeadsConfig(2, 1, 16, 50, own_projection=False)).eval()
    with torch.no_grad():
        lm_head.bias.mul_(40)                           # large enough to reorder the guesses
    keep = torch.arange(0, 50, 3)
    hidden = torch.randn(4, 16)
    masked = heads(hidden, lm_head).clone()
    outside = torch.ones(50, dtype=torch.bool)
    outside[keep] = False
    masked[..., outside] = float("-inf")
    heads.restrict_proposals(keep, lm_head)
    assert torch.equal(heads.guesses(hidden, lm_head, top_k=3), torch.topk(masked, 3, dim=-1).indices)


def test_a_gpu_without_bf16_arithmetic_computes_in_fp16(monkeypatch):
    """Review: is_bf16_supported() is True on an RTX 20xx or a T4 by emulation, so they got emulated bf16; and it
    asked the current GPU, not the one named."""
    asked = []
    capabilities = {0: (7, 5), 1: (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or capabilities[torch.device(device).index or 0])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: True)
    assert resolve_dtype("auto", "cuda:0") == torch.float16
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32 and len(asked) == 2


def test_a_gpu_index_past_the_gpus_there_is_said_in_one_line(monkeypatch):
    """Review: --device cuda:3 on a 2-GPU machine ended in torch's "AssertionError: Invalid device id"."""
    from medusa_core.loading.policy import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cuda") == "cuda"
    with pytest.raises(LoadError, match=r"^device 'cuda:3' is not here: torch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1$"):
        resolve_device("cuda:3")


def test_memory_is_freed_only_outside_another_threads_graph_capture(monkeypatch):
    """torch.cuda.empty_cache asserts that no CUDA graph is being recorded, and a collection during a capture
    invalidates it: an Unload or an out-of-memory answer beside another tab's first step did both (review).
    free_memory waits for the capture to end."""
    import threading

    from medusa_core.decoding import graphs
    from medusa_core.loading import memory

    ran = []
    monkeypatch.setattr(memory.gc, "collect", lambda: ran.append("collect"))
    with graphs._CAPTURES:                 # a capture in progress in another thread (graphs.capturing)
        graphs._capturing += 1
    try:
        # what the out-of-memory answer drops (every KV cache and its graphs) waits too (review)
        freeing = threading.Thread(target=lambda: memory.free_memory(drop=lambda: ran.append("drop")))
        freeing.start()
        freeing.join(0.5)
        assert freeing.is_alive() and ran == [], "freed during the capture"
        assert not graphs.outside_captures(lambda: ran.append("other"), timeout=0.1)   # gives up, and says so
    finally:
        with graphs._CAPTURES:             # the capture ends, as graphs.capturing's exit does
            graphs._capturing -= 1
            graphs._NO_CAPTURE.notify_all()
    freeing.join(10)
    assert not freeing.is_alive() and ran == ["drop", "collect"]
