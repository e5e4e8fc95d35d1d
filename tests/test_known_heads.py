"""The heads people download, as the page's model list offers them (app.models.KNOWN_MODELS).

Each repository's layout is rebuilt at tiny sizes (its file names, config keys, tensor keys and
dtype) inside an offline hub cache, and the entry is loaded the way the page loads it: by hub id,
through the real hub code path. What a user relies on is asserted: the heads counted from the
weights (never the config), the entry's tree, the backbone's chat format and turn end, and greedy
Medusa decoding that equals plain greedy decoding.

What the layouts rest on, from the repositories' file listings and configs. Read there: file names,
the Vicuna and Mistral configs, the Vicuna pickle's bf16 storage, the Zephyr shards' fp16 storage.
Worked out from file sizes, not read: the head counts of the 13B/33B Vicuna, Llama-3.1 and Zephyr
files; the Llama-3.1 config's contents (178 bytes fit Medusa's MedusaConfig with "version": "2");
the Llama-3.1 heads' bf16 and the Mistral heads' 16-bit dtype; the Zephyr config's medusa keys.
- medusa-vicuna-{7b,13b,33b}-v1.3: config.json {base_model_name_or_path, medusa_num_heads: 2,
  medusa_num_layers: 1, transformers_version: 4.31.0} + medusa_lm_head.pt (1.48 GB for 7B, 2.57 GB
  for 33B: 5 heads x 1 block with projections, in bf16);
- Mistral-7B-Instruct-v0.2-medusa: config.json {..., medusa_num_heads: 3, medusa_num_layers: 1,
  transformers_version: 4.38.1} + medusa_lm_head.safetensors (887 MB: 3 heads with projections);
- llama-3-1-8b-instruct-medusa: config.json + medusa_lm_head.safetensors (101 MB: 3 residual blocks,
  no projections: they reuse Llama's lm_head);
- medusa-1.0-zephyr-7b-beta: a Mistral model in two pytorch_model-*.bin shards (16 GB: the backbone
  and 5 heads with projections under medusa_head.*), no safetensors on main.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import char_tokenizer, tiny_model

from app.models import KNOWN_MODELS, KnownModel, spec_for
from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree
from medusa_core.heads.files import read_heads_dir
from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.loading import tree_tuning
from medusa_core.loading.assets import CPU_DEFAULT_HEADS, CPU_DEFAULT_TREE
from medusa_core.loading.chat_format import VICUNA_SYSTEM, render_chat
from medusa_core.loading.load import load
from medusa_core.loading.spec import LoadSpec
from medusa_core.loading.policy import TREE_BY_HEADS, choose_tree

COMMIT = "0" * 40
PROMPT = [1, 40, 41, 42, 43, 44]
NEW_TOKENS = 24

# Chat templates in the form of each backbone's own (shortened): the loader must use the tokenizer's.
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
ZEPHYR = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def entry(heads: str) -> KnownModel:
    return next(e for e in KNOWN_MODELS if e.heads == heads)


# ---------------------------------------------------------------- the repositories, at tiny sizes

def tokenizer(template: str | None = None, extra: tuple[str, ...] = ()):
    """The character-level tokenizer, with the backbone's special tokens and chat template."""
    tok = char_tokenizer()
    if extra:
        tok.add_special_tokens({"additional_special_tokens": list(extra)})
    tok.chat_template = template
    return tok


def backbone(arch: str, tok, seed: int):
    """A random fp32 backbone whose greedy replies never end early: the lm_head rows of the special
    tokens are zero, below the best of ~100 random logits, so every reply runs NEW_TOKENS long."""
    model = tiny_model(arch, vocab=len(tok), seed=seed)
    with torch.no_grad():
        model.lm_head.weight[tok.all_special_ids] = 0
    return model


def heads_state(model, num_heads: int, own_projection: bool, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Published keys of heads that guess like the backbone, nudged by small random residual blocks:
    their guesses are often, not always, right (both acceptance and rejection run)."""
    torch.manual_seed(seed)
    c = model.config
    heads = MedusaHeads(HeadsConfig(num_heads, 1, c.hidden_size, c.vocab_size, own_projection=own_projection))
    heads.init_from_lm_head(model.lm_head)
    with torch.no_grad():
        for head in heads.heads:
            head[0].linear.weight.copy_(0.05 * torch.randn_like(head[0].linear.weight))
    return {k: v.to(dtype).contiguous() for k, v in heads.published_state_dict().items()}


def hub_repo(cache: Path, repo_id: str) -> Path:
    """An empty snapshot of ``repo_id`` laid out as huggingface_hub caches a download."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def save_backbone(cache: Path, repo_id: str, model, tok) -> None:
    directory = hub_repo(cache, repo_id)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# Each builder writes one repository (and its backbone) and returns the head tensors it wrote.

def vicuna(cache: Path, size: str, seed: int) -> dict[str, torch.Tensor]:
    """FasterDecoding/medusa-vicuna-{size}-v1.3 beside lmsys/vicuna-{size}-v1.3 (no chat template)."""
    tok = tokenizer()
    model = backbone("llama", tok, seed)
    save_backbone(cache, f"lmsys/vicuna-{size}-v1.3", model, tok)
    heads = hub_repo(cache, f"FasterDecoding/medusa-vicuna-{size}-v1.3")
    # the config says 2 heads; the pickle holds 5, in bf16
    write_json(heads / "config.json", {"base_model_name_or_path": f"lmsys/vicuna-{size}-v1.3", "medusa_num_heads": 2,
                                       "medusa_num_layers": 1, "transformers_version": "4.31.0"})
    state = heads_state(model, 5, True, torch.bfloat16, seed)
    torch.save(state, heads / "medusa_lm_head.pt")
    (heads / "README.md").write_text("Medusa heads for vicuna\n")
    return state


def llama31(cache: Path, seed: int) -> dict[str, torch.Tensor]:
    """philschmid/llama-3-1-8b-instruct-medusa: version-2 heads (residual blocks only, bf16) whose
    config names the hub's old id of the backbone; the page names the backbone itself."""
    tok = tokenizer(LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                             "<|end_of_text|>"))
    model = backbone("llama", tok, seed)
    save_backbone(cache, "meta-llama/Llama-3.1-8B-Instruct", model, tok)
    heads = hub_repo(cache, "philschmid/llama-3-1-8b-instruct-medusa")
    write_json(heads / "config.json", {"base_model_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
                                       "medusa_num_heads": 3, "medusa_num_layers": 1,
                                       "transformers_version": "4.44.2", "version": "2"})
    state = heads_state(model, 3, False, torch.bfloat16, seed)
    save_file(state, str(heads / "medusa_lm_head.safetensors"))
    tok.save_pretrained(heads)   # the repo carries the tokenizer too; the backbone's is the one used
    return state


def mistral(cache: Path, seed: int) -> dict[str, torch.Tensor]:
    """text-generation-inference/Mistral-7B-Instruct-v0.2-medusa: medusa-1 heads in safetensors, 3 heads."""
    tok = tokenizer(MISTRAL)
    model = backbone("mistral", tok, seed)
    save_backbone(cache, "mistralai/Mistral-7B-Instruct-v0.2", model, tok)
    heads = hub_repo(cache, "text-generation-inference/Mistral-7B-Instruct-v0.2-medusa")
    write_json(heads / "config.json", {"base_model_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
                                       "medusa_num_heads": 3, "medusa_num_layers": 1,
                                       "transformers_version": "4.38.1"})
    state = heads_state(model, 3, True, torch.float16, seed)
    save_file(state, str(heads / "medusa_lm_head.safetensors"))
    tok.save_pretrained(heads)
    return state


def zephyr(cache: Path, seed: int) -> dict[str, torch.Tensor]:
    """FasterDecoding/medusa-1.0-zephyr-7b-beta: Medusa-2, the fine-tuned backbone and its heads
    (medusa_head.*) in two fp16 pytorch_model-*.bin shards, no safetensors, no separate heads file."""
    tok = tokenizer(ZEPHYR)
    model = backbone("mistral", tok, seed)
    repo = hub_repo(cache, "FasterDecoding/medusa-1.0-zephyr-7b-beta")
    heads = heads_state(model, 5, True, torch.float16, seed)
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    state.update({f"medusa_head.{k}": v for k, v in heads.items()})
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    for name, names in shards.items():
        torch.save({k: state[k] for k in names}, repo / name)
    write_json(repo / "pytorch_model.bin.index.json", {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
        "weight_map": {k: name for name, names in shards.items() for k in names}})
    config = model.config.to_dict()
    config.update(architectures=["MistralForCausalLM"], medusa_num_heads=5, medusa_num_layers=1)
    write_json(repo / "config.json", config)
    write_json(repo / "generation_config.json", {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                                                 "transformers_version": "4.34.0"})
    tok.save_pretrained(repo)
    return heads


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """Every repository of the list in one hub cache, and the head tensors each holds."""
    cache = tmp_path_factory.mktemp("known") / "hub"
    written = {f"FasterDecoding/medusa-vicuna-{size}-v1.3": vicuna(cache, size, seed)
               for seed, size in enumerate(("7b", "13b", "33b"))}
    written["philschmid/llama-3-1-8b-instruct-medusa"] = llama31(cache, 3)
    written["text-generation-inference/Mistral-7B-Instruct-v0.2-medusa"] = mistral(cache, 4)
    written["FasterDecoding/medusa-1.0-zephyr-7b-beta"] = zephyr(cache, 5)
    return cache, written


@pytest.fixture
def offline(hub, tmp_path, monkeypatch) -> list[int]:
    """The hub code path reads the cache only; the tuner's choices land in a fresh directory and its
    step times are fixed (each tree size as costly as one node, as on a GPU), so the choice depends
    on the heads' accuracies, not on this CPU. The list counts the tunings."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    tunings: list[int] = []

    def flat(model, heads, trees, *args, **kwargs):
        tunings.append(1)
        return {n: 0.01 for n in trees}

    monkeypatch.setattr(tree_tuning, "measure_step_seconds", flat)
    return tunings


# ---------------------------------------------------------------- what a user relies on

def greedy(loaded, tree: str) -> list[int]:
    buffers = None
    if tree != "baseline":
        buffers = build_tree_buffers(resolve_tree(tree), loaded.heads.config.num_heads)
    steps = generate(loaded.model, PROMPT, heads=loaded.heads if buffers else None, tree=buffers,
                     config=DecodeConfig(max_new_tokens=NEW_TOKENS))
    return [t for step in steps for t in step.tokens]


def assert_chat_format(known: KnownModel, loaded) -> None:
    tok = loaded.tokenizer
    text = tok.decode(render_chat(tok, [{"role": "user", "content": "hi"}]))
    if "vicuna" in known.chat:
        assert not tok.chat_template and text.startswith(f"<s>{VICUNA_SYSTEM} USER: hi") and text.endswith("ASSISTANT:")
    else:
        assert text == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert tok.get_vocab()[known.turn_end] in loaded.stop_ids, f"{known.turn_end} must end a reply"


# heads repo -> (heads counted from the weights, own vocabulary projections, the load line's layout)
LAYOUTS = {
    "FasterDecoding/medusa-vicuna-7b-v1.3": (5, True, "5 medusa-1 heads"),
    "FasterDecoding/medusa-vicuna-13b-v1.3": (5, True, "5 medusa-1 heads"),
    "FasterDecoding/medusa-vicuna-33b-v1.3": (5, True, "5 medusa-1 heads"),
    "philschmid/llama-3-1-8b-instruct-medusa": (3, False, "3 version-2 heads"),
    "text-generation-inference/Mistral-7B-Instruct-v0.2-medusa": (3, True, "3 medusa-1 heads"),
    "FasterDecoding/medusa-1.0-zephyr-7b-beta": (5, True, "5 medusa-2 heads"),
}


def test_the_list_offers_every_published_layout_and_the_cpu_default():
    assert {e.heads for e in KNOWN_MODELS} == {*LAYOUTS, str(CPU_DEFAULT_HEADS)}
    assert len({e.label for e in KNOWN_MODELS}) == len(KNOWN_MODELS)
    assert KNOWN_MODELS[0].device == "cuda" and KNOWN_MODELS[1].device == "cpu"   # the two defaults first
    for known in KNOWN_MODELS:
        spec = spec_for(known.label, "", "", LoadSpec(device="cpu", tree="chain-2"))
        assert (spec.model, spec.heads, spec.tree) == (known.model, known.heads, None)
        assert known.tree == TREE_BY_HEADS.get(known.heads, str(CPU_DEFAULT_TREE))
    with pytest.raises(ValueError, match="no model given: pick one from Known models"):
        spec_for(None, " ", "", LoadSpec(device="cpu"))


@pytest.mark.parametrize("repo", list(LAYOUTS))
def test_each_entry_loads_from_the_hub_cache_with_its_tree_and_chat_format(repo, hub, offline):
    known = entry(repo)
    num_heads, own_projection, layout = LAYOUTS[repo]
    loaded = load(LoadSpec(model=known.model, heads=known.heads, device="cpu", quant="none"))
    c = loaded.heads.config
    assert (c.num_heads, c.own_projection) == (num_heads, own_projection)
    # every tensor the repo holds, in its place, in the backbone's compute dtype (bf16/fp16 -> fp32 is exact)
    got, written = loaded.heads.published_state_dict(), hub[1][repo]
    assert got.keys() == written.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v.float()) for k, v in written.items())
    assert layout in loaded.description and "\n" not in loaded.description
    # the entry's tree is the one the loader picks on the device it is meant for, and it fits the heads
    assert choose_tree(known.heads, loaded.heads, known.device, False) == known.tree
    if repo.startswith("FasterDecoding/medusa-vicuna"):
        # published accuracies: the tree is tuned from them (step times fixed by the fixture)
        assert offline == [1] and loaded.tuned.accuracy_source.startswith("published")
        assert Path(loaded.default_tree).name == "tuned.json"
    else:
        assert offline == [] and loaded.default_tree == known.tree
    assert_chat_format(known, loaded)
    plain = greedy(loaded, "baseline")
    assert len(plain) == NEW_TOKENS
    assert greedy(loaded, known.tree) == plain
    assert greedy(loaded, loaded.default_tree) == plain


def test_the_cpu_default_entry_is_the_bundled_heads_with_their_tree():
    """Its backbone is SmolLM2's converted copy (loaded in test_default_model.py); here, its heads'
    layout and tree, without converting anything."""
    known = entry(str(CPU_DEFAULT_HEADS))
    assert known.model is None and known.tree == str(CPU_DEFAULT_TREE) and known.turn_end == "<|im_end|>"
    files = read_heads_dir(CPU_DEFAULT_HEADS)
    assert files.layout == "medusa-chat" and files.proposal_ids
    heads = MedusaHeads(HeadsConfig(5, 1, 8, 16, own_projection=False, root_conditioned=True))
    assert choose_tree(known.heads, heads, known.device, True) == known.tree
    build_tree_buffers(resolve_tree(known.tree), files.config["medusa_num_heads"])   # TreeError if it did not fit
