"""The training corpus: CPython's standard-library ``.py`` sources, tokenized once, offline.

``prepare_data(source, out_dir)`` (``leapquant train-data``) is run once on one machine and
writes everything training reads, so the training machine never looks at its own Python:

* ``train.npy``, ``heldout.npy``: uint16 token streams, each file's tokens followed by
  ``<|endoftext|>``, files in sorted path order;
* ``tokenizer.json`` (byte-level BPE trained by ``tokenizers`` on the training split only) and
  ``tokenizer_config.json`` (for transformers' ``PreTrainedTokenizerFast``);
* ``files.txt``: one line per file, ``split sha256 relative/path``;
* ``manifest.json``: Python version, the hashes below, counts, excluded files and why.

Which files: every ``*.py`` under the standard-library directory, test packages included
(they double the corpus), except ``site-packages/``, the build-specific ``config-*/`` and
``_sysconfigdata_*.py``, ``__pycache__/``, and files that are not valid UTF-8 (a few
deliberately mis-encoded test inputs; each is listed in the manifest with the reason).

Hashes: ``file_list_sha256`` is the sha256 of the sorted relative paths joined by newlines;
``contents_sha256`` is the sha256 of ``files.txt`` (so it covers every file's bytes). The
held-out split is a function of the path alone: a file is held out when the first 8 bytes of
``sha256(path)``, read as a big-endian integer, fall in the lowest ``held_out_fraction`` of
their range.

Batches for training are windows of the token stream at offsets drawn from a generator
seeded by ``(seed, step)``, so a run resumed at step ``s`` sees exactly the batches an
uninterrupted run would. A fraction of rows may carry a synthetic multi-query associative
recall task over a long gap (``RecallSpec``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as bpe_models

EOS = "<|endoftext|>"
RECALL = "<|recall|>"
QUERY = "<|query|>"
SPECIAL_TOKENS = (EOS, RECALL, QUERY)  # ids 0, 1, 2
MANIFEST = "manifest.json"
FILES_LIST = "files.txt"
TRAIN_TOKENS = "train.npy"
HELDOUT_TOKENS = "heldout.npy"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
FORMAT = "leapquant-train-data"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """How the corpus is cut and tokenized.

    vocab_size: BPE vocabulary including the special tokens; held_out_fraction: share of the
    hash range whose files are held out; min_frequency: BPE merges need this many occurrences.
    """

    vocab_size: int = 4096
    held_out_fraction: float = 0.02
    min_frequency: int = 2

    def __post_init__(self):
        if not 256 + len(SPECIAL_TOKENS) < self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in ({256 + len(SPECIAL_TOKENS)}, 65536] (uint16 tokens), "
                             f"got {self.vocab_size}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")


def default_source() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(part: str) -> bool:
    return part in ("site-packages", "__pycache__") or part.startswith("config-")


def list_sources(root) -> list[str]:
    """Sorted relative POSIX paths of the ``*.py`` files the corpus may use (see the module
    docstring for what is left out; encoding is checked later)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"source directory {root} does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _excluded_dir(d))
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata_"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def is_held_out(path: str, fraction: float) -> bool:
    """The split of one relative path: a fixed function of its sha256."""
    h = int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big")
    return h < fraction * 2**64


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def train_tokenizer(texts, spec: DataSpec):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (an iterable of str),
    with ``SPECIAL_TOKENS`` at ids 0, 1, 2."""
    tok = Tokenizer(bpe_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, min_frequency=spec.min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` for transformers (``AutoTokenizer`` reads ``tokenizer.json``)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
            "bos_token": None, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20,
            "additional_special_tokens": [RECALL, QUERY]}


def tokenize_texts(tok, texts: list[str]) -> np.ndarray:
    """The corpus's token stream ``[N]`` uint16: each text's tokens, then ``EOS``, in order."""
    eos = tok.token_to_id(EOS)
    pieces = []
    for enc in tok.encode_batch(texts):
        pieces.append(np.asarray(enc.ids, np.uint16))
        pieces.append(np.asarray([eos], np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)


def prepare_data(source, out_dir, *, spec: DataSpec = DataSpec(), python_version: Optional[str] = None,
                 progress: bool = False) -> dict:
    """Lists, hashes, splits and tokenizes the sources; writes ``out_dir`` atomically (a
    temporary sibling renamed into place; an existing non-empty ``out_dir`` is refused).

    source: the standard-library directory (default of the CLI: the running interpreter's);
    python_version: recorded in the manifest (default: the running interpreter's version when
    ``source`` is its own standard library, else ``"unknown"``). Returns the manifest dict.
    """
    source, out_dir = Path(source), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; not overwriting it")
    if python_version is None:
        python_version = platform.python_version() if source.resolve() == default_source().resolve() else "unknown"
    rel_paths = list_sources(source)
    if not rel_paths:
        raise ValueError(f"no .py files under {source}")
    used, excluded, lines = [], [], []
    texts = {"train": [], "heldout": []}
    for rel in rel_paths:
        data = (source / rel).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            excluded.append({"path": rel, "reason": f"not UTF-8 ({err.reason} at byte {err.start})"})
            continue
        split = "heldout" if is_held_out(rel, spec.held_out_fraction) else "train"
        used.append(rel)
        texts[split].append(text)
        lines.append(f"{split} {sha256_hex(data)} {rel}\n")
    if not texts["train"] or not texts["heldout"]:
        raise ValueError(f"the split left no {'training' if not texts['train'] else 'held-out'} files "
                         f"({len(used)} files, held_out_fraction={spec.held_out_fraction})")
    files_txt = "".join(lines).encode("utf-8")
    tok = train_tokenizer(texts["train"], spec)
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size {spec.vocab_size}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        counts = {}
        for split, name in (("train", TRAIN_TOKENS), ("heldout", HELDOUT_TOKENS)):
            ids = tokenize_texts(tok, texts[split])
            np.save(tmp / name, ids)
            counts[split] = {"files": len(texts[split]), "bytes": sum(len(t.encode("utf-8")) for t in texts[split]),
                             "tokens": int(ids.size)}
        tok.save(str(tmp / TOKENIZER))
        (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
        (tmp / FILES_LIST).write_bytes(files_txt)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "source": str(source),
            "python_version": python_version,
            "selection": "*.py under the standard-library directory, test packages included; excluded: "
                         "site-packages/, config-*/, __pycache__/, _sysconfigdata_*.py, files not valid UTF-8",
            "held_out_rule": f"first 8 bytes of sha256(relative path), big-endian, < {spec.held_out_fraction} * 2**64",
            "spec": dataclasses.asdict(spec),
            "files": len(used),
            "file_list_sha256": sha256_hex("\n".join(used).encode("utf-8")),
            "contents_sha256": sha256_hex(files_txt),
            "excluded": excluded,
            "splits": counts,
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
            "tokenizer_sha256": file_sha256(tmp / TOKENIZER),
            "token_files_sha256": {name: file_sha256(tmp / name) for name in (TRAIN_TOKENS, HELDOUT_TOKENS)},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared data directory, loaded: token streams ``[N]`` uint16 and the manifest."""

    path: Path
    manifest: dict
    train: np.ndarray
    heldout: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def special(self, token: str) -> int:
        return int(self.manifest["special_tokens"][token])


def load_corpus(path, *, verify: bool = True) -> Corpus:
    """Reads a ``prepare_data`` directory; ``verify`` checks the token files' sha256 against the
    manifest (a copy damaged in transit fails here, not as a mysterious loss)."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise FileNotFoundError(f"{path} has no {MANIFEST}; run `leapquant train-data` first")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path / MANIFEST} is not a {FORMAT} v{VERSION} manifest")
    if verify:
        for name, want in manifest["token_files_sha256"].items():
            got = file_sha256(path / name)
            if got != want:
                raise ValueError(f"{path / name} has sha256 {got}, the manifest says {want}")
    train, heldout = np.load(path / TRAIN_TOKENS), np.load(path / HELDOUT_TOKENS)
    for name, x in (("train", train), ("heldout", heldout)):
        if x.dtype != np.uint16 or x.ndim != 1:
            raise ValueError(f"{name} tokens must be a 1-D uint16 array, got {x.dtype} {x.shape}")
    return Corpus(path=path, manifest=manifest, train=train, heldout=heldout)


# ----------------------------------------------------------------------------- batches


@dataclasses.dataclass(frozen=True)
class RecallSpec:
    """Synthetic multi-query associative recall over a long gap, mixed into a share of rows.

    A recall row is ``<|recall|> k1 v1 .. kn vn``, then corpus text (the gap), then
    ``<|query|> k_a v_a k_b v_b ..`` asking for every pair in a random order; keys are distinct.
    Keys and values are ordinary tokens (ids from ``first_id`` up). The loss counts the gap's
    text and each queried value; the pair list and the query keys are unpredictable by design and
    left out. fraction: share of rows (0 disables); pairs: ``n``; min_gap: fewest gap tokens.
    """

    fraction: float = 0.25
    pairs: int = 32
    min_gap: int = 1024
    first_id: int = 256 + len(SPECIAL_TOKENS)

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"recall fraction must be in [0, 1], got {self.fraction}")
        if self.pairs < 1 or self.min_gap < 1:
            raise ValueError("recall pairs and min_gap must be positive")

    def row_tokens(self, gap: int) -> int:
        """Length of a recall row with a gap of ``gap`` tokens."""
        return 1 + 2 * self.pairs + gap + 1 + 2 * self.pairs


def _window(stream: np.ndarray, rng: np.random.Generator, length: int) -> np.ndarray:
    if stream.size < length:
        raise ValueError(f"token stream of {stream.size} tokens is shorter than one window of {length}")
    start = int(rng.integers(0, stream.size - length + 1))
    return stream[start:start + length].astype(np.int32)


def recall_row(stream: np.ndarray, rng: np.random.Generator, length: int, spec: RecallSpec, *, vocab_size: int,
               recall_id: int, query_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One recall row of ``length`` tokens: ``(ids [length], loss_mask [length - 1],
    answer_mask [length - 1])``; the masks mark targets ``ids[1:]`` (answer: queried values)."""
    gap = length - spec.row_tokens(0)
    if gap < spec.min_gap:
        raise ValueError(f"a recall row of {length} tokens leaves a gap of {gap} < min_gap {spec.min_gap}")
    choices = vocab_size - spec.first_id
    if choices < 2 * spec.pairs:
        raise ValueError(f"vocabulary too small for {spec.pairs} distinct keys")
    keys = spec.first_id + rng.choice(choices, spec.pairs, replace=False)
    values = spec.first_id + rng.integers(0, choices, spec.pairs)
    order = rng.permutation(spec.pairs)
    pairs = np.stack([keys, values], axis=1).reshape(-1)
    queries = np.stack([keys[order], values[order]], axis=1).reshape(-1)
    ids = np.concatenate([[recall_id], pairs, _window(stream, rng, gap), [query_id], queries]).astype(np.int32)
    loss = np.zeros(length - 1, np.float32)
    answer = np.zeros(length - 1, np.float32)
    g0 = 1 + 2 * spec.pairs  # first gap token
    loss[g0:g0 + gap - 1] = 1.0  # targets inside the gap (its first token follows the pair list)
    q0 = g0 + gap + 1  # first query key
    answer[q0 + np.arange(spec.pairs) * 2] = 1.0  # target after key j is value j
    return ids, loss + answer, answer


def sample_batch(stream: np.ndarray, *, seed: int, step: int, batch: int, seq_len: int,
                 recall: Optional[RecallSpec] = None, vocab_size: int = 0, recall_id: int = 1,
                 query_id: int = 2) -> dict[str, np.ndarray]:
    """The batch of training step ``step``: ``ids [B, seq_len + 1]`` int32, ``mask [B, seq_len]``
    float32 (which targets count) and ``answer [B, seq_len]`` (recall answers). Rows are
    windows of ``stream`` at offsets from a generator seeded by ``(seed, step)``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, step]))
    n_recall = 0 if recall is None else int(round(recall.fraction * batch))
    ids = np.zeros((batch, seq_len + 1), np.int32)
    mask = np.ones((batch, seq_len), np.float32)
    answer = np.zeros((batch, seq_len), np.float32)
    for b in range(batch):
        if b < n_recall:
            ids[b], mask[b], answer[b] = recall_row(stream, rng, seq_len + 1, recall, vocab_size=vocab_size,
                                                    recall_id=recall_id, query_id=query_id)
        else:
            ids[b] = _window(stream, rng, seq_len + 1)
    return {"ids": ids, "mask": mask, "answer": answer}


def eval_windows(stream: np.ndarray, *, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows ``[N, seq_len + 1]`` int32 evenly spread over ``stream`` (at most
    ``max_windows``; all of the stream's disjoint windows when it holds fewer)."""
    n = min(max_windows, stream.size // (seq_len + 1))
    if n < 1:
        raise ValueError(f"held-out stream of {stream.size} tokens is shorter than one window of {seq_len + 1}")
    starts = np.linspace(0, stream.size - (seq_len + 1), n).astype(np.int64)
    return np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)


__all__ = [
    "Corpus",
    "DataSpec",
    "EOS",
    "QUERY",
    "RECALL",
    "RecallSpec",
    "SPECIAL_TOKENS",
    "default_source",
    "eval_windows",
    "file_sha256",
    "is_held_out",
    "list_sources",
    "load_corpus",
    "prepare_data",
    "recall_row",
    "sample_batch",
    "tokenize_texts",
    "tokenizer_config",
    "train_tokenizer",
]
