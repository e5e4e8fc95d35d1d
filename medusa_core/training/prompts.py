"""A broad, reproducible chat prompt set for self-distilling Medusa heads on a chat model.

Heads learn what the backbone tends to say next, so they should see the backbone answer the kinds of
questions a chat user asks: code, facts, advice, writing, explanations, small maths, and follow-up
turns. The set is built from topic lists and phrasings (seeded shuffle, no network, no model), so
``python -m medusa_core.training.prompts --count 4000 --out prompts.jsonl`` always writes the same 3,117 prompts.
Items are ``{"prompt": ...}`` or, for two-turn conversations, ``{"prompt": ..., "followup": ...}``.

The held-out prompts that benchmarks and calibration time with are written by hand elsewhere
(assets/smollm2/prompts.jsonl). One of their 24 is also drawn here, "What is the capital of France?"
(a review found it; the bundled heads were trained with it, so it stays); the others share no phrasing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

from ..errors import OneLineParser, check_writable, run_command

LANGUAGES = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "SQL", "Bash", "TypeScript", "C++"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest element of a list", "removes duplicates from a list", "reads a file line by line",
    "computes the factorial of n", "returns the n-th Fibonacci number", "sorts a list of names",
    "merges two sorted lists", "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "computes the average of a list of numbers", "finds the second smallest number in a list",
    "counts how often each character occurs", "flattens a nested list", "checks if two strings are anagrams",
    "implements binary search", "computes the greatest common divisor of two numbers",
    "parses a date string", "sums the digits of a number", "generates a random password",
    "validates an email address", "transposes a matrix", "implements a stack",
]
CODE_PHRASES = [
    "Write a {lang} function that {task}.", "How do I write code in {lang} that {task}?",
    "Show me a short {lang} program that {task}, with comments.",
    "Can you give me an example in {lang} of a function that {task}?",
    "I need a {lang} snippet that {task}. Please explain it briefly.",
]
CODE_CONCEPTS = [
    "recursion", "a hash table", "big O notation", "a linked list", "object-oriented programming", "a closure",
    "an API", "a race condition", "garbage collection", "a pointer", "version control with git", "unit testing",
    "a REST endpoint", "dynamic programming", "a regular expression", "an exception", "a compiler",
    "an interpreter", "a database index", "a virtual environment", "asynchronous code", "a binary tree",
    "immutability", "type hints", "a memory leak", "caching", "a sorting algorithm", "a queue",
]
COUNTRIES = [
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico", "Norway", "Peru",
    "Spain", "Germany", "Australia", "China", "Argentina", "Greece", "Turkey", "Vietnam", "Sweden", "Chile",
    "Poland", "Portugal", "Morocco", "Nigeria", "Thailand", "Ireland", "Indonesia", "South Korea", "Russia",
]
COUNTRY_PHRASES = [
    "What is the capital of {c}?", "Tell me three interesting facts about {c}.",
    "What language do people speak in {c}?", "What is the climate like in {c}?",
    "What is {c} famous for?", "Describe the geography of {c} in a few sentences.",
    "What food is {c} known for?", "Give me a short history of {c}.",
]
SCIENCE = [
    "photosynthesis", "gravity", "the water cycle", "electricity", "magnetism", "evolution", "DNA",
    "the immune system", "black holes", "climate change", "volcanoes", "earthquakes", "the moon's phases",
    "vaccines", "atoms", "the speed of light", "plate tectonics", "the greenhouse effect", "rainbows",
    "sound waves", "the human heart", "digestion", "the solar system", "friction", "energy conservation",
    "nuclear fusion", "antibiotics", "tides", "seasons on Earth", "the periodic table", "cells",
    "neurons", "inflation in economics", "supply and demand", "interest rates", "the stock market",
    "democracy", "the internet", "machine learning", "encryption", "blockchain", "solar panels",
    "batteries", "airplanes flying", "the printing press", "the Roman Empire", "the Industrial Revolution",
    "the French Revolution", "World War I", "the Renaissance", "ancient Egypt", "the Silk Road",
]
EXPLAIN_PHRASES = [
    "Explain {t} in simple terms.", "What is {t}?", "How does {t} work?",
    "Explain {t} to a ten-year-old.", "Why is {t} important?", "Give me a short summary of {t}.",
    "What are the main ideas behind {t}?", "Can you explain {t} step by step?",
]
ADVICE = [
    "sleep better", "stay focused while studying", "start running", "save money each month",
    "learn a new language", "prepare for a job interview", "deal with stress at work", "eat healthier",
    "make new friends in a new city", "keep a plant alive", "write a good resume", "learn to cook",
    "stop procrastinating", "be more productive in the morning", "prepare for an exam", "start a small business",
    "give a good presentation", "organize my desk", "read more books", "learn to play the guitar",
    "drink more water", "plan a trip on a budget", "improve my handwriting", "manage my time",
    "talk to my boss about a raise", "train a puppy", "keep my kitchen clean", "learn programming",
]
ADVICE_PHRASES = [
    "How can I {a}?", "Give me some tips to {a}.", "What is the best way to {a}?",
    "I want to {a}. Where should I start?", "What are five ways to {a}?",
]
WRITING_FORMS = [
    "a short poem", "a haiku", "a short story", "a limerick", "a thank-you note", "a product description",
    "a short speech", "a diary entry", "a tweet", "a motivational quote", "a birthday message", "a slogan",
]
WRITING_SUBJECTS = [
    "the ocean", "autumn leaves", "a lost cat", "friendship", "the city at night", "a rainy day", "coffee",
    "a robot learning to paint", "the first day of school", "mountains", "a dragon", "the stars",
    "a small bakery", "winter", "a journey by train", "a garden", "the sun", "a lighthouse", "music",
    "a new bicycle", "a summer holiday", "an old library",
]
EMAILS = [
    "ask my teacher for an extension on my homework", "invite my colleagues to a team lunch",
    "apologize to a customer for a late delivery", "ask a landlord to repair the heating",
    "decline a meeting politely", "thank a friend for a gift", "request a day off from my manager",
    "follow up after a job interview", "welcome a new member to our club", "complain about a noisy neighbour",
]
COMPARE = [
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "Java"), ("trains", "planes"), ("renting", "buying a house"),
    ("summer", "winter"), ("books", "movies"), ("running", "swimming"), ("a laptop", "a desktop computer"),
    ("electric cars", "petrol cars"), ("TCP", "UDP"), ("lists", "tuples in Python"), ("weather", "climate"),
    ("a virus", "a bacterium"), ("RAM", "storage"), ("socialism", "capitalism"), ("SQL", "NoSQL databases"),
]
COMPARE_PHRASES = [
    "What is the difference between {a} and {b}?", "Compare {a} and {b}.",
    "Which is better, {a} or {b}? Give pros and cons.",
]
MATH_PHRASES = [
    "What is {x} plus {y}?", "What is {x} times {y}?", "What is {x} minus {y}?",
    "If I have {x} apples and I buy {y} more, how many apples do I have?",
    "A train travels {x} kilometers in {y} hours. What is its average speed?",
    "What is {y} percent of {x}?", "Is {x} an even or odd number? Explain.",
    "Solve for x: x + {y} = {x}.",
]
DEFINITIONS = [
    "democracy", "gravity", "an algorithm", "a metaphor", "entropy", "a noun", "a verb", "inflation",
    "biodiversity", "a mammal", "an ecosystem", "a galaxy", "a protein", "an atom", "a habit", "empathy",
    "photosynthesis", "a fraction", "a prime number", "a triangle", "a sonnet", "a budget", "a molecule",
]
DEFINE_PHRASES = ["Define {d}.", "What does {d} mean?", "Give me a definition of {d} with an example."]
LISTS = [
    "healthy breakfast ideas", "fun things to do on a rainy day", "famous scientists", "books for beginners in programming",
    "tips for a first date", "ways to reduce plastic waste", "indoor hobbies", "questions to ask in an interview",
    "board games for families", "exercises you can do at home", "vegetables that grow quickly", "famous painters",
    "easy dinner recipes", "ways to learn faster", "names for a pet fish", "reasons to learn history",
]
LIST_PHRASES = ["List {n} {l}.", "Give me {n} {l}.", "Can you suggest {n} {l}?"]
PEOPLE = [
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Leonardo da Vinci", "William Shakespeare", "Cleopatra",
    "Nelson Mandela", "Ada Lovelace", "Charles Darwin", "Mahatma Gandhi", "Galileo Galilei", "Frida Kahlo",
    "Alan Turing", "Napoleon Bonaparte", "Jane Austen", "Nikola Tesla", "Martin Luther King Jr.", "Confucius",
    "Wolfgang Amadeus Mozart", "Abraham Lincoln", "Julius Caesar", "Rosalind Franklin", "Pablo Picasso",
    "Aristotle", "Thomas Edison", "Queen Victoria", "Ludwig van Beethoven", "Vincent van Gogh",
]
PEOPLE_PHRASES = ["Who was {p}?", "What is {p} known for?", "Tell me a few facts about {p}."]
ANIMALS = [
    "elephants", "dolphins", "octopuses", "penguins", "honeybees", "owls", "sharks", "wolves", "koalas",
    "giraffes", "ants", "bats", "camels", "eagles", "frogs", "horses", "tigers", "whales", "parrots",
    "butterflies", "crocodiles", "snails", "polar bears", "kangaroos", "hedgehogs", "salmon",
]
ANIMAL_PHRASES = ["Tell me about {a}.", "Where do {a} live?", "What do {a} eat?", "What are some fun facts about {a}?"]
DISHES = [
    "pancakes", "a simple tomato soup", "fried rice", "guacamole", "banana bread", "a vegetable curry",
    "scrambled eggs", "a green salad", "homemade pizza", "lemonade", "chocolate chip cookies", "pasta carbonara",
    "hummus", "an omelette", "mashed potatoes", "a fruit smoothie", "garlic bread", "chicken noodle soup",
]
DISH_PHRASES = ["How do I make {d}?", "Give me a simple recipe for {d}.", "What ingredients do I need for {d}?"]
SENTENCES = [
    "the meeting was moved to friday because nobody could come", "i think we should go to the park tomorrow",
    "this product is really good and i like it a lot", "the weather is bad so the game is cancelled",
    "please send me the report as soon as you can", "our team finished the project two days early",
    "i am sorry i forgot to call you yesterday", "the new phone has a better camera and a bigger screen",
    "he runs every morning before work", "we need more chairs for the party",
]
SENTENCE_PHRASES = [
    "Rewrite this sentence more formally: \"{s}\"", "Fix the grammar and punctuation: \"{s}\"",
    "Make this sentence sound friendlier: \"{s}\"",
]
FOLLOWUPS = [
    "Can you explain that more simply?", "Can you give me an example?", "Thank you! Can you make it shorter?",
    "Why is that?", "Can you tell me more?", "Can you summarize that in one sentence?",
    "What is the most important point?", "Can you write that as a list?", "Are there any exceptions?",
    "How would I explain this to a child?",
]


def pool() -> list[str]:
    """Every distinct prompt the phrasings and topics can form (3,117)."""
    out = [p.format(lang=lang, task=task) for p, lang, task in itertools.product(CODE_PHRASES, LANGUAGES, CODE_TASKS)]
    out += [f"What is {c} in programming?" for c in CODE_CONCEPTS]
    out += [f"Explain {c} with a short example in {lang}." for c, lang in itertools.product(CODE_CONCEPTS, LANGUAGES[:4])]
    out += [p.format(c=c) for p, c in itertools.product(COUNTRY_PHRASES, COUNTRIES)]
    out += [p.format(t=t) for p, t in itertools.product(EXPLAIN_PHRASES, SCIENCE)]
    out += [p.format(a=a) for p, a in itertools.product(ADVICE_PHRASES, ADVICE)]
    out += [f"Write {f} about {s}." for f, s in itertools.product(WRITING_FORMS, WRITING_SUBJECTS)]
    out += [f"Write an email to {e}." for e in EMAILS]
    out += [f"Help me write a polite message to {e}." for e in EMAILS]
    out += [p.format(a=a, b=b) for p, (a, b) in itertools.product(COMPARE_PHRASES, COMPARE)]
    out += [p.format(d=d) for p, d in itertools.product(DEFINE_PHRASES, DEFINITIONS)]
    out += [p.format(n=n, l=l) for p, n, l in itertools.product(LIST_PHRASES, (3, 5), LISTS)]
    out += [p.format(p=who) for p, who in itertools.product(PEOPLE_PHRASES, PEOPLE)]
    out += [p.format(a=a) for p, a in itertools.product(ANIMAL_PHRASES, ANIMALS)]
    out += [p.format(d=d) for p, d in itertools.product(DISH_PHRASES, DISHES)]
    out += [p.format(s=s) for p, s in itertools.product(SENTENCE_PHRASES, SENTENCES)]
    rng = random.Random(1234)   # numbers for the maths prompts: fixed, so the pool is too
    out += [p.format(x=rng.randint(12, 480), y=rng.randint(2, 60)) for p in MATH_PHRASES for _ in range(20)]
    return list(dict.fromkeys(out))


def prompt_set(count: int, seed: int = 0, followup_share: float = 0.15) -> list[dict]:
    """``count`` prompts drawn without replacement from the pool (all of it, if count is larger),
    a ``followup_share`` of them with a second user turn."""
    drawn = pool()
    rng = random.Random(seed)
    rng.shuffle(drawn)
    items = []
    for prompt in drawn[:count]:
        item = {"prompt": prompt}
        if rng.random() < followup_share:
            item["followup"] = rng.choice(FOLLOWUPS)
        items.append(item)
    return items


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.training.prompts", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, help="prompts to draw (default: all the set holds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file to write")
    a = p.parse_args(argv)
    most = len(pool())
    count = most if a.count is None else a.count
    if not 1 <= count <= most:      # CLI QA: a negative count dropped prompts from the end, 999999 gave the 3,117
        p.error(f"--count {count}: give a count from 1 to {most}, the prompts the set holds")

    def write() -> None:
        check_writable(a.out, "--out")      # CLI QA: '', a folder or /proc/x gave a traceback
        items = prompt_set(count, a.seed)
        Path(a.out).write_text("".join(json.dumps(item) + "\n" for item in items))
        print(f"{len(items)} prompts ({sum('followup' in i for i in items)} with a follow-up turn) -> {a.out}")
    return run_command(write)


if __name__ == "__main__":
    sys.exit(main())
