"""The commands' resumable results file: one CSV row per finished run,
appended and flushed to disk as the run ends, so a killed job loses at most
the run in progress and a re-run skips what is done."""

import csv
import os

from keras_geosam.experiments.arguments import from_csv


class ResultsFile:
    """A CSV of finished runs.

    Reading drops a line cut short by a kill, and rows that `is_complete`
    rejects, and rewrites the file without them. Values are parsed back to
    int or float where they parse, except the `text_fields`.

    Args:
        path: the CSV (need not exist).
        fields: the columns every row has; None: the first row appended (or
            the file's header) fixes them.
        fresh: delete the file first.
        is_complete: ``f(raw_row) -> bool`` on the row as read (strings);
            None keeps every well-formed row.
        text_fields: columns kept as text (names that could look like
            numbers).

    Raises:
        ValueError: the file's header is not `fields`, or a row appended
            has other columns than the file.

    Example:

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "results.csv")
    >>> ResultsFile(path).append({"run": "a", "acc": 0.5})
    >>> ResultsFile(path).rows
    [{'run': 'a', 'acc': 0.5}]
    """

    def __init__(self, path, fields=None, fresh=False, is_complete=None, text_fields=()):
        self.path = os.fspath(path)
        self.fields = list(fields) if fields is not None else None
        self.is_complete = is_complete
        self.text_fields = set(text_fields)
        self.rows = []
        if fresh and os.path.exists(self.path):
            os.remove(self.path)
        if os.path.exists(self.path) and os.path.getsize(self.path):
            self._read()

    def _read(self):
        with open(self.path, newline="") as f:
            text = f.read()
        lines = text.splitlines(keepends=True)
        torn = bool(lines) and not lines[-1].endswith("\n")
        if torn:
            lines = lines[:-1]  # a kill mid-write
        reader = csv.DictReader(lines)
        header = list(reader.fieldnames or [])
        if self.fields is not None and header != self.fields:
            raise ValueError(
                f"{self.path} has other columns than this version writes ({header[:6]}...); pass --fresh "
                f"(fresh=True) to start it over, or another output folder."
            )
        self.fields = header
        raw = list(reader)
        good = [r for r in raw if None not in r and all(v is not None for v in r.values())
                and (self.is_complete is None or self.is_complete(r))]
        self.rows = [{k: (v if k in self.text_fields else from_csv(v)) for k, v in r.items()} for r in good]
        if torn or len(good) != len(raw):
            self._rewrite(good)

    def _rewrite(self, raw_rows):
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields)
            w.writeheader()
            w.writerows(raw_rows)
        os.replace(tmp, self.path)  # atomic: a kill leaves the old file or the new one

    def append(self, row):
        """Appends `row` (header first if the file is new) and flushes it to
        disk. Raises ValueError if its columns are not the file's."""
        if self.fields is not None and list(row) != self.fields:
            if set(row) != set(self.fields):
                raise ValueError(
                    f"{self.path} has other columns than this row ({sorted(set(row) ^ set(self.fields))[:6]} "
                    f"differ); pass --fresh (fresh=True) to start it over, or another output folder."
                )
            row = {k: row[k] for k in self.fields}
        new = self.fields is None or not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self.fields = list(row)
        # NumPy floats as Python floats: their repr reads back to the same number.
        clean = {k: (float(v) if type(v).__module__ == "numpy" and hasattr(v, "dtype") and v.dtype.kind == "f" else v)
                 for k, v in row.items()}
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields)
            if new:
                w.writeheader()
            w.writerow(clean)
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(dict(row))
