"""Export writes heads the way serving engines read them; read each back as that engine
would (key names, shapes, config fields) and check the numbers survive."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn
from tiny import char_tokenizer, tiny_model

from medusa_core.export import main
from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.heads.files import load_heads_dir, save_heads
from medusa_core.loading.load import LoadError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tok = char_tokenizer()
    model = tiny_model("llama", vocab=len(tok), hidden=32)
    model.save_pretrained(root / "backbone")
    tok.save_pretrained(root / "backbone")
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(3, 2, 32, len(tok))).eval()     # 2 blocks: checks block numbering
    save_heads(heads, root / "heads", base_model=str(root / "backbone"))
    v2 = MedusaHeads(HeadsConfig(3, 1, 32, len(tok), own_projection=False)).eval()
    save_heads(v2, root / "v2", base_model=str(root / "backbone"))
    return root, model, heads, v2


def keys_and_shapes(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_tgi_layout_reads_back(setup, tmp_path):
    root, model, heads, _ = setup
    assert main(["--heads", str(root / "heads"), "--out", str(tmp_path), "--format", "tgi", "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    # TGI: medusa_num_heads marks a Medusa repo; an "architectures" field would make it an MLP speculator
    assert "architectures" not in config
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
    assert config["base_model_name_or_path"] == str(root / "backbone")
    shapes = keys_and_shapes(tmp_path / "medusa_lm_head.safetensors")
    expected = {}
    for h in range(3):   # what TGI's MedusaHead loads: prefix {h}.{l}.linear for blocks, {h}.{L} for the projection
        for l in range(2):
            expected[f"{h}.{l}.linear.weight"] = (32, 32)
            expected[f"{h}.{l}.linear.bias"] = (32,)
        expected[f"{h}.2.weight"] = (model.config.vocab_size, 32)
    assert shapes == expected
    back = load_heads_dir(tmp_path, model)        # round trip through our own loader
    for k, v in heads.published_state_dict().items():
        torch.testing.assert_close(back.published_state_dict()[k], v.to(torch.bfloat16).float())


class VllmMedusa(nn.Module):
    """The parameter layout of vLLM's Medusa draft model, built from its config the way it is."""

    def __init__(self, c: dict):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Module() for _ in range(c["num_heads"])
        )
        for block in self.blocks:
            block.layers = nn.ModuleList(
                nn.Linear(c["hidden_size"], c["hidden_size"], bias=c.get("medusa_fc_bias", False))
                for _ in range(c["num_hidden_layers"])
            )
        if c.get("original_lm_head", False):
            self.lm_head = nn.Linear(c["hidden_size"], c["truncated_vocab_size"], bias=False)
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(c["hidden_size"], c["truncated_vocab_size"], bias=False) for _ in range(c["num_heads"])
            )
        self.c = c
        self.token_map = None     # below vocab_size, the checkpoint's token_map: the tokens the heads guess among

    def forward(self, x):
        outs = []
        for h, block in enumerate(self.blocks):
            y = x
            for layer in block.layers:
                y = y + nn.functional.silu(layer(y))
            logits = (self.lm_head if self.c.get("original_lm_head") else self.lm_heads[h])(y)
            if self.token_map is not None:      # vLLM's compute_logits: -inf outside the token map
                full = torch.full((*logits.shape[:-1], self.c["vocab_size"]), float("-inf"))
                full[..., self.token_map] = logits
                logits = full
            outs.append(logits)
        return torch.stack(outs)


def _load_vllm(directory) -> VllmMedusa:
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    module = VllmMedusa(config)
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    # vLLM's load_weights: a token_map only below vocab_size, and projections longer than it are sliced to it
    token_map = state.pop("token_map", None)
    assert (token_map is not None) == (config["truncated_vocab_size"] < config["vocab_size"])
    if token_map is not None:
        assert token_map.dtype == torch.long and len(token_map) == config["truncated_vocab_size"]
        module.token_map = token_map
        state = {k: v[token_map] if "lm_head" in k and v.shape[0] > len(token_map) else v for k, v in state.items()}
    module.load_state_dict(state, strict=True)
    return module


def test_vllm_layout_reads_back(setup, tmp_path):
    root, model, heads, _ = setup
    assert main(["--heads", str(root / "heads"), "--out", str(tmp_path)]) == 0    # both formats
    assert (tmp_path / "tgi" / "medusa_lm_head.safetensors").is_file()
    # readable as the config beside it is (safetensors writes 0600: a container or another user could not read it)
    for folder, weights in (("tgi", "medusa_lm_head.safetensors"), ("vllm", "model.safetensors")):
        assert (tmp_path / folder / weights).stat().st_mode & 0o777 == (tmp_path / folder / "config.json").stat().st_mode & 0o777
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"]) == (3, 2, 32)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    vllm = _load_vllm(tmp_path / "vllm")
    x = torch.randn(4, 32)
    torch.testing.assert_close(vllm(x), heads(x, model.lm_head))
    # given back to this app as heads, it is named for what it is (it read as a Medusa-2 model without heads)
    with pytest.raises(LoadError, match="is a vLLM Medusa draft \\(export --format vllm\\), which this app does "
                                        "not read: give the heads it was exported from, or the export's tgi folder"):
        load_heads_dir(tmp_path / "vllm", model)


def test_vllm_version2_heads_carry_the_backbone_lm_head(setup, tmp_path):
    root, model, _, v2 = setup
    assert main(["--heads", str(root / "v2"), "--out", str(tmp_path), "--format", "vllm", "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["original_lm_head"] is True
    vllm = _load_vllm(tmp_path)
    x = torch.randn(4, 32)
    torch.testing.assert_close(vllm(x), v2(x, model.lm_head))

    assert main(["--heads", str(root / "v2"), "--out", str(tmp_path / "tgi"), "--format", "tgi"]) == 0
    tgi = json.loads((tmp_path / "tgi" / "config.json").read_text())
    assert tgi["version"] == "2" and tgi["medusa_num_layers"] == 1   # TGI's MedusaHeadV2 needs one block


def test_a_proposal_vocabulary_is_vllms_token_map_and_said_for_tgi(setup, tmp_path, capsys):
    """Heads trained to guess among a proposal vocabulary (proposal_vocab.json) were exported as full-vocabulary
    heads without a word: vLLM takes the vocabulary as its token_map, and TGI, which has none, is said."""
    import shutil

    root, model, _, v2 = setup
    ids = [5, 2, 9, 7]
    shutil.copytree(root / "v2", tmp_path / "v2vocab")
    (tmp_path / "v2vocab" / "proposal_vocab.json").write_text(json.dumps({"token_ids": ids}))
    capsys.readouterr()
    assert main(["--heads", str(tmp_path / "v2vocab"), "--out", str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    said = capsys.readouterr().out
    assert "note: TGI has no proposal vocabulary: there these heads guess among the whole vocabulary, not the 4 " \
           "tokens of proposal_vocab.json" in said, said
    config = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert (config["vocab_size"], config["truncated_vocab_size"]) == (model.config.vocab_size, 4)
    vllm = _load_vllm(tmp_path / "out" / "vllm").float()
    x = torch.randn(4, 32)
    logits = vllm(x)                                                       # (heads, 4, vocab)
    # the weights as exported (bf16), on copies: the fixture's heads and backbone stay as they are
    ours = copy.deepcopy(v2).to(torch.bfloat16).float()(x, copy.deepcopy(model.lm_head).to(torch.bfloat16).float())
    torch.testing.assert_close(logits[..., ids], ours[..., ids])
    outside = [i for i in range(model.config.vocab_size) if i not in ids]
    assert torch.isinf(logits[..., outside]).all()                         # never guessed, as in the app
    # a vocabulary from another backbone (a token past this one's) is refused here, not in vLLM's startup
    (tmp_path / "v2vocab" / "proposal_vocab.json").write_text(json.dumps({"token_ids": [5, model.config.vocab_size]}))
    assert main(["--heads", str(tmp_path / "v2vocab"), "--out", str(tmp_path / "again"), "--format", "vllm"]) == 1
    assert f"proposal_vocab.json names token {model.config.vocab_size}, outside the backbone's vocabulary of " \
           f"{model.config.vocab_size}: rebuild it for this backbone, or delete it" in capsys.readouterr().err


def test_tgi_gets_the_backbone_from_model_where_the_heads_name_none(setup, tmp_path, capsys):
    """TGI loads the backbone its config names: an export of heads that name none wrote null there."""
    import shutil

    root = setup[0]
    shutil.copytree(root / "heads", tmp_path / "nameless")
    config = json.loads((tmp_path / "nameless" / "config.json").read_text())
    (tmp_path / "nameless" / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    capsys.readouterr()
    assert main(["--heads", str(tmp_path / "nameless"), "--out", str(tmp_path / "a"), "--format", "tgi"]) == 1
    said = capsys.readouterr().err
    assert said.endswith("the heads name no backbone (base_model_name_or_path), which TGI loads from the exported "
                         "config: pass --model\n"), said
    assert not (tmp_path / "a").exists()
    assert main(["--heads", str(tmp_path / "nameless"), "--out", str(tmp_path / "b"), "--format", "tgi",
                 "--model", "lmsys/vicuna-7b-v1.3"]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["base_model_name_or_path"] == "lmsys/vicuna-7b-v1.3"


def test_a_local_backbone_is_exported_by_its_absolute_path(setup, tmp_path, monkeypatch):
    """--model typed relative to where export ran named nothing where the heads were served."""
    root = setup[0]
    monkeypatch.chdir(root)
    assert main(["--heads", "heads", "--out", str(tmp_path / "out"), "--format", "tgi", "--model", "backbone"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "backbone")


def test_heads_tgi_cannot_run_are_refused_before_anything_is_written(setup, tmp_path, capsys):
    """Review: TGI's loader for heads without a projection (MedusaHeadV2) asserts one residual block per head;
    export wrote two-block ones, which TGI then failed on at startup."""
    root = setup[0]
    torch.manual_seed(0)
    deep = MedusaHeads(HeadsConfig(3, 2, 32, setup[1].config.vocab_size, own_projection=False)).eval()
    save_heads(deep, tmp_path / "deep", base_model=str(root / "backbone"))
    for format in ("tgi", "both"):
        out = tmp_path / f"out-{format}"
        assert main(["--heads", str(tmp_path / "deep"), "--out", str(out), "--format", format]) == 1
        assert capsys.readouterr().err == (f"error: {tmp_path / 'deep' / 'medusa_lm_head.safetensors'}: TGI runs "
                                           "heads without their own projection only with one residual block each, "
                                           "and these have 2: export them with --format vllm\n")
        assert not out.exists()
    assert main(["--heads", str(tmp_path / "deep"), "--out", str(tmp_path / "vllm"), "--format", "vllm"]) == 0


def test_export_errors_are_one_line(setup, tmp_path, capsys):
    assert main(["--heads", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and err.count("\n") == 1
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["--heads", str(setup[0] / "heads"), "--out", str(a_file)]) == 1   # a file where a folder goes
    err = capsys.readouterr().err
    assert err == f"error: --out {a_file} is a file: give a directory\n"     # QA16: named {a_file}/tgi, no fix
    assert main(["--heads", str(setup[0] / "heads"), "--out", str(a_file / "sub")]) == 1
    assert capsys.readouterr().err == f"error: --out {a_file / 'sub'} lies under {a_file}, a file: give a directory\n"
    # QA: a mistyped --model, or the heads' folder, was written into both configs as their backbone without a word
    for model, why in ((tmp_path / "nonexist", f"{tmp_path / 'nonexist'} does not exist: give an existing local "
                                               "directory or a hub id like owner/name"),
                       (setup[0] / "heads", f"--model {setup[0] / 'heads'} holds no backbone (a config.json with its "
                                            "model_type): give the folder the heads were trained on, or its hub id")):
        assert main(["--heads", str(setup[0] / "heads"), "--out", str(tmp_path / "typo"), "--model", str(model)]) == 1
        assert capsys.readouterr().err == f"error: {why}\n" and not (tmp_path / "typo").exists()
    # into the heads' own folder: it rewrote them, cast, without a word (review)
    heads_dir = setup[0] / "heads"
    before = {p.name: p.read_bytes() for p in heads_dir.iterdir() if p.is_file()}
    assert main(["--heads", str(heads_dir), "--out", str(heads_dir), "--format", "tgi", "--dtype", "float16"]) == 1
    assert capsys.readouterr().err == (f"error: --out {heads_dir} would overwrite the heads it exports "
                                       f"({heads_dir.resolve()}): give another folder\n")
    assert {p.name: p.read_bytes() for p in heads_dir.iterdir() if p.is_file()} == before
    with pytest.raises(LoadError, match="pass --model"):
        from medusa_core.export import ExportSpec, export

        root = setup[0]
        cfg = json.loads((root / "v2" / "config.json").read_text())
        d = tmp_path / "v2nobase"
        d.mkdir()
        (d / "medusa_lm_head.safetensors").write_bytes((root / "v2" / "medusa_lm_head.safetensors").read_bytes())
        (d / "config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
        export(ExportSpec(str(d), tmp_path / "o2", "vllm"))


def test_an_export_overwrites_no_other_heads_and_leaves_nothing_half_written(setup, tmp_path, capsys):
    """QA: --out holding other heads had them replaced without a word, and a vLLM half that failed for want of
    --model left the TGI half written."""
    root = setup[0]
    other = tmp_path / "other"
    assert main(["--heads", str(root / "heads"), "--out", str(other), "--format", "tgi"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert main(["--heads", str(root / "v2"), "--out", str(other), "--format", "tgi"]) == 1
    assert capsys.readouterr().err == (f"error: --out {other}: {other} already holds medusa_lm_head.safetensors, "
                                       "config.json, which the export would overwrite: give a new folder, or delete "
                                       "those files\n")
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    # heads that need the backbone's lm_head for vLLM, without a backbone to read it from
    cfg = json.loads((root / "v2" / "config.json").read_text())
    lone = tmp_path / "v2nobase"
    lone.mkdir()
    (lone / "medusa_lm_head.safetensors").write_bytes((root / "v2" / "medusa_lm_head.safetensors").read_bytes())
    (lone / "config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
    assert main(["--heads", str(lone), "--out", str(tmp_path / "both")]) == 1
    assert "pass --model" in capsys.readouterr().err
    assert not (tmp_path / "both" / "tgi").exists()
