"""Document sources: text files, globs, directories, JSON Lines, saved Hugging Face datasets, default corpus."""

import json
import sys
import sysconfig
from pathlib import Path

import pytest

from colo.apps.data import default_corpus, read_documents


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, records) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


def test_text_files_globs_and_directories(tmp_path):
    a = _write(tmp_path / "b" / "a.txt", "first é")
    _write(tmp_path / "b" / "c.txt", "third")
    _write(tmp_path / "b" / "b.txt", "second")
    _write(tmp_path / "b" / "empty.txt", "")
    assert list(read_documents(a)) == ["first é"]
    assert list(read_documents(str(tmp_path / "b" / "*.txt"))) == ["first é", "second", "third"]
    assert list(read_documents(tmp_path / "b")) == ["first é", "second", "third"]  # sorted, empty skipped
    # entries are read in the order given
    assert list(read_documents([tmp_path / "b" / "c.txt", a])) == ["third", "first é"]
    # format="text" reads a .jsonl file whole
    j = _jsonl(tmp_path / "x.jsonl", [{"text": "t"}])
    assert list(read_documents(j, format="text")) == ['{"text": "t"}\n']


def test_jsonl_text_messages_and_pairs(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "plain"}, {"messages": messages}, {"prompt": "p", "response": "r"}])
    with open(path, "a") as f:
        f.write("\n")  # blank lines are skipped
    pair = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert list(read_documents(path)) == ["plain", messages, pair]
    assert list(read_documents(path, format="jsonl")) == ["plain", messages, pair]
    # a .json file holding an array of records
    array = _write(tmp_path / "a.json", json.dumps([{"text": "one"}, {"text": "two"}]))
    assert list(read_documents(array)) == ["one", "two"]


def test_jsonl_fields_are_configurable(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": "x"}, {"chat": [{"role": "user", "content": "q"}]}])
    assert list(read_documents(path, text_field="body", messages_field="chat")) == [
        "x",
        [{"role": "user", "content": "q"}],
    ]


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt' does not exist"):
        list(read_documents(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        list(read_documents(str(tmp_path / "*.nothing")))
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 3: not valid JSON"):
        list(read_documents(bad))
    missing = _jsonl(tmp_path / "m.jsonl", [{"text": "ok"}, {"body": "no"}])
    with pytest.raises(ValueError, match=r"m.jsonl line 2: the record has none of the fields 'text'.*text_field="):
        list(read_documents(missing))
    wrong = _jsonl(tmp_path / "w.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"w.jsonl line 1, field 'messages': message 0 needs a string 'content'"):
        list(read_documents(wrong))
    with pytest.raises(ValueError, match="format='csv' is not one of"):
        list(read_documents(missing, format="csv"))


def test_hf_dataset_needs_datasets(tmp_path, monkeypatch):
    _write(tmp_path / "ds" / "dataset_info.json", "{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed: `import datasets` fails
    with pytest.raises(ImportError, match=r"pip install 'colo-apps\[data\]'"):
        list(read_documents(tmp_path / "ds"))


def test_hf_dataset_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    assert list(read_documents(tmp_path / "ds")) == ["a", "b"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["p"], "response": ["r"]})}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert list(read_documents(tmp_path / "dd", format="hf")) == [
        [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    ]


def test_default_corpus_is_the_stdlib_sorted_and_deterministic():
    files = default_corpus()
    assert len(files) > 100
    assert files == default_corpus()
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [f.relative_to(root).as_posix() for f in files]
    assert relative == sorted(relative)
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in {"site-packages", "test", "tests"} for r in relative for part in r.split("/")[:-1])
    assert "os.py" in relative
