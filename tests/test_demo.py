"""The shipped demo model: loads on CPU, stays small, and its heads and tree really
speed decoding up (more than one token per step) without changing the greedy output."""

import json
from pathlib import Path

import pytest
import torch

from medusa_core.generate import DecodeConfig, generate
from medusa_core.loading import load_backbone_dir, load_heads_dir
from medusa_core.tree import build_tree_buffers, load_tree_file

DEMO = Path(__file__).resolve().parent.parent / "assets" / "demo"


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_backbone_dir(DEMO / "backbone", device="cpu", dtype=torch.float32)
    heads = load_heads_dir(DEMO / "heads", model)
    paths = load_tree_file(DEMO / "tree.json")
    tree = build_tree_buffers(paths, heads.config.num_heads, top_k=max(max(p) for p in paths) + 1)
    prompts = [json.loads(line)["prompt"] for line in (DEMO / "prompts.jsonl").read_text().splitlines() if line]
    return model, tokenizer, heads, tree, prompts


def test_demo_is_small_and_safetensors_only():
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 30 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert len([p for p in files if p.suffix == ".safetensors"]) == 2


def test_demo_prompts_are_held_out_snippets(demo):
    *_, prompts = demo
    assert 8 <= len(prompts) <= 16
    assert all(isinstance(p, str) and p.strip() for p in prompts)


def test_demo_heads_accept_more_than_one_token_per_step_and_match_the_baseline(demo):
    model, tokenizer, heads, tree, prompts = demo
    ids = tokenizer.encode(prompts[0], add_special_tokens=False)
    config = DecodeConfig(mode="greedy", max_new_tokens=64)
    medusa = list(generate(model, ids, heads=heads, tree=tree, config=config))
    baseline = list(generate(model, ids, config=config))
    tokens = [t for s in medusa for t in s.tokens]
    assert tokens == [t for s in baseline for t in s.tokens]
    steps = [s for s in medusa if not s.prefill]
    assert sum(len(s.tokens) for s in steps) / len(steps) > 1.0
    assert tokenizer.decode(tokens).strip()
