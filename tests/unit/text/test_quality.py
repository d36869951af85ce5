from pipeline.text.quality import copies_opening

DOC = ("Rename an old mailbox to a new one. The server answers with a tagged response; "
       "a failure raises an error naming the mailbox.")


def test_an_output_that_is_mostly_the_documents_opening_is_a_copy():
    assert copies_opening("Rename an old mailbox to a new one.", DOC)
    assert copies_opening("Rename   an old mailbox\nto a new one. Done", DOC)  # whitespace runs are one space
    assert copies_opening("rename an old mailbox to a new one.", DOC)  # 80%: one letter of 35 differs


def test_a_rewording_a_later_passage_or_nothing_is_not_a_copy():
    assert not copies_opening("Moves a mailbox to another name, or fails.", DOC)
    # The same words, but from past the opening's window (2 x the output's length).
    assert not copies_opening("a failure raises an error naming the mailbox.", DOC)
    assert copies_opening("a failure raises an error naming the mailbox.", DOC[60:])
    assert not copies_opening("", DOC) and not copies_opening("   ", DOC) and not copies_opening(None, DOC)
    assert not copies_opening("Rename an old mailbox.", "")


def test_the_quick_rejection_gives_the_rules_answer():
    """The core check (a shared run of 80% of the output must hold its middle) only
    shortcuts: on random pieces of a document it agrees with the full longest-match rule."""
    import random
    from difflib import SequenceMatcher

    from pipeline.text.quality import normalized

    rng = random.Random(0)
    words = DOC.split() * 3
    for _ in range(300):
        a = rng.randrange(len(words))
        out = " ".join(words[a:a + rng.randrange(1, 12)])
        if rng.random() < 0.5:
            out = out.replace(rng.choice(out.split()), "zz", 1)
        o, opening = normalized(out), normalized(" ".join(words))[: 2 * len(normalized(out))]
        full = SequenceMatcher(None, o, opening, autojunk=False).find_longest_match(0, len(o), 0, len(opening))
        assert copies_opening(out, " ".join(words)) == (bool(o) and full.size >= 0.8 * len(o)), out
