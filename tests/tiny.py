"""Tiny models, heads and tokenizers built inside the tests (float32, CPU, seconds)."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate
from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.heads.files import save_heads
from medusa_core.training.loss import backbone_hidden, head_loss, padded, positions

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_model(arch: str = "llama", vocab: int = 64, seed: int = 0, hidden: int = 32, layers: int = 2,
               context: int = 512):
    """A random backbone; 4 query heads over 2 KV heads (GQA)."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = model_cls(config).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None  # random models: run to max_new_tokens unless a test says otherwise
    return model


def copied_heads(model, num_heads: int = 5) -> MedusaHeads:
    """Untrained heads (projection = lm_head): they guess the token the backbone just chose."""
    c = model.config
    heads = MedusaHeads(HeadsConfig(num_heads, 1, c.hidden_size, c.vocab_size))
    heads.init_from_lm_head(model.lm_head)
    return heads.eval()


def tree_decoding(device: str = "cpu", dtype: torch.dtype = torch.float32, max_new_tokens: int = 12,
                  graphs: bool | None = None):
    """(model, decode): a tiny Llama (hidden 64, vocab 64) with 3 copied heads; ``decode()`` gives its greedy Medusa
    tokens for a fixed prompt over the cartesian-2x2x2 tree, through whatever the model is routed to at the call."""
    from medusa_core.decoding.tree import build_tree_buffers, resolve_tree

    model = tiny_model("llama", hidden=64, vocab=64, seed=3).to(device, dtype)
    heads = copied_heads(model, num_heads=3).to(device, dtype)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3, device=device)

    def decode() -> list[int]:
        return [t for s in generate(model, [1, 5, 7, 9, 3], heads=heads, tree=tree,
                                    config=DecodeConfig(max_new_tokens=max_new_tokens), graphs=graphs)
                for t in s.tokens]

    return model, decode


def random_heads(model, num_heads: int = 5, seed: int = 1) -> MedusaHeads:
    """Heads whose guesses are almost always wrong: exercises rejection."""
    torch.manual_seed(seed)
    c = model.config
    return MedusaHeads(HeadsConfig(num_heads, 1, c.hidden_size, c.vocab_size)).eval()


def trained_heads(model, num_heads: int = 5, steps: int = 150, seed: int = 1,
                  root_conditioned: bool = False) -> MedusaHeads:
    """Heads fitted to the backbone's own greedy text: often right, so acceptance > 1. Root-conditioned
    heads start with a small random root block, so the root token changes their guesses from step one."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = []
    for _ in range(16):
        prompt = torch.randint(3, vocab, (4,), generator=gen).tolist()
        out = [t for s in generate(model, prompt, config=DecodeConfig(max_new_tokens=40)) for t in s.tokens]
        seqs.append(prompt + out)
    heads = copied_heads(model, num_heads)
    if root_conditioned:
        c = heads.config
        extended = MedusaHeads(HeadsConfig(c.num_heads, c.num_layers, c.hidden_size, c.vocab_size, root_conditioned=True))
        extended.heads.load_state_dict(heads.heads.state_dict())
        heads = extended.eval()
    fit_heads(model, heads, seqs, steps=steps, lr=3e-3, seed=seed)
    return heads


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 special, then printable ASCII (vocab 104)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def tiny_checkpoint(root: Path, arch: str = "llama", steps: int = 150) -> tuple[Path, Path]:
    """Save a tiny backbone (with a char tokenizer) and trained heads in the published
    Medusa-1 layout; returns (backbone_dir, heads_dir)."""
    tokenizer = char_tokenizer()
    model = tiny_model(arch, vocab=len(tokenizer), hidden=48)
    heads = trained_heads(model, steps=steps)
    backbone_dir, heads_dir = root / "backbone", root / "heads"
    model.save_pretrained(backbone_dir)
    tokenizer.save_pretrained(backbone_dir)
    save_heads(heads, heads_dir, base_model=str(backbone_dir))
    return backbone_dir, heads_dir


def app_checkpoint(root: Path) -> tuple[Path, Path]:
    """The model the app tests serve: a tiny backbone with a 1024-token context (a few turns
    outgrow it) and a char tokenizer without a chat template (the vicuna prompt), trained heads,
    and ``root/tree.json``. Its replies never end early: the lm_head rows of the special tokens
    are zero, so a greedy answer runs to max new tokens and Stop and the queue have time to act."""
    tokenizer = char_tokenizer()
    model = tiny_model("llama", vocab=len(tokenizer), hidden=64, layers=4, context=1024)
    with torch.no_grad():
        model.lm_head.weight[: len(tokenizer.all_special_ids)] = 0   # logit 0 < the best of ~100 random logits
    heads = trained_heads(model, steps=150)
    backbone_dir, heads_dir = root / "backbone", root / "heads"
    model.save_pretrained(backbone_dir)
    tokenizer.save_pretrained(backbone_dir)
    save_heads(heads, heads_dir, base_model=str(backbone_dir))
    (root / "tree.json").write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0], [0, 1], [0, 0, 0, 0]]))
    return backbone_dir, heads_dir


# Heads for tiny test models, fitted in a few dozen steps on in-memory sequences with the project's
# own loss (medusa_core/training/loss.py); the app's heads train in medusa_core/training/loop.py.
def fit_heads(
    model: nn.Module,
    heads: MedusaHeads,
    sequences: Sequence[Sequence[int]],
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """Train ``heads`` on token sequences of the backbone's own text (every token a target);
    returns the loss curve. Hidden states are computed once: for small in-memory data sets."""
    device = model.get_output_embeddings().weight.device
    data = padded([(list(s), list(s)) for s in sequences], pad=0, device=device)
    hidden_all = torch.cat([backbone_hidden(model, data[0][i:i + batch_size]) for i in range(0, len(data[0]), batch_size)])
    lm_head = model.get_output_embeddings()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    heads.train()
    for _ in range(steps):
        pick = torch.randint(len(data[0]), (min(batch_size, len(data[0])),), generator=gen)
        opt.zero_grad()
        batch = positions(hidden_all[pick], data[0][pick], data[1][pick], heads.config.num_heads)
        loss = head_loss(heads, batch, lm_head, backward=True)
        opt.step()
        losses.append(loss.total.item())
    heads.eval()
    return losses


def tree_seen(parents: list[int], prefix: int, width: int, device: str = "cpu") -> torch.Tensor:
    """(T, W) bool of a verification step over a tree given by each node's parent (-1: the root): every
    row sees the committed prefix, then itself and its ancestors among the T tree slots after it."""
    seen = torch.zeros(len(parents), width, dtype=torch.bool, device=device)
    seen[:, :prefix] = True
    for i in range(len(parents)):
        j = i
        while j >= 0:
            seen[i, prefix + j] = True
            j = parents[j]
    return seen


def with_compiled_reductions(module, monkeypatch) -> None:
    """Launch ``module``'s Triton kernel (its ``kernel_call``) with the reductions it runs compiled
    (tl.reduce, TREE=False) under the interpreter, which otherwise runs its written-out trees."""
    call = module.kernel_call
    monkeypatch.setattr(module, "kernel_call", lambda *a: (lambda fn, grid, args, meta: (
        fn, grid, args, dict(meta, TREE=False)))(*call(*a)))
