"""The ``--offload`` grammar, torch-free: tier lists as users type them.

``parse_offload_spec("host@2GiB,disk:/var/kv@20GiB,redis://127.0.0.1:6379/0")`` gives one
:class:`TierSpec` per comma-separated entry, fastest first:

- ``device[@SIZE]``                 where attention runs (CUDA memory, or RAM on CPU)
- ``host[@SIZE]``                   CPU RAM
- ``disk:PATH[@SIZE]``              a directory (created if missing)
- ``redis://HOST:PORT/DB[@SIZE]``   a shared Redis store (``rediss://`` and ``unix://`` too)

``@SIZE`` is a capacity in bytes (:func:`lessmem.base.units.parse_bytes`: KB 1000-based,
KiB and a bare K 1024-based); without it the tier is unbounded. The planner reads the
same strings (``lessmem plan --offload``) and writes them back (:func:`format_offload_spec`)
for ``lessmem generate``/``eval``; ``lessmem.offload.spec.build_tier`` builds the tier
one names (this module stays torch-free and imports nothing above ``base``).

Example:
    >>> specs = parse_offload_spec("host@1GiB,disk:/tmp/kv")
    >>> [(s.kind, s.target, s.capacity) for s in specs], format_offload_spec(specs)
    ([('host', None, 1073741824), ('disk', '/tmp/kv', None)], 'host@1GiB,disk:/tmp/kv')
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import parse_bytes, size_text  # size_text re-exported: callers import it from here

KINDS = ("device", "host", "disk", "remote")


@dataclass(frozen=True)
class TierSpec:
    """One tier as written on the command line: ``kind``, ``target`` (path or URL), ``capacity``."""

    kind: str
    target: str | None = None
    capacity: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tier kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind in ("disk", "remote") and not self.target:
            raise ValueError(f"a {self.kind} tier needs a {'path' if self.kind == 'disk' else 'URL'}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 0):
            raise ValueError(f"capacity={self.capacity!r} must be a non-negative int or None")

    def to_dict(self) -> dict:
        """The fields, exactly (a Redis password included: use :meth:`to_text` or
        :func:`redact_url` for anything shown or written to a report)."""
        return {"kind": self.kind, "target": self.target, "capacity": self.capacity}

    def to_text(self, reveal: bool = False) -> str:
        """The entry as ``--offload`` takes it (``parse_offload_spec`` reads it back exactly,
        except that a Redis password prints as ``***`` unless ``reveal=True``).

        Example:
            >>> TierSpec("disk", "/tmp/kv", 3 * 2**30).to_text(), TierSpec("host").to_text()
            ('disk:/tmp/kv@3GiB', 'host')
            >>> TierSpec("remote", "redis://:s3cret@10.0.0.5:6379/0").to_text()
            'redis://:***@10.0.0.5:6379/0'
        """
        target = self.target if reveal or self.kind != "remote" else redact_url(self.target)
        head = {"device": "device", "host": "host", "disk": f"disk:{target}"}.get(self.kind, target)
        return head if self.capacity is None else f"{head}@{size_text(self.capacity)}"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``redis://user:***@host:6379/0``, also
    a ``password=`` query parameter), for messages, reprs and reports.

    Example:
        >>> redact_url("redis://:pw@h:6379/0"), redact_url("unix:///run/r.sock?db=0&password=pw")
        ('redis://:***@h:6379/0', 'unix:///run/r.sock?db=0&password=***')
    """
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, tail = url.split("://", 1)
    netloc = ""
    if "@" in tail:  # the last '@': a password may hold '/', '?', '#' or '@' unescaped
        userinfo, tail = tail.rsplit("@", 1)
        netloc = (userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else userinfo) + "@"
    if "?" in tail:
        path, query = tail.split("?", 1)
        parts = [p.split("=", 1)[0] + "=***" if p.lower().startswith("password=") else p
                 for p in query.split("&")]
        tail = path + "?" + "&".join(parts)
    return f"{scheme}://{netloc}{tail}"


def redact_offload_text(text):
    """An ``--offload`` string with every Redis password shown as ``***`` (for reports and
    messages that echo what the user typed); anything but a str is returned as is.

    Example:
        >>> redact_offload_text("host@1GiB,redis://:pw@h:6379/0@2MiB")
        'host@1GiB,redis://:***@h:6379/0@2MiB'
    """
    if not isinstance(text, str):
        return text
    out = []
    for entry in text.split(","):
        head, size = entry, ""
        if "@" in entry:
            try:
                parse_bytes(entry.rsplit("@", 1)[1])
                head, size = entry.rsplit("@", 1)[0], "@" + entry.rsplit("@", 1)[1]
            except ValueError:
                pass
        out.append(redact_url(head) + size)
    return ",".join(out)


def format_offload_spec(specs) -> str:
    """The ``--offload`` string for a list of :class:`TierSpec` (inverse of ``parse_offload_spec``)."""
    return ",".join(s.to_text() for s in specs)


def _split_size(entry: str) -> tuple[str, int | None]:
    if "@" in entry:
        head, tail = entry.rsplit("@", 1)
        try:
            return head, parse_bytes(tail)
        except ValueError:
            if not entry.startswith(("redis://", "rediss://", "unix://")):
                raise
    return entry, None


def parse_offload_spec(text: str) -> list[TierSpec]:
    """``"host,disk:/path@10GiB,redis://h:6379/0"`` -> list of :class:`TierSpec` (see module doc)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"offload spec {text!r} is empty; e.g. 'host,disk:/path,redis://127.0.0.1:6379/0'")
    out = []
    for raw in text.split(","):
        entry, cap = _split_size(raw.strip())
        if entry in ("device", "host"):
            out.append(TierSpec(entry, None, cap))
        elif entry.startswith("disk:") and len(entry) > 5:
            out.append(TierSpec("disk", entry[5:], cap))
        elif entry.startswith(("redis://", "rediss://", "unix://")):
            out.append(TierSpec("remote", entry, cap))
        else:
            raise ValueError(f"offload tier {raw.strip()!r} is not understood; allowed: device[@SIZE], "
                             "host[@SIZE], disk:PATH[@SIZE], redis://HOST:PORT/DB[@SIZE]")
    kinds = [s.kind for s in out]
    for k in ("device", "host"):
        if kinds.count(k) > 1:
            raise ValueError(f"offload spec {text!r} names the {k} tier twice")
    return out
