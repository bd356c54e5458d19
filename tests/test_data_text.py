"""Real text corpora as byte tokens."""
import pytest
import torch

from apt_model.data.text import ByteCorpus, load_text_bytes, stdlib_corpus_files
from apt_model.errors import ConfigError


def test_stdlib_corpus_excludes_tests_and_site_packages():
    files = stdlib_corpus_files()
    assert len(files) > 100
    parts = {p for f in files for p in f.parts}
    assert not parts & {"test", "tests", "site-packages"}
    assert all(f.suffix == ".py" for f in files)
    assert stdlib_corpus_files() == files  # deterministic order


def test_max_bytes_and_folder_and_errors(tmp_path):
    blob = load_text_bytes(max_bytes=10_000)
    assert len(blob) == 10_000
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta\n")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert load_text_bytes(tmp_path) == b"alpha\n\nbeta\n"
    with pytest.raises(ConfigError, match="does not exist"):
        load_text_bytes(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no text files"):
        load_text_bytes(tmp_path / "empty")


def test_corpus_split_and_batches_are_next_byte_targets():
    data = bytes(range(256)) * 40
    c = ByteCorpus(data, val_fraction=0.1)
    assert len(c.train) + len(c.val) == len(data)
    assert bytes(c.val.tolist()) == data[-len(c.val):]
    x, y = c.batch("train", 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x + 1) % 256, y)  # in this corpus the next byte is always +1
    with pytest.raises(ConfigError, match="split='test'"):
        c.batch("test", 1, 4, torch.Generator())
    with pytest.raises(ConfigError, match="val_fraction"):
        ByteCorpus(data, val_fraction=0.9)


def test_kjv_loads(shared_data):
    blob = load_text_bytes(shared_data / "kjv.txt")
    assert len(blob) > 4_000_000 and b"In the beginning God created the heaven and the earth" in blob
