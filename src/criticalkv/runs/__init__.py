"""Results folders shared by the sweeps and the analysis: a JSON config file (the run identity
and its history) beside an append-only JSONL log of records, resumed by key.

* :mod:`~criticalkv.runs.jsonl` -- the append-only, crash-safe JSONL log.
* :mod:`~criticalkv.runs.folder` -- the config file: identity check on resume, history, atomic writes.
* :mod:`~criticalkv.runs.lock` -- one writer at a time: an OS file lock on the folder.
* :mod:`~criticalkv.runs.provenance` -- library versions, platform and git commit.
"""

from criticalkv.runs.folder import (
    FolderLayout,
    open_folder,
    read_json,
    write_atomically,
    write_json,
    write_text_atomically,
)
from criticalkv.runs.jsonl import JsonLines, ResultsWriteError
from criticalkv.runs.lock import DEFAULT_WAIT, FolderBusy, check_folder_path, writer_lock
from criticalkv.runs.provenance import git_commit, provenance, versions

__all__ = [
    "DEFAULT_WAIT",
    "FolderBusy",
    "FolderLayout",
    "JsonLines",
    "ResultsWriteError",
    "check_folder_path",
    "git_commit",
    "open_folder",
    "provenance",
    "read_json",
    "versions",
    "write_atomically",
    "write_json",
    "write_text_atomically",
    "writer_lock",
]
