"""Local data read through Hugging Face ``datasets`` (``data.format: hf``): JSON / JSON Lines, CSV, Parquet, text and
Arrow files, and folders written by ``save_to_disk``.

Only local paths are read: a file by its suffix (:data:`FILE_BUILDERS`, with ``load_dataset(<builder>,
data_files=...)`` into a temporary cache, kept in memory), a folder with ``load_from_disk`` (a ``DatasetDict``'s
split by name). A name that is not a local file or folder -- a hub dataset name -- is a one-line error: nothing is
downloaded. The readers turn a table into what the native readers produce (the lm task's text, the sft task's
conversation records, translation's sentence pairs), so tokenisation, packing and the memmap caches stay one path.
Every problem is a one-line :class:`~tokenloom.errors.DataError` naming the setting, its value and the file; a
missing column lists the columns there are. ``datasets`` is imported lazily (the ``hf`` extra).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ConfigError, DataError

# file suffix -> the datasets builder that reads it
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text",
                 ".arrow": "arrow"}
_SAVED = ("state.json", "dataset_dict.json")  # what save_to_disk writes (a Dataset, a DatasetDict)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.format: hf reads data with Hugging Face `datasets`: pip install 'tokenloom[hf]'") \
            from None
    return datasets


class Table(NamedTuple):
    """A ``datasets.Dataset`` and where it came from (``where`` names it in messages)."""

    dataset: Any
    where: str

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)

    def __len__(self) -> int:
        return len(self.dataset)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:200]


def _not_local(path: str, setting: str) -> DataError:
    return DataError(f"{setting}={path!r} is not a local file or folder: data.format hf reads local "
                     f"{', '.join(sorted(set(FILE_BUILDERS)))} files and save_to_disk folders, and downloads nothing")


def open_table(path: str | Path, setting: str = "data.path", split: str = "train") -> Table:
    """The table at ``path``: a file read by its suffix, a ``save_to_disk`` folder (a ``DatasetDict``'s ``split``)."""
    path = Path(path)
    if not path.exists():
        raise _not_local(str(path), setting)
    datasets = _datasets()
    if path.is_dir():
        if not any((path / name).is_file() for name in _SAVED):
            raise DataError(f"{setting}={str(path)!r} is a folder but not one save_to_disk wrote (no "
                            f"{' or '.join(_SAVED)} in it)")
        try:
            loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
        except Exception as err:  # datasets and pyarrow raise many kinds; one line names the folder
            raise DataError(f"{setting}: cannot read the dataset folder {path} ({_first_line(err)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{setting}={str(path)!r} has no split {split!r} (splits: {', '.join(loaded)}); "
                                f"point it at the split's folder, e.g. {path / next(iter(loaded))}")
            return Table(loaded[split], f"{path}[{split}]")
        return Table(loaded, str(path))
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{setting}={str(path)!r}: data.format hf reads files ending in "
                        f"{', '.join(sorted(FILE_BUILDERS))}, not {path.suffix or 'no suffix'!r}")
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="tokenloom-hf-") as cache:  # no cache left behind
            table = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                          keep_in_memory=True)
    except Exception as err:  # a file the builder cannot parse: one line naming it
        raise DataError(f"{setting}: cannot read {path} as {builder} ({_first_line(err)})") from None
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    return Table(table, str(path))


def column(table: Table, name: str, setting: str) -> list[Any]:
    """The values of column ``name``; a missing column names ``setting`` and the columns there are."""
    if name not in table.columns:
        raise DataError(f"{setting}={name!r} is not a column of {table.where} (columns: {', '.join(table.columns)})")
    return list(table.dataset[name])


def texts(table: Table, name: str, setting: str) -> list[str]:
    """Column ``name`` as strings; a value that is not a string names its row (``path[i]``)."""
    values = column(table, name, setting)
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(f"{table.where}[{i}]: {setting}={name!r} holds {type(value).__name__} "
                            f"{str(value)[:40]!r}, not text")
    return values


def read_texts(path: str | Path, field: str, setting: str = "data.text_field") -> list[str]:
    """The ``field`` column of the table at ``path`` (the lm task's documents)."""
    table = open_table(path)
    values = texts(table, field, setting)
    if not any(v.strip() for v in values):
        raise DataError(f"{table.where}: no text in column {field!r} ({len(values)} rows)")
    return values


def read_conversation_records(path: str | Path, *, messages_field: str, prompt_field: str,
                              response_field: str, setting: str = "data.path") -> Iterator[tuple[str, dict]]:
    """(``path[i]``, ``{"messages": ...}`` or ``{"prompt", "response"}``) for each row of the table at ``path``, from
    its ``messages_field`` column, else its ``prompt_field`` and ``response_field`` columns (the sft task's records,
    read as its JSONL lines are)."""
    table = open_table(path, setting)
    if messages_field in table.columns:
        keys = {"messages": messages_field}
    elif prompt_field in table.columns and response_field in table.columns:
        keys = {"prompt": prompt_field, "response": response_field}
    else:
        raise DataError(f"data.messages_field={messages_field!r} is not a column of {table.where}, nor are "
                        f"data.prompt_field={prompt_field!r} and data.response_field={response_field!r} "
                        f"(columns: {', '.join(table.columns)})")
    if len(table) == 0:
        raise DataError(f"{table.where}: no conversations (the table has no rows)")
    values = {key: list(table.dataset[name]) for key, name in keys.items()}
    for i in range(len(table)):
        yield f"{table.where}[{i}]", {key: column_values[i] for key, column_values in values.items()}


def split_table(folder: str | Path, split: str, setting: str) -> Table:
    """Split ``split`` of the folder ``folder``: a split of the ``DatasetDict`` save_to_disk wrote there, a
    ``save_to_disk`` folder ``folder/split``, or a file ``folder/split.<suffix>`` (:data:`FILE_BUILDERS`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _not_local(str(folder), "data.dir")
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = list(json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"])
        except (OSError, ValueError, KeyError, TypeError):
            splits = [split]  # unreadable: load_from_disk names the problem
        if split not in splits:
            raise DataError(f"{setting}={split!r} is not a split of {folder} (splits: {', '.join(splits)})")
        return open_table(folder, "data.dir", split)
    if (folder / split).is_dir():
        return open_table(folder / split, setting)
    files = [folder / f"{split}{suffix}" for suffix in FILE_BUILDERS if (folder / f"{split}{suffix}").is_file()]
    if len(files) > 1:
        raise DataError(f"{setting}={split!r}: {folder} holds {', '.join(f.name for f in files)}; keep one")
    if not files:
        found = sorted({p.name.split(".")[0] for p in folder.iterdir()
                        if p.suffix.lower() in FILE_BUILDERS or (p.is_dir() and (p / "state.json").is_file())})
        suffixes = "|".join(sorted({suffix[1:] for suffix in FILE_BUILDERS}))
        raise DataError(f"{setting}={split!r} is not a split of {folder} (no {split}.<{suffixes}> file nor "
                        f"save_to_disk folder {split}/; splits there: {', '.join(found) or 'none'})")
    return open_table(files[0], setting)


def read_pairs(table: Table, *, source_field: str, target_field: str, translation_field: str, source_lang: str,
               target_lang: str) -> list[tuple[str, str]]:
    """(source, target) sentences of a table: its ``source_field`` and ``target_field`` columns, else its
    ``translation_field`` column of ``{language: sentence}`` (the layout of Hugging Face's wmt datasets) read at
    ``source_lang`` and ``target_lang``."""
    if source_field in table.columns and target_field in table.columns:
        sources = texts(table, source_field, "data.source_field")
        return list(zip(sources, texts(table, target_field, "data.target_field"), strict=True))
    if translation_field not in table.columns:
        missing = source_field if source_field not in table.columns else target_field
        setting = "data.source_field" if missing == source_field else "data.target_field"
        raise DataError(f"{setting}={missing!r} is not a column of {table.where}, nor is "
                        f"data.translation_field={translation_field!r} (columns: {', '.join(table.columns)})")
    pairs = []
    for i, row in enumerate(table.dataset[translation_field]):
        if not isinstance(row, dict):
            raise DataError(f"{table.where}[{i}]: data.translation_field={translation_field!r} holds "
                            f"{type(row).__name__}, not a {{language: sentence}} mapping")
        for setting, lang in (("data.source_lang", source_lang), ("data.target_lang", target_lang)):
            if not isinstance(row.get(lang), str):
                raise DataError(f"{table.where}[{i}]: {setting}={lang!r} is not a language of column "
                                f"{translation_field!r} (languages: {', '.join(map(str, row))})")
        pairs.append((row[source_lang], row[target_lang]))
    return pairs


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` (atomically) unless it already holds it: a file left as it was keeps its mtime, so
    the token caches keyed on it are reused without hashing it again."""
    from ..files import write_atomic

    data = text.encode("utf-8")
    if not (path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: tmp.write_bytes(data))
    return path


def one_line(sentence: str) -> str:
    """A sentence with its line breaks made spaces (line-aligned files keep one sentence a line)."""
    return " ".join(sentence.splitlines()) if "\n" in sentence or "\r" in sentence else sentence
