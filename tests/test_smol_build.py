"""The smol_build recipe: the proposal vocabulary it ships beside the CPU default's heads, and its
root stage's starting point."""

import json
import shutil

import pytest
import torch
from tiny import char_tokenizer, tiny_model

from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads
from medusa_core.heads.files import read_heads_dir, save_heads, save_proposal_vocab
from medusa_core.smol_build import BuildConfig, build_root_heads, most_used, run

HELP = "python -m medusa_core.smol_build --help lists the flags"


def test_most_used_ranks_by_count_then_id_and_reports_what_it_covers():
    answers = [[5, 5, 9, 2], [9, 5, 7, 2], [8]]
    ids, coverage = most_used(answers, 3)
    assert ids == [5, 2, 9]                 # 5 thrice; 2 and 9 twice each: the lower id first
    assert coverage == 7 / 9
    assert most_used(answers, 10) == ([5, 2, 9, 7, 8], 1.0)
    assert most_used([], 4) == ([], 0.0)


def test_root_stage_starts_from_the_latest_unconditioned_heads(tmp_path):
    """The root stage extends whatever unconditioned heads the heads/vocab stages left in heads/, keeps a
    copy of them, and reruns from that copy (not from its own output) until new ones arrive."""
    tokenizer, model = char_tokenizer(), tiny_model(vocab=104, hidden=32)
    backbone, work, heads_dir = tmp_path / "backbone", tmp_path / "work", tmp_path / "out" / "heads"
    model.save_pretrained(backbone)
    tokenizer.save_pretrained(backbone)
    work.mkdir()
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    gen = torch.Generator().manual_seed(0)
    answers = [{"prompt": f"question {i}", "temperature": t, "prompt_ids": [5, 6, 7],
                "answer_ids": torch.randint(4, 104, (20,), generator=gen).tolist()} for t in (0.0, 0.7) for i in range(6)]
    (work / "distill_answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))

    def unconditioned(seed: int) -> None:
        torch.manual_seed(seed)
        heads = MedusaHeads(HeadsConfig(2, 1, 32, 104, own_projection=False))
        save_heads(heads, heads_dir, base_model=str(backbone))
        save_proposal_vocab(heads_dir, list(range(4, 104)), {"about": "test"})

    config = BuildConfig(num_heads=2, root_steps=4, root_positions=32, root_eval_every=2)
    unconditioned(seed=1)
    first = build_root_heads(prompts, work, heads_dir, "cpu", config, backbone)
    assert first["final"]["step"] == 4 and first["train_positions"] > 0
    assert json.loads((heads_dir / "config.json").read_text())["root_conditioned"] is True
    base = read_heads_dir(work / "unconditioned_heads")
    assert not any(k.startswith("root.") for k in base.state)
    again = build_root_heads(prompts, work, heads_dir, "cpu", config, backbone)
    assert again["history"] == first["history"]            # the same start, not its own output

    unconditioned(seed=2)                                    # a fresh heads stage
    build_root_heads(prompts, work, heads_dir, "cpu", config, backbone)
    fresh = read_heads_dir(work / "unconditioned_heads").state
    assert not torch.equal(fresh["0.0.linear.weight"], base.state["0.0.linear.weight"])

    # run as a stage: the tree and accuracies beside heads/ described the heads it replaced, and go (review: the
    # loader tuned the new heads' trees by the old accuracies until the tree stage ran)
    out = heads_dir.parent
    for name in ("tree.json", "tree_calibration.json"):
        (out / name).write_text("[[0]]\n")
    run(["root"], work, out, "cpu", config, backbone)
    assert not (out / "tree.json").exists() and not (out / "tree_calibration.json").exists()
    assert (heads_dir / "proposal_vocab.json").is_file(), "the heads keep the vocabulary they were trained against"

    shutil.rmtree(work / "unconditioned_heads")
    with pytest.raises(ValueError, match="already holds root-conditioned heads"):
        build_root_heads(prompts, work, heads_dir, "cpu", config, backbone)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA GPU")
def test_a_cuda_build_without_cuda_is_refused_before_any_stage(tmp_path, capsys):
    """README's `smol_build --device cuda` on a CPU machine: one line, and no stage has written anything."""
    from medusa_core.smol_build import main

    assert main(["--device", "cuda", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda' was asked for but torch sees no CUDA GPU") and err.count("\n") == 1
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_the_tree_stage_on_a_cpu_never_writes_the_int4_modes_answers_as_the_fp32_reference(tmp_path, capsys):
    """Review: with the reference answers gone (deleted after editing the prompts), the tree stage on a CPU wrote
    the int4 mode's answers in their place, and every load then scored the int4 mode against its own text."""
    from medusa_core.smol_build import main

    out = tmp_path / "out"
    assert main(["--stages", "tree", "--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {out / 'calibration_answers.jsonl'} is missing: it holds SmolLM2's fp32 greedy answers, "
                   "which each load scores the int4 mode against, and this stage in int4 would write int4's there: "
                   "restore it, or run this stage with --device cuda (fp32)\n"), err
    assert not (out / "calibration_answers.jsonl").exists()


def test_counts_below_one_are_refused_before_any_stage(tmp_path, capsys):
    # QA 5c: --prompt-count -100 silently built 3,017 prompts (all but the last 100)
    from medusa_core.smol_build import main

    with pytest.raises(SystemExit) as stopped:
        main(["--stages", "prompts", "--prompt-count", "-100", "--work", str(tmp_path / "work"), "--out", str(tmp_path)])
    assert stopped.value.code == 2 and "--prompt-count -100 must be at least 1" in capsys.readouterr().err
    # the train stage refused it, after the prompts and the distillation had run
    with pytest.raises(SystemExit) as stopped:
        main(["--stages", "prompts", "--answer-tokens", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path)])
    assert stopped.value.code == 2 and "--answer-tokens 2 must be at least 3" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_the_heads_stage_off_a_gpu_is_refused_before_any_stage(tmp_path, capsys):
    """QA16: the bare command (default stages prompts heads) on a CPU started the days-long self-distillation."""
    from medusa_core.smol_build import main

    assert main(["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == ("error: the heads stage on --device cpu would take days (self-distillation of every prompt, then "
                   "vocabulary-wide training): run it with --device cuda on a GPU machine, or --stages prompts vocab "
                   "tree on the CPU\n")
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_a_prompt_count_beyond_the_prompt_set_is_refused_naming_its_size(tmp_path, capsys):
    # QA: --prompt-count 999999 built the 3,117 prompts there are without a word
    from medusa_core.smol_build import main, pool_size
    from medusa_core.training.prompts import prompt_set

    most = pool_size()
    assert len(prompt_set(most)) == most == BuildConfig().prompt_count      # the default: every prompt
    with pytest.raises(SystemExit) as stopped:
        main(["--stages", "prompts", "--prompt-count", str(most + 1), "--work", str(tmp_path / "work"),
              "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: --prompt-count {most + 1} is more than the {most} prompts the prompt "
                                       f"set holds: give at most {most} ({HELP})\n")      # one line, no usage
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_a_work_or_out_folder_that_is_a_file_is_refused_naming_the_flag(tmp_path, capsys):
    # QA: "error: /path: File exists", naming neither the flag nor the fix
    from medusa_core.smol_build import main

    afile = tmp_path / "afile"
    afile.write_text("")
    for flag in ("--work", "--out"):
        folders = {"--work": str(tmp_path / "work"), "--out": str(tmp_path / "out"), flag: str(afile)}
        with pytest.raises(SystemExit) as stopped:
            main(["--stages", "prompts", *(x for item in folders.items() for x in item)])
        assert stopped.value.code == 2
        assert capsys.readouterr().err == f"error: {flag} {afile} is a file: give a directory ({HELP})\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
