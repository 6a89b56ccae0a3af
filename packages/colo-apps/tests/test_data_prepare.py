"""`colo data prepare` / `colo data inspect`: a prepared corpus holds exactly the token stream the trainer would build
from the raw files (`tokenize_documents(read_documents(...))`), document for document, whatever the number of
workers; a crashed run resumes writing only what is missing, a finished one is left alone, another tokenizer or a
damaged shard is refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from colo.apps.cli import app
from colo.apps.data import (
    ByteTokenizer,
    CorpusError,
    TokenCorpus,
    describe_corpus,
    load_tokenizer,
    prepare,
    prepare_corpus,
    read_documents,
    tokenize_documents,
)
from colo.apps.data.describe import decode_escaped
from colo.apps.data.row_index import CACHE_DIR

runner = CliRunner()


def _bpe_tokenizer(directory, text: str):
    """A tiny byte-level BPE (vocabulary 400) trained here on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        show_progress=False,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def _words(seed: int, count: int) -> str:
    rng = np.random.default_rng(seed)
    vocabulary = ["def", "class", "colo", "shard", "token", "naïve", "café", "東京", "🚀", "\n", "    ", "return", "x"]
    return " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), count))


def _text_and_jsonl(root):
    """Three text files (one empty) and a JSON Lines file with blank lines, CRLF and a record of empty text."""
    root.mkdir(parents=True, exist_ok=True)
    for number, size in enumerate((300, 0, 40)):
        (root / f"doc{number}.txt").write_text(_words(number, size))
    lines = [json.dumps({"text": _words(100 + n, n * 7 % 50), "id": n}, ensure_ascii=n % 2 == 0) for n in range(120)]
    lines[5] = json.dumps({"text": ""})
    body = "\n".join(lines[:60]) + "\n\n  \n" + "\r\n".join(lines[60:]) + "\n"
    (root / "records.jsonl").write_bytes(body.encode())
    return root


def _reference(inputs, tokenizer, **options):
    return list(tokenize_documents(read_documents(inputs, **options), tokenizer))


def _assert_same_documents(corpus_dir, reference):
    corpus = TokenCorpus(corpus_dir)
    assert corpus.num_documents == len(reference)
    assert np.array_equal(corpus.read(0, corpus.num_tokens), np.concatenate(reference))
    starts = np.cumsum([0] + [len(document) for document in reference])
    spans = [corpus.document_span(document) for document in range(corpus.num_documents)]
    assert spans == list(zip(starts[:-1].tolist(), starts[1:].tolist()))


def _files(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _mtimes(directory):
    return {path.name: path.stat().st_mtime_ns for path in sorted(directory.iterdir())}


def test_text_jsonl_parquet_and_hf_inputs_prepare_to_the_trainers_token_stream(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    inputs = _text_and_jsonl(tmp_path / "raw")
    rows = [_words(200 + n, n % 30) for n in range(90)]
    pq.write_table(pa.table({"text": rows, "n": list(range(90))}), inputs / "rows.parquet", row_group_size=25)
    datasets.Dataset.from_dict({"text": rows[::-1]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "array.json").write_text(json.dumps([{"text": "a JSON array's record"}, {"text": "another"}]))
    paths = [inputs, tmp_path / "hf", tmp_path / "array.json"]
    tokenizer = load_tokenizer(_bpe_tokenizer(tmp_path / "bpe", _words(7, 3000)))

    # shard_tokens this small cuts the JSON Lines file into byte ranges, the Parquet row groups and the dataset's rows
    manifest = prepare_corpus(paths, tmp_path / "corpus", tokenizer=tokenizer.path, workers=1, shard_tokens=200)

    reference = _reference(paths, tokenizer)
    _assert_same_documents(tmp_path / "corpus", reference)
    plan = json.loads((tmp_path / "corpus" / "prepare.json").read_text())
    kinds = [segment["kind"] for unit in plan["units"] for segment in unit["segments"]]
    assert kinds.count("jsonl") > 3 and kinds.count("parquet") >= 4 and kinds.count("hf") > 1, kinds
    assert len(manifest["shards"]) > 10 and manifest["dtype"] == "<u2"
    assert manifest["tokenizer"]["sha256"] == tokenizer_sha(tokenizer)
    assert manifest["num_tokens"] == sum(len(document) for document in reference)


def tokenizer_sha(tokenizer):
    from colo.apps.data import tokenizer_identity

    return tokenizer_identity(tokenizer)["sha256"]


def test_one_and_two_workers_write_byte_identical_corpora(tmp_path, monkeypatch):
    inputs = _text_and_jsonl(tmp_path / "raw")
    tokenizer = _bpe_tokenizer(tmp_path / "bpe", _words(7, 3000))
    one = prepare_corpus(inputs, tmp_path / "one", tokenizer=tokenizer, workers=1, shard_tokens=300)
    two = prepare_corpus(inputs, tmp_path / "two", tokenizer=tokenizer, workers=2, shard_tokens=300, progress=True)
    assert one["shards_written"] == two["shards_written"] == len(one["shards"]) > 4
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    _assert_same_documents(tmp_path / "two", _reference(inputs, load_tokenizer(tokenizer)))
    monkeypatch.chdir(inputs)  # the manifest names the tokenizer by its absolute path: inspect decodes from anywhere
    (first,) = describe_corpus(tmp_path / "two", samples=1)["samples"]
    assert first["text"] == (inputs / "doc0.txt").read_text()[: len(first["text"])] and len(first["text"]) > 20

    # A bad record in one unit ends the whole run with its error (the other worker is not waited for).
    with (inputs / "records.jsonl").open("a") as file:
        file.write("{not json\n")
    with pytest.raises(ValueError, match=r"records\.jsonl line 123: not valid JSON"):
        prepare_corpus(inputs, tmp_path / "three", tokenizer=tokenizer, workers=2, shard_tokens=300)


def test_a_crashed_prepare_resumes_rewriting_only_the_missing_shards(tmp_path):
    inputs = _text_and_jsonl(tmp_path / "raw")
    out = tmp_path / "corpus"
    prepare_corpus(inputs, out, workers=1, shard_tokens=1000)
    finished = _files(out)
    # The crash: no manifest yet, shard 1 never started, shard 2 died while its token file was being written.
    (out / "manifest.json").unlink()
    for name in ("shard-00001.tokens", "shard-00001.json", "shard-00002.tokens", "shard-00002.json"):
        (out / name).unlink()
    (out / "shard-00002.tokens.tmp").write_bytes(b"\x01\x02\x03")
    (out / "shard-00002.index.tmp").write_bytes(b"\x01")
    for path in out.iterdir():  # an old time stamp, so a rewrite cannot hide in the clock's resolution
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = _mtimes(out)

    manifest = prepare_corpus(inputs, out, workers=1, shard_tokens=1000)

    assert manifest["shards_written"] == 2
    after = _mtimes(out)
    rewritten = {name for name in after if after[name] != before.get(name)}
    assert {name.split(".")[0] for name in rewritten} == {"shard-00001", "shard-00002", "manifest"}
    assert not list(out.glob("*.tmp"))
    assert _files(out) == finished


def test_rerunning_a_finished_prepare_writes_nothing_and_changed_inputs_are_refused(tmp_path):
    inputs = _text_and_jsonl(tmp_path / "raw")
    out = tmp_path / "corpus"
    first = prepare_corpus(inputs, out, workers=1, shard_tokens=1000)
    before, contents = _mtimes(out), _files(out)

    again = prepare_corpus(inputs, out, workers=1, shard_tokens=1000)

    assert again["shards_written"] == 0 and again["num_tokens"] == first["num_tokens"]
    assert _mtimes(out) == before and _files(out) == contents
    with (inputs / "doc2.txt").open("a") as file:
        file.write(" more")
    with pytest.raises(CorpusError, match=r"doc2\.txt changed size .*another --out, or pass --overwrite"):
        prepare_corpus(inputs, out, workers=1, shard_tokens=1000)
    with pytest.raises(CorpusError, match="shard_tokens was 1000, now 2000"):
        prepare_corpus(inputs, out, workers=1, shard_tokens=2000, overwrite=False)
    (out / "cache").mkdir()  # the trainer's row index cache (colo.apps.data.row_index) goes with the corpus
    (out / "cache" / "rows.json").write_text("{}")
    replaced = prepare_corpus(inputs, out, workers=1, shard_tokens=1000, overwrite=True)
    assert not (out / "cache").exists() and CACHE_DIR == prepare.CACHE_DIR
    _assert_same_documents(out, _reference(inputs, ByteTokenizer()))
    assert replaced["num_tokens"] == first["num_tokens"] + len(" more")


def test_a_corpus_of_another_tokenizer_is_refused_naming_both(tmp_path):
    inputs = _text_and_jsonl(tmp_path / "raw")
    out = tmp_path / "corpus"
    prepare_corpus(inputs, out, workers=1)
    bpe = _bpe_tokenizer(tmp_path / "bpe", _words(7, 3000))
    refused = r"prepared with the tokenizer 'ByteTokenizer'.*this prepare's tokenizer is '.*bpe/tokenizer\.json'"
    with pytest.raises(CorpusError, match=refused + ".*another --out, or pass --overwrite"):
        prepare_corpus(inputs, out, tokenizer=bpe, workers=1)
    with pytest.raises(CorpusError, match="prepared with the tokenizer 'ByteTokenizer'"):
        TokenCorpus(out, tokenizer=load_tokenizer(bpe))
    result = runner.invoke(app, ["data", "prepare", str(inputs), "--out", str(out), "--tokenizer", str(bpe)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("colo: ")


def test_a_damaged_shard_fails_its_checksum_and_prepare_verify_rewrites_only_it(tmp_path):
    inputs = _text_and_jsonl(tmp_path / "raw")
    out = tmp_path / "corpus"
    prepare_corpus(inputs, out, workers=1, shard_tokens=1000)
    reference = _reference(inputs, ByteTokenizer())
    damaged = out / "shard-00001.tokens"
    data = bytearray(damaged.read_bytes())
    data[10] ^= 0xFF
    damaged.write_bytes(bytes(data))

    corpus = TokenCorpus(out)  # opening checks sizes only; the read that meets the block checks it
    start = corpus.token_starts[1]
    with pytest.raises(CorpusError, match=r"shard-00001\.tokens: block 0 .* fails its CRC-32"):
        corpus.read(start, start + 4)
    result = runner.invoke(app, ["data", "inspect", str(out), "--verify"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "shard-00001.tokens: block 0" in result.stderr
    assert runner.invoke(app, ["data", "inspect", str(out)]).exit_code == 0  # without --verify: not read, not caught

    before = _mtimes(out)
    manifest = prepare_corpus(inputs, out, workers=1, shard_tokens=1000, verify=True)
    assert manifest["shards_written"] == 1
    changed = {name.split(".")[0] for name, mtime in _mtimes(out).items() if before[name] != mtime}
    assert changed == {"shard-00001", "manifest"}
    TokenCorpus(out).verify()
    _assert_same_documents(out, reference)


def test_colo_data_prepare_and_inspect(tmp_path):
    inputs = tmp_path / "raw"
    inputs.mkdir()
    (inputs / "tokyo.txt").write_text("東京" * 40)  # 240 bytes: a 96-token sample ends inside a character
    (inputs / "short.txt").write_text("hi")
    out = tmp_path / "corpus"

    prepared = runner.invoke(app, ["data", "prepare", str(inputs), "--out", str(out), "--workers", "1"])
    assert prepared.exit_code == 0, prepared.output
    assert "246 tokens in 2 documents, 1 shards (uint16)" in prepared.output
    again = runner.invoke(app, ["data", "prepare", str(inputs), "--out", str(out), "--workers", "1"])
    assert "nothing to do" in again.output

    shown = runner.invoke(app, ["data", "inspect", str(out), "--verify"])
    assert shown.exit_code == 0, shown.output
    assert "246 in 2 documents, 1 shards (uint16" in shown.output
    assert "every block verified" in shown.output and "    | hi" in shown.output
    assert "    | " + "東京" * 15 + "東\\xe4\\xba\n" in shown.output  # 95 bytes: 31 characters, 2 bytes of 京
    description = json.loads(runner.invoke(app, ["data", "inspect", str(out), "--json", "--samples", "5"]).output)
    assert description["tokens"] == 246 and description["documents"] == 2 and description["dtype"] == "uint16"
    assert description["document_tokens"] == {"min": 4, "mean": 123.0, "max": 242}
    assert description["histogram"] == [
        {"from": 4, "to": 16, "documents": 1},
        {"from": 16, "to": 64, "documents": 0},
        {"from": 64, "to": 256, "documents": 1},
    ]
    assert [sample["document"] for sample in description["samples"]] == [0, 1]
    assert description["tokenizer"]["kind"] == "ByteTokenizer" and description["verified"] is False

    for command in (["data", "inspect", str(inputs)], ["data", "prepare", str(tmp_path / "nope"), "--out", str(out)]):
        failed = runner.invoke(app, command)
        assert failed.exit_code == 2 and failed.stderr.count("\n") == 1 and failed.stderr.startswith("colo: ")
    assert "not a prepared corpus" in runner.invoke(app, ["data", "inspect", str(inputs)]).stderr
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    foreign = runner.invoke(app, ["data", "prepare", str(inputs), "--out", str(tmp_path / "notes"), "--overwrite"])
    assert foreign.exit_code == 2 and "holds todo.txt, which is not part of a prepared corpus" in foreign.stderr
    inside = runner.invoke(app, ["data", "prepare", str(tmp_path), "--out", str(out)])
    assert inside.exit_code == 2 and "lies inside the output directory" in inside.stderr


def test_input_errors_name_the_file_and_line(tmp_path):
    lines = [json.dumps({"text": f"record {n} " * 20}) for n in range(200)]
    lines[150] = "{not json"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    # cut into byte ranges: the bad line lies in a later unit, its number counts the lines before that unit
    with pytest.raises(ValueError, match=r"bad\.jsonl line 151: not valid JSON"):
        prepare_corpus(tmp_path / "bad.jsonl", tmp_path / "out", workers=1, shard_tokens=2000)
    lines[150] = json.dumps({"text": "fixed"})  # fixed, the unfinished run starts over from the new file
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    prepare_corpus(tmp_path / "bad.jsonl", tmp_path / "out", workers=1, shard_tokens=2000)
    _assert_same_documents(tmp_path / "out", _reference(tmp_path / "bad.jsonl", ByteTokenizer()))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"chat\.jsonl line 1: a chat conversation"):
        prepare_corpus(tmp_path / "chat.jsonl", tmp_path / "chat", workers=1)
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"other\.jsonl line 1: the record has none of the fields 'text'"):
        prepare_corpus(tmp_path / "other.jsonl", tmp_path / "other", workers=1)
    assert not list((tmp_path / "chat").glob("*.tmp"))  # a failed shard leaves no partial file


class _WideTokenizer:
    """A stand-in for a tokenizer with more than 65,536 ids: each character becomes ``66000 + code % 4000``."""

    vocab_size, bos_id, eos_id, pad_id = 70_000, 0, 1, 2

    def encode(self, text):
        return [66_000 + ord(char) % 4_000 for char in text]

    def decode(self, ids):
        return "".join(chr(i - 66_000) for i in ids if i >= 66_000)


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path):
    inputs = _text_and_jsonl(tmp_path / "raw")
    manifest = prepare_corpus(inputs, tmp_path / "corpus", tokenizer=_WideTokenizer(), workers=1, shard_tokens=500)
    assert manifest["dtype"] == "<u4"
    assert (tmp_path / "corpus" / "shard-00000.tokens").stat().st_size == 4 * manifest["shards"][0]["tokens"]
    reference = _reference(inputs, _WideTokenizer())
    assert max(int(document.max()) for document in reference) > 65_535
    _assert_same_documents(tmp_path / "corpus", reference)
    assert describe_corpus(tmp_path / "corpus", tokenizer=_WideTokenizer())["dtype"] == "uint32"


def test_undecodable_bytes_are_shown_escaped(tmp_path):
    assert decode_escaped(ByteTokenizer(), [256, *"é".encode(), 0xFF, 257]) == "é\\xff"
    bpe = load_tokenizer(_bpe_tokenizer(tmp_path / "bpe", _words(7, 3000)))
    ids = bpe.encode("東京 colo")
    assert decode_escaped(bpe, ids) == "東京 colo"
    assert decode_escaped(bpe, [bpe.bos_id, *ids]) == "東京 colo"  # special tokens are not shown
    cut = next(n for n in range(1, len(ids)) if bpe.decode(ids[:n]).endswith("\ufffd"))
    assert "\\x" in decode_escaped(bpe, ids[:cut]) and "\ufffd" not in decode_escaped(bpe, ids[:cut])
