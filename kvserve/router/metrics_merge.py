"""One Prometheus page from several: each replica's /metrics with a `replica` label added to every
sample, families kept together under one HELP/TYPE header (the text format requires it)."""
from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_metrics(pages: dict[str, str]) -> str:
    """`pages`: replica name -> its /metrics text. Returns one page in the text format."""
    headers: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines, from the first page that has it
    owner: dict[str, str] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in pages.items():
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                if owner.setdefault(family, replica) == replica:
                    headers.setdefault(family, []).append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            label = f'replica="{replica}"'
            labels = f"{{{label},{labels[1:]}" if labels and labels != "{}" else f"{{{label}}}"
            samples.setdefault(family, []).append(f"{name}{labels}{rest}")
    lines = []
    for family in dict.fromkeys([*headers, *samples]):
        lines.extend(headers.get(family, ()))
        lines.extend(samples.get(family, ()))
    return "\n".join(lines) + "\n"
