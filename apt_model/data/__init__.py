"""Real text for training: corpora as bytes, byte-level tokens, and batch sampling."""
from apt_model.data.text import ByteCorpus, load_text_bytes, stdlib_corpus_files

__all__ = ["ByteCorpus", "load_text_bytes", "stdlib_corpus_files"]
