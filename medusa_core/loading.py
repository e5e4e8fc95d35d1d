"""Loading a backbone and Medusa heads from local directories.

Heads layout (published Medusa-1): ``config.json`` + ``medusa_lm_head.safetensors``
or ``medusa_lm_head.pt``; keys ``{h}.{l}.linear.weight/bias`` for residual
blocks and ``{h}.{L}.weight`` for a head's own vocabulary projection. The head
and block counts come from the keys, never from the config (the published 7B
config says 2 heads where the file holds 5).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from .heads import HeadsConfig, MedusaHeads


class HeadsLoadError(ValueError):
    """Heads that cannot be used with this backbone; the message names the file and the fix."""


_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def read_heads_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        # weights_only: a pickle that needs anything beyond tensors is refused, never run
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError or RuntimeError depending on the payload
        raise HeadsLoadError(
            f"{path} could not be loaded as plain tensors ({type(err).__name__}): it may hold code; "
            "use a safetensors file or re-save it as a plain state dict"
        ) from err
    if not isinstance(state, dict):
        raise HeadsLoadError(f"{path} holds a {type(state).__name__}, not a state dict of head weights")
    return state


def heads_config_from_keys(state: dict[str, torch.Tensor], source: str) -> HeadsConfig:
    """Count heads and residual blocks from the keys and check they form complete heads."""
    unexpected = [k for k in state if not _KEY.match(k)]
    if unexpected:
        raise HeadsLoadError(f"{source}: unexpected keys {sorted(unexpected)[:8]}: not a Medusa heads file")
    if not state:
        raise HeadsLoadError(f"{source}: holds no head weights")
    parsed = [(int(m[1]), int(m[2]), m[3]) for m in map(_KEY.match, state)]
    num_heads = max(h for h, _, _ in parsed) + 1
    num_layers = max((l for _, l, kind in parsed if kind.startswith("linear")), default=-1) + 1
    own_projection = any(kind == "weight" for _, _, kind in parsed)
    hidden = state["0.0.linear.weight"].shape[1] if "0.0.linear.weight" in state else state[f"0.{num_layers}.weight"].shape[1]
    vocab = state[f"0.{num_layers}.weight"].shape[0] if own_projection else 0
    return HeadsConfig(num_heads, num_layers, hidden, vocab, own_projection)


def heads_from_state(state: dict[str, torch.Tensor], model: nn.Module, source: str) -> MedusaHeads:
    """Build heads that match ``state`` exactly, check them against the backbone, load strictly."""
    found = heads_config_from_keys(state, source)
    text = model.config.get_text_config()
    if found.hidden_size != text.hidden_size:
        raise HeadsLoadError(
            f"{source}: heads have hidden size {found.hidden_size} but the backbone has {text.hidden_size}: "
            "use heads trained for this backbone"
        )
    vocab = model.get_output_embeddings().weight.shape[0]
    if found.own_projection and found.vocab_size != vocab:
        raise HeadsLoadError(
            f"{source}: heads have vocabulary size {found.vocab_size} but the backbone has {vocab}: "
            "use heads trained for this backbone"
        )
    heads = MedusaHeads(HeadsConfig(found.num_heads, found.num_layers, found.hidden_size, vocab, found.own_projection))
    try:
        heads.load_published_state_dict(state)
    except RuntimeError as err:
        raise HeadsLoadError(f"{source}: {err}".replace("\n", " ")) from err
    weight = model.get_output_embeddings().weight
    dtype = weight.dtype if weight.is_floating_point() else torch.bfloat16
    return heads.to(device=weight.device, dtype=dtype).eval()


def load_heads_dir(directory: str | Path, model: nn.Module) -> MedusaHeads:
    """Medusa-1 heads from a local directory; safetensors preferred over a pickle."""
    directory = Path(directory)
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        if (directory / name).is_file():
            return heads_from_state(read_heads_file(directory / name), model, str(directory / name))
    raise HeadsLoadError(
        f"{directory} has no medusa_lm_head.safetensors or medusa_lm_head.pt: point --heads at a Medusa heads directory"
    )


def load_backbone_dir(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A backbone saved with ``save_pretrained`` (and its tokenizer) -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


HEADS_FILE = "medusa_lm_head.safetensors"


def save_heads(heads: MedusaHeads, directory: str | Path, base_model: str) -> Path:
    """The project's heads layout: published keys in safetensors, plus a config that records
    what the loader checks (head count, blocks, sizes, base model)."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.published_state_dict().items()}
    save_file(state, str(directory / HEADS_FILE))
    c = heads.config
    config = {
        "format": "medusa-chat-heads",
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "own_projection": c.own_projection,
        "base_model_name_or_path": base_model,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
