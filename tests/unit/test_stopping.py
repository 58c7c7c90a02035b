"""StopChecker: EOS, stop strings (cut at the earliest, never returned) and max_tokens, token by token."""

from __future__ import annotations

import pytest

from sequoia_ray.stopping import StopChecker


class PieceTokenizer:
    """Token i decodes to PIECES[i]; a piece may be half a character (shown as U+FFFD until completed)."""

    PIECES = {1: "x", 2: "ab", 3: "fo", 4: "o", 5: "bar", 6: "\xc3", 7: "\xa9", 8: " done", 9: "é", 10: " \xc3"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        raw = "".join(self.PIECES[i] for i in ids)
        out = raw.encode("latin-1", errors="surrogateescape") if any(i in (6, 7, 10) for i in ids) else None
        return raw if out is None else out.decode("utf-8", errors="replace")


def run(stop, tokens, max_tokens=100, eos=frozenset()):
    checker = StopChecker(PieceTokenizer(), tuple(stop), frozenset(eos))
    ids, text, reason = [], "", None
    for token in tokens:  # one token a step, as a chain would send them
        new, delta, reason = checker.feed([token], max_tokens)
        ids += new
        text += delta
        if reason:
            break
    return ids, text, reason


@pytest.mark.parametrize("stop", [("b", "a"), ("a", "b")])
def test_cuts_at_the_earliest_stop_string_whatever_the_list_order(stop):
    ids, text, reason = run(stop, [1, 2, 5])
    assert (text, reason) == ("x", "stop")  # "xab": "a" comes first; "xa" would return a stop string
    assert ids == [1, 2]


def test_a_stop_string_across_tokens_is_held_back_then_cut():
    checker = StopChecker(PieceTokenizer(), ("foo",), frozenset())
    assert checker.feed([1], 100) == ([1], "x", None)  # "x" cannot begin "foo": sent (held back before)
    new, delta, reason = checker.feed([3], 100)
    assert (new, reason) == ([3], None) and "fo" not in delta
    new, delta, reason = checker.feed([4], 100)
    assert (new, reason) == ([4], "stop")
    assert checker.text == "x"


def test_a_stop_string_completed_by_the_second_half_of_a_character():
    # "\xc3" then "\xa9" are the two UTF-8 bytes of "é": the first decodes to "\ufffd", the second replaces it.
    ids, text, reason = run(("é",), [1, 6, 7, 8])
    assert (text, reason) == ("x", "stop")
    assert ids == [1, 6, 7]


def test_a_held_back_tail_does_not_count_an_incomplete_character():
    # " \xc3": a space, then half of "é" (U+FFFD until "\xa9" completes it). The half character is held back
    # and so is the space, which may begin the stop string " é" (it does): before, the space was sent.
    checker = StopChecker(PieceTokenizer(), (" é",), frozenset())
    assert checker.feed([1], 100) == ([1], "x", None)  # "x" cannot begin " é"
    assert checker.feed([10], 100) == ([10], "", None)  # the space can: held, with the half character
    assert checker.feed([7], 100) == ([7], "", "stop") and checker.text == "x"
    assert run((" é",), [1, 10, 7, 8]) == ([1, 10, 7], "x", "stop")


def test_eos_and_max_tokens():
    assert run((), [1, 5, 1], eos={5}) == ([1], "x", "stop")
    assert run((), [1, 5, 1], max_tokens=2) == ([1, 5], "xbar", "length")
    assert run(("zzz",), [1, 5, 8], max_tokens=3) == ([1, 5, 8], "xbar done", "length")


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama's, Mistral's): its decoder drops the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", "▁nice", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_output_keeps_the_leading_space_a_sentencepiece_decoder_drops():
    tok = metaspace_tokenizer()
    prompt, output = [1, 2, 3], [4, 5, 6]  # "The capital is" -> " Paris nice."
    assert tok.decode(output) == "Paris nice."  # decoded alone: the space is lost
    checker = StopChecker(tok, (" nice",), frozenset(), prefix=tuple(prompt))
    text = "".join(checker.feed([t], 100)[1] for t in output[:2])
    assert text == " Paris" and checker.text == " Paris"  # then " nice" stops it
    whole = StopChecker(tok, (), frozenset(), prefix=tuple(prompt))
    assert "".join(whole.feed([t], 100)[1] for t in output) + whole._delta(final=True) == " Paris nice."


def _byte_fallback_tokenizer():
    """A Llama/Mistral-style tokenizer: pieces, and ``<0xNN>`` byte tokens for characters outside its vocabulary
    (the decoder chain SentencePiece conversions get: Replace -> ByteFallback -> Fuse -> Strip)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁Rate", ":", "▁yes"]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tok, vocab, lambda text: [vocab[f"<0x{b:02X}>"] for b in text.encode()]


def test_a_prompt_window_starting_inside_a_byte_fallback_character_does_not_garble_the_output():
    """The prompt's last 4 tokens start inside 👍's 4 bytes: the window decoded to U+FFFD and the output's ✅, its
    bytes joining that run, read as U+FFFD too (session 56's review); the stop string ✅ was never found."""
    tok, vocab, byte_ids = _byte_fallback_tokenizer()
    prompt = (vocab["<s>"], vocab["▁Rate"], vocab[":"], *byte_ids("👍✅"))
    output = [*byte_ids("✅"), vocab["▁yes"]]
    assert tok.decode(list(prompt) + output, skip_special_tokens=True) == "Rate:👍✅✅ yes"
    checker = StopChecker(tok, (), frozenset({2}), prefix=prompt)
    text = "".join(checker.feed([t], 100)[1] for t in output) + checker._delta(final=True)
    assert text == "✅ yes"
    checker = StopChecker(tok, ("✅",), frozenset({2}), prefix=prompt)
    steps = [checker.feed([t], 100) for t in output[:3]]
    assert steps[-1][1:] == ("", "stop")  # found at its third byte, nothing of it returned


class CleaningTokenizer(PieceTokenizer):
    """transformers' clean-up of spaces, applied unless the caller says clean_up_tokenization_spaces=False (the
    tokenizer's config asks for it: Llama 3.x's; transformers before 5.x applied it to byte-level BPE too)."""

    PIECES = {1: "x", 2: " '", 3: "s", 4: "erver", 5: "'"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        text = "".join(self.PIECES[i] for i in ids)
        return text.replace(" 's", "'s") if clean_up_tokenization_spaces else text


def test_text_streamed_token_by_token_is_the_whole_texts_whatever_the_tokenizers_clean_up():
    """With the clean-up, " '" was sent, then the "s" that follows made the decode drop that space: text[sent:]
    skipped a character (" 'server'" streamed as " 'erver'")."""
    tokens = [1, 2, 3, 4, 5]
    checker, streamed = StopChecker(CleaningTokenizer(), (), frozenset()), ""
    for token in tokens:
        streamed += checker.feed([token], 100)[1]
    assert streamed == "x 'server'" == "".join(CleaningTokenizer.PIECES[t] for t in tokens)


def test_only_a_tail_that_could_begin_a_stop_string_is_held_back():
    """The hold-back was len(longest stop) - 1 characters whatever the text: with a 12-character stop string
    nothing of "xabfoo" was sent before the end. Now only a tail that begins a stop string waits."""
    checker = StopChecker(PieceTokenizer(), ("o barxxxxxxx",), frozenset())
    sent = [checker.feed([token], 100)[1] for token in (1, 2, 3, 4)]  # "x", "ab", "fo", "o"
    assert sent == ["x", "ab", "f", "o"]  # the last "o" could begin the stop string: held, the one before it sent
    new, delta, reason = checker.feed([5], 100)  # "xabfoobar": no stop string in it, no tail that begins one
    assert (delta, reason) == ("obar", None)
    assert checker.feed([8], 100)[1:] == (" done", None)


def _byte_level_tokenizer():
    """A GPT-2/Qwen-style byte-level BPE trained here on text with 2-, 3- and 4-byte characters: its tokens often
    end inside a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = ["the café served crème brûlée", "数据 模型 服务器", "deploy 🚀 then ✅ done", "def f(x): return x"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _whole_text(tok, prompt, ids):
    """The oracle: the output decoded whole after the prompt's last 4 tokens (their first tokens dropped while
    they read as U+FFFD), or alone when it changes their text — what a decode of everything at every token gives."""
    window, decode = list(prompt[-4:]), lambda x: tok.decode(x, skip_special_tokens=True,
                                                              clean_up_tokenization_spaces=False)
    while window and decode(window).startswith("\ufffd"):
        window.pop(0)
    text, before = decode(window + ids), decode(window)
    return text[len(before):] if text.startswith(before) else decode(ids)


def _fuzz_case(tok, rng, length, splice=True):
    """A prompt and an output: real text's tokens, with random ids spliced in (splitting characters anywhere) when
    ``splice``."""
    words = ["the", " café", " 数据", " 🚀", " ✅", " crème", "(x)", " 模型", "\n", " done", " Paris", " nice", "."]
    ids = tok.encode("".join(rng.choice(words) for _ in range(length)), add_special_tokens=False)
    pool = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    if splice:
        ids = [rng.choice(pool) if rng.random() < 0.3 else i for i in ids]
    cut = rng.randrange(1, 8)
    return ids[:cut], ids[cut : cut + length]


def _byte_fallback_case(rng, length):
    """Pieces and whole characters' ``<0xNN>`` bytes: a byte-fallback decoder reads a run holding an invalid byte
    as U+FFFD a byte, its valid characters too, so only valid runs have one whole text to compare with."""
    tok, vocab, byte_ids = _byte_fallback_tokenizer()
    spell = [[vocab["▁Rate"]], [vocab[":"]], [vocab["▁yes"]], *(byte_ids(c) for c in "aé数🚀✅ \n")]
    groups = [rng.choice(spell) for _ in range(length)]  # the output ends on a whole character too
    cut = rng.randrange(1, 8)
    return tok, [i for g in groups[:cut] for i in g], [i for g in groups[cut:] for i in g]


def test_an_output_that_completes_the_prompts_last_character_still_decodes_a_bounded_window():
    """A token-id prompt ending inside a character (its first byte) and an output that begins with the rest: the
    prompt's window reads "…\ufffd" and the output changes it, so the output was read alone, and never settled:
    each token read the whole output (3,004 ids at 3,000 tokens of the default tokenizer; a review's find)."""
    from sequoia_ray.stopping import DECODE, PREFIX_TOKENS, SETTLE_AFTER

    tok, vocab, byte_ids = _byte_fallback_tokenizer()
    first, *rest = byte_ids("数")
    prompt = (vocab["<s>"], vocab["▁Rate"], vocab[":"], first)
    output = rest + [vocab["▁yes"], *byte_ids("é数✅ "), vocab[":"]] * 60
    read, decode = [], tok.decode
    tok.decode = lambda ids, **kw: read.append(len(ids)) or decode(ids, **kw)
    checker, streamed = StopChecker(tok, (), frozenset(), prefix=prompt), ""
    for token in output:
        streamed += checker.feed([token], 10_000)[1]
    tok.decode = decode
    assert streamed + checker._delta(final=True) == _whole_text(tok, prompt, output)
    assert max(read) <= PREFIX_TOKENS + SETTLE_AFTER + 3, max(read)  # a settle retried while its cut splits a
    # character (up to 4 bytes: 3 more tokens)
    assert decode(output, **DECODE).startswith("\ufffd\ufffd yes")  # read alone: the prompt's byte is its own


@pytest.mark.parametrize("kind", ["byte-level", "metaspace", "byte-fallback"])
def test_incremental_text_equals_decoding_the_whole_output_at_every_token(kind):
    """Fuzz, 40 cases of up to 200 tokens per tokenizer (past SETTLE_AFTER several times each), fed in random step
    sizes: the streamed text equals the oracle's whole decode, and a stop string taken from that text stops at the
    token that completes its first occurrence, with the text before it — exactly, in every case."""
    import random

    rng = random.Random(7)
    tok = {"byte-level": _byte_level_tokenizer, "metaspace": metaspace_tokenizer}.get(kind, lambda: None)()
    for case in range(40):
        if kind == "byte-fallback":
            tok, prompt, ids = _byte_fallback_case(rng, 200)
        else:
            prompt, ids = _fuzz_case(tok, rng, 200)
        whole = _whole_text(tok, prompt, ids)
        checker, streamed, at = StopChecker(tok, (), frozenset(), prefix=tuple(prompt)), "", 0
        while at < len(ids):
            step = rng.randrange(1, 6)
            streamed += checker.feed(ids[at : at + step], 10_000)[1]
            at += step
        assert streamed + checker._delta(final=True) == whole, (kind, case)
        start = rng.randrange(len(whole))
        stop = whole[start : start + rng.randrange(1, 6)]
        k = next(k for k in range(1, len(ids) + 1) if stop in _whole_text(tok, prompt, ids[:k]))
        expected = _whole_text(tok, prompt, ids[:k])
        checker, streamed, reason = StopChecker(tok, (stop,), frozenset(), prefix=tuple(prompt)), "", None
        for token in ids:
            new, delta, reason = checker.feed([token], 10_000)
            streamed += delta
            if reason:
                break
        assert (streamed, reason, checker.count) == (expected[: expected.find(stop)], "stop", k), (kind, case, stop)


def test_a_token_decodes_a_bounded_window_however_long_the_output():
    """Every decode of a 2,000-token output reads at most PREFIX_TOKENS + SETTLE_AFTER ids (it read the whole
    output at every token: O(length) a token, 2.4 s over 4,096 tokens of the default tokenizer)."""
    from sequoia_ray.models.tiny import char_tokenizer
    from sequoia_ray.stopping import DECODE, PREFIX_TOKENS, SETTLE_AFTER

    tok, read = char_tokenizer(), []
    decode = tok.decode
    tok.decode = lambda ids, **kw: read.append(len(ids)) or decode(ids, **kw)
    ids = tok.encode("def f(x): return x * 2  # doubled; " * 60, add_special_tokens=False)[:2000]
    checker, streamed = StopChecker(tok, ("never",), frozenset(), prefix=(5, 6, 7, 8, 9)), ""
    for token in ids:
        streamed += checker.feed([token], 10_000)[1]
    assert streamed + checker._delta(final=True) == decode(ids, **DECODE)
    assert len(read) > len(ids) and max(read) <= PREFIX_TOKENS + SETTLE_AFTER


def test_a_stop_string_completed_by_the_last_allowed_token_is_cut():
    """Stop strings are checked before max_tokens: ``length`` with the stop string in the text was returned."""
    assert run(("foo",), [1, 3, 4], max_tokens=3) == ([1, 3, 4], "x", "stop")


def _replacement_char_tokenizer():
    """A byte-level BPE whose tokens are every byte alone and U+FFFD whole (its bytes EF BF BD merged), as Qwen2.5's
    token 5691 is; a skipped special token too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"ï¿": len(vocab), "ï¿½": len(vocab) + 1})
    backend = Tokenizer(models.BPE(vocab, [("ï", "¿"), ("ï¿", "½")]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=["<|x|>"])


def _stream_bounded(tok, prompt, output, whole):
    """Feed ``output`` a token a step: every step's streamed text is a prefix of ``whole`` (no half character sent),
    it all adds up to ``whole``, and no decode reads more than the settle window. Returns the checker, and how many
    characters were streamed after each token."""
    from sequoia_ray.stopping import PREFIX_TOKENS, SETTLE_AFTER

    read, decode = [], tok.decode
    tok.decode = lambda ids, **kw: read.append(len(ids)) or decode(ids, **kw)
    checker, streamed, sent = StopChecker(tok, (), frozenset(), prefix=tuple(prompt)), "", []
    try:
        for token in output:
            streamed += checker.feed([token], 100_000)[1]
            assert whole.startswith(streamed), len(sent)
            sent.append(len(streamed))
    finally:
        tok.decode = decode
    assert streamed + checker._delta(final=True) == whole
    assert max(read) <= PREFIX_TOKENS + SETTLE_AFTER + 3, max(read)  # + 3: a settle retried past a split character
    assert checker.settled >= len(output) - SETTLE_AFTER, checker.settled
    return checker, sent


def test_an_output_of_real_replacement_characters_settles_and_streams():
    """A head ending in U+FFFD was never settled, as if it were a character's first bytes: a real U+FFFD too (a
    whole token, a stray continuation byte, a lead byte broken off), so each token of such an output decoded all of
    it (4,001 ids at 4,000 tokens of Qwen2.5's token 5691: 3.4 s) and none of it was streamed before its end. A 🚀
    split into its 4 byte tokens, 20 skipped special tokens after its first, is still never sent half."""
    tok = _replacement_char_tokenizer()
    [fffd], [_, stray], [lead, *_], rocket = (tok.encode(s) for s in ("\ufffd", "\x80", "数", "🚀"))  # U+0080: C2 80
    assert tok.decode([fffd]) == tok.decode([stray]) == tok.decode([lead]) == "\ufffd" and len(rocket) == 4
    special = tok.convert_tokens_to_ids("<|x|>")
    unit = [fffd] * 20 + [stray, fffd, lead] + [fffd] * 20 + rocket[:1] + [special] * 20 + rocket[1:]
    output = (unit * 40)[:3000]
    whole = tok.decode(tok.encode("Say") + output, skip_special_tokens=True)[3:]
    _, sent = _stream_bounded(tok, tok.encode("Say"), output, whole)
    assert output[99] == fffd and sent[99] == len(tok.decode(output[:100], skip_special_tokens=True))  # all sent


@pytest.mark.parametrize("output, stop", [
    ("stray", ("数",)),  # 32 stray continuation bytes, then 数 x10 as bytes: all of it reads U+FFFD
    ("rocket", ("✅\ufffd",)),  # ✅ x20 then 🚀 as bytes: the whole output never shows "✅" + U+FFFD
])
def test_byte_fallback_runs_settle_only_where_they_did(output, stop):
    """A byte-fallback decoder reads a byte run as U+FFFD a byte until it ends whole, and a broken run as U+FFFD
    throughout. Settled inside such a run (as byte-level BPE's U+FFFD now settles), the stray bytes' text came out
    short (47 characters where decoding the whole output gives 62) and a stop string holding U+FFFD matched text that
    decoding the whole output never shows. Byte tokens count as unknown bytes when settling: these runs settle
    where they did before (a review's fuzz over 900 byte-fallback outputs: none where the change is wrong and its
    parent right)."""
    tok, vocab, byte_ids = _byte_fallback_tokenizer()
    prompt = [vocab["<s>"], vocab["▁Rate"], vocab[":"]]
    ids = [vocab["<0xA9>"]] * 32 + byte_ids("数" * 10) if output == "stray" else byte_ids("✅" * 20 + "🚀")
    whole = _whole_text(tok, prompt, ids)
    checker, streamed = StopChecker(tok, stop, frozenset(), prefix=tuple(prompt)), ""
    for token in ids:
        _, delta, reason = checker.feed([token], 10**6)
        streamed += delta
        assert whole.startswith(streamed) and reason is None
    assert streamed + checker._delta(final=True) == whole
    assert whole == ("\ufffd" * 62 if output == "stray" else "✅" * 20 + "🚀")
