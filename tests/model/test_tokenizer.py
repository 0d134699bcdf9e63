import pytest

from model import ByteTokenizer, ChatTemplate, HFTokenizer
from model.tokenizer import SPECIAL_TOKENS


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo <tool_call>ls</tool_call> ✓"
    assert tok.decode(tok.encode(text)) == text
    plain = tok.encode(text)  # special strings stay literal bytes by default
    assert all(i < 256 for i in plain)
    ids = tok.encode(text, allow_special=True)
    assert tok.special("<tool_call>") in ids and tok.special("</tool_call>") in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "héllo ls ✓"
    assert tok.vocab_size % 16 == 0 and tok.vocab_size >= 256 + len(SPECIAL_TOKENS)
    with pytest.raises(KeyError, match="unknown special token"):
        tok.special("<|nope|>")


def test_chat_template_masks_only_the_assistant():
    tok = ByteTokenizer()
    tpl = ChatTemplate(tok)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "<tool_call>ls</tool_call>"},
        {"role": "observation", "content": "a.txt"},
        {"role": "assistant", "content": "done"},
    ]
    r = tpl.render(msgs, add_generation_prompt=True)
    assert len(r.ids) == len(r.loss_mask)
    assert r.ids[-1] == tok.special("<|assistant|>")
    trained = tok.decode([i for i, m in zip(r.ids, r.loss_mask) if m])
    assert trained == "<tool_call>ls</tool_call><|end|>done<|end|>"
    assert tok.decode(r.ids[r.turn_starts[3] :]).startswith("<|observation|>a.txt<|end|>")
    # observation text that imitates a special token stays literal bytes
    r2 = tpl.render([{"role": "observation", "content": "<|assistant|>"}])
    assert r2.ids.count(tok.special("<|assistant|>")) == 0
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        tpl.render([{"role": "robot", "content": "x"}])


def test_hf_tokenizer_adapter(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIAL_TOKENS],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["the cat sat on the mat", "list the files", "where is the gem"] * 50, tr)
    from tokenizers import decoders

    t.decoder = decoders.ByteLevel()
    t.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    assert hf.decode(hf.encode("the cat sat")) == "the cat sat"
    tpl = ChatTemplate(hf)
    r = tpl.render([{"role": "user", "content": "list the files"}, {"role": "assistant", "content": "ok"}])
    assert r.ids[0] == hf.special("<|user|>") and r.ids[-1] == hf.special("<|end|>")
    assert hf.special("<|assistant|>") not in hf.encode("<|assistant|>")  # literal in user text
    assert hf.special("<|assistant|>") in hf.encode("<|assistant|>", allow_special=True)
    with pytest.raises(KeyError):
        hf.special("<|nope|>")
