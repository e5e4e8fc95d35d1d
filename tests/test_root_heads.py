"""Root-conditioned heads: they read the backbone's own next token, start exactly as the heads they
extend, and save, load and refuse export as this project's own layout."""

import json

import pytest
import torch
from tiny import copied_heads, tiny_model

from medusa_core.errors import LoadError
from medusa_core.export import ExportSpec, export
from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.heads.files import HeadsLoadError, load_heads_dir, save_heads


def root_heads(model, seed: int = 4) -> MedusaHeads:
    """Version-2 heads with random residual and root blocks (so the root token matters)."""
    torch.manual_seed(seed)
    c = model.config
    return MedusaHeads(HeadsConfig(3, 1, c.hidden_size, c.vocab_size, own_projection=False,
                                   root_conditioned=True)).eval()


def test_zero_root_blocks_guess_like_the_heads_they_extend():
    model = tiny_model()
    plain = copied_heads(model, 3)
    with torch.no_grad():
        for head in plain.heads:
            head[0].linear.weight.normal_(0, 0.3)
    c = plain.config
    extended = MedusaHeads(HeadsConfig(c.num_heads, c.num_layers, c.hidden_size, c.vocab_size, root_conditioned=True))
    extended.heads.load_state_dict(plain.heads.state_dict())
    extended.zero_root_blocks()
    hidden = torch.randn(7, c.hidden_size)
    root = torch.randint(0, c.vocab_size, (7,))
    assert torch.equal(extended.guesses(hidden, model.lm_head, 4, root=root), plain.guesses(hidden, model.lm_head, 4))


def test_the_root_token_changes_the_guesses_and_is_required():
    model = tiny_model()
    heads = root_heads(model)
    hidden = torch.randn(64, model.config.hidden_size)
    a = heads.guesses(hidden, model.lm_head, 1, root=torch.full((64,), 5))
    b = heads.guesses(hidden, model.lm_head, 1, root=torch.full((64,), 9))
    assert not torch.equal(a, b)
    # one row, as the decoding step asks: a 0-d root
    one = heads.guesses(hidden[3], model.lm_head, 2, root=torch.tensor(5))
    assert torch.equal(one[:, 0], a[:, 3, 0])
    with pytest.raises(ValueError, match="root-conditioned: pass root"):
        heads.guesses(hidden, model.lm_head, 1)


def test_root_conditioned_heads_save_load_and_refuse_export(tmp_path):
    model = tiny_model()
    backbone = tmp_path / "backbone"
    model.save_pretrained(backbone)
    heads = root_heads(model)
    save_heads(heads, tmp_path / "heads", base_model=str(backbone))
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["root_conditioned"] is True
    back = load_heads_dir(tmp_path / "heads", model)
    assert back.config.root_conditioned
    assert back.state_dict().keys() == heads.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in heads.state_dict().items())

    config["root_conditioned"] = False   # a config that disagrees with the weights is a mixed-up directory
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsLoadError, match="root_conditioned=False but the weights hold True"):
        load_heads_dir(tmp_path / "heads", model)
    config["root_conditioned"] = True
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="TGI and vLLM cannot run"):
        export(ExportSpec(heads=str(tmp_path / "heads"), out=tmp_path / "exported", model=str(backbone)))
