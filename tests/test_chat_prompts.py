"""The self-distillation prompt set: reproducible, broad, and thousands strong."""

import json

from medusa_core.training import prompts as chat_prompts


def test_the_set_is_the_same_every_time_and_has_no_duplicates():
    a, b = chat_prompts.prompt_set(4000), chat_prompts.prompt_set(4000)
    assert a == b
    prompts = [item["prompt"] for item in a]
    assert len(prompts) == len(set(prompts)) > 3000          # thousands, not hundreds


def test_it_covers_the_kinds_of_questions_a_chat_user_asks():
    prompts = [item["prompt"] for item in chat_prompts.prompt_set(4000)]
    kinds = {
        "code": ("Python", "function", "SQL"), "facts": ("capital of",), "advice": ("tips", "How can I"),
        "writing": ("Write a short poem", "Write a haiku", "Write an email"), "explanation": ("Explain",),
        "maths": ("plus", "times", "percent"),
    }
    for kind, needles in kinds.items():
        share = sum(any(n in p for n in needles) for p in prompts) / len(prompts)
        assert share > 0.005, f"{kind}: only {share:.1%} of the prompts"
    code_share = sum("function" in p or "program" in p or "snippet" in p or "code in" in p for p in prompts) / len(prompts)
    assert code_share < 0.5        # code does not drown the rest


def test_some_prompts_carry_a_follow_up_turn_and_the_cli_writes_jsonl(tmp_path):
    out = tmp_path / "p.jsonl"
    chat_prompts.main(["--count", "200", "--out", str(out)])
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(items) == 200
    followups = [i for i in items if "followup" in i]
    assert 0.05 < len(followups) / len(items) < 0.3
    assert all(i["followup"] in chat_prompts.FOLLOWUPS for i in followups)
