"""The server's tokenizer: HF files read without transformers, chat templates, streaming text."""

from __future__ import annotations

import json

import pytest

from specdeploy.engine.demo import train
from specdeploy.engine.serving.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXT = "def add(a, b):\n    return a + b  # naïve → ünïcode 日本語 🚀\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    texts = [TEXT * 3] + list(train.read_corpus(train.corpus_files(100_000, roots=[train.Path(train.__file__).parent])))
    train.save_tokenizer(train.train_tokenizer(texts, vocab_size=400), path)
    return path


def test_round_trip_and_bos(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.hf.token_to_id(train.BOS_TOKEN)
    assert tok.decode(ids) == TEXT  # BOS is special: skipped
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]


def test_incremental_detokenizer_streams_exactly_the_text(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt, output = ids[:4], ids[4:]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add([t]) for t in output]
    assert "".join(pieces) + detok.flush() == tok.decode(output)
    # A multi-byte character split over byte-level tokens is held back, never sent as U+FFFD.
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template_renders_and_encodes(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode_chat(messages)
    assert ids.count(tok.hf.token_to_id(train.BOS_TOKEN)) == 1  # the template's, not a second one
    assert tok.hf.token_to_id(train.EOS_TOKEN) in tok.eos_token_ids


def test_template_variants_and_errors(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = {"eos_token": {"content": "<|end|>"},
              "chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{% for m in messages %}{{ m['content'] | tojson }}"
                                                               "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                                                               "{% endif %}{% endfor %}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
    assert tok.eos_token_ids == {0, 1, 2}
    with pytest.raises(ChatTemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins_over_tokenizer_config(model_dir, tmp_path):
    """Newer repositories ship the template as chat_template.jinja (transformers' save_pretrained
    writes it there); where both exist, the file wins, as transformers reads them."""
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config:{{ messages[0]['content'] }}"}))
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "config:hi"
    (tmp_path / "chat_template.jinja").write_text("file:{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "file:hi"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "file:hi"


def test_generation_config_sampling_defaults():
    from specdeploy.engine.serving.tokenizer import sampling_defaults

    # meta-llama/Llama-3.1-8B-Instruct's and Qwen/Qwen3-8B's generation_config.json
    assert sampling_defaults({"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                              "temperature": 0.6, "top_p": 0.9}) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}
    assert sampling_defaults({}) == {}
    assert sampling_defaults({"temperature": "hot", "top_p": 0, "top_k": 2.5}) == {}   # not served


@pytest.mark.parametrize("text", [TEXT * 400, "    " * 20_000 + "x", "日本語🚀" * 9000, "a" * 70_000])
def test_encode_at_most_is_encode_or_a_true_lower_bound(model_dir, text):
    """What fits comes back exactly as encode() gives it; what does not is refused with a count
    that never exceeds the real one, after encoding only part of a long text."""
    from specdeploy.engine.serving.tokenizer import PromptTooLong

    tok = Tokenizer.from_dir(model_dir)
    real = len(tok.encode(text))
    assert tok.encode_at_most(text, real) == tok.encode(text)
    for limit in (real - 1, real // 3, 10):
        with pytest.raises(PromptTooLong) as info:
            tok.encode_at_most(text, limit)
        assert limit < info.value.num_tokens <= real
    assert tok.longest_token_chars >= max(len(t) for t in tok.hf.get_vocab())
