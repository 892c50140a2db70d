"""Layer profiles: which paths of a box go to which layer, and which paths are never captured.

A profile is YAML (see layers/*.yaml). Paths are globs relative to the box root:
  "/opt/app/models/**"  anchored at the root ("**" crosses directories, "*" does not);
  "*.pem"               a pattern with no "/" matches a file or directory name anywhere.
A pattern matches a path when it matches the path or one of its parent directories.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Optional

from snapshotter.errors import SnapError, UsageError
from snapshotter.state import MARKER, configured_state_dir, read_marshalled, state_dir, write_marshalled
from snapshotter.version import __version__

COMPRESSIONS = ("zstd", "gzip", "none")
REST = "rest"
MiB = 1024 * 1024

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TIB": 1024**4}


def parse_size(value) -> int:
    """'64MiB', '9.5GB', 1024 -> bytes."""
    if isinstance(value, int) and value >= 0:
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise UsageError(f"size {value!r} is not valid", "write it like 512MiB, 9.5GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def glob_regex(pattern: str, below: bool = True) -> str:
    """Translate one glob to a regex over root-relative paths (no leading slash). With `below`, the
    regex also matches every path under a match."""
    anchored = pattern.startswith("/") or "/" in pattern.rstrip("/")
    pat = pattern.strip("/")
    if pat.endswith("/**"):
        pat = pat[:-3]  # "dir/**" also takes dir itself; everything below comes with the suffix
    out, i = [], 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(c))
            i += 1
    body = "".join(out)
    # Matching a parent directory counts: "a/b" matches "a/b/c".
    suffix = "(?:/.*)?" if below else ""
    return f"{body}{suffix}" if anchored else f"(?:.*/)?{body}{suffix}"


def _compile(patterns: list[str], below: bool) -> Optional[re.Pattern]:
    return re.compile("|".join(f"(?:{glob_regex(p, below)})" for p in patterns), re.S) if patterns else None


def _name_only(pattern: str) -> bool:
    """A glob that matches a single name anywhere ("*.pem", ".env"): no "/" and no "**"."""
    return "/" not in pattern.strip("/") and not pattern.startswith("/") and "**" not in pattern


def _literal_last_name(pattern: str) -> Optional[str]:
    """The last name of a glob when it has no wildcard ("**/.docker/config.json" -> "config.json"),
    and nothing before it can reach into it: a "**" glued to other characters ("run-**/key.json")
    also matches "run-key.json", so such a glob has no literal last name."""
    segments = pattern.strip("/").split("/")
    last = segments[-1]
    if not last or "*" in last or "?" in last:
        return None
    return last if all(seg == "**" or "**" not in seg for seg in segments[:-1]) else None


class PathSet:
    """A compiled list of globs; `match(path)` takes a root-relative path.

    Without `below` (a glob then matches the path itself, never a parent of it), each glob is
    matched only where it can match, which is several times cheaper than one regex that must try
    every "/" of a deep path (a scan asks once per file): a glob of a single name anywhere ("*.pem")
    against the path's last name (such a glob cannot span a "/"), and a glob ending in a literal
    name ("**/.docker/config.json") only on paths with that last name."""

    def __init__(self, patterns: Iterable[str], below: bool = True):
        self.patterns = [p for p in patterns if p]
        self._below = below
        # Compiled at the first match: a commit that finds nothing changed asks none (~5 ms of regexes).
        self._compiled: Optional[tuple] = None

    def _compile_all(self) -> tuple:
        below = self._below
        names = [p for p in self.patterns if not below and _name_only(p)]
        by_last: dict[str, list[str]] = {}
        for p in self.patterns:
            if not below and p not in names and (last := _literal_last_name(p)) is not None:
                by_last.setdefault(last, []).append(p)
        grouped = set(names).union(*by_last.values())
        self._compiled = (_compile([p.strip("/") for p in names], below=False),
                          {last: _compile(ps, below) for last, ps in by_last.items()},
                          _compile([p for p in self.patterns if p not in grouped], below))
        return self._compiled

    def match(self, path: str) -> bool:
        names, by_last, rest = self._compiled or self._compile_all()
        name = path.rpartition("/")[2]
        if names is not None and names.fullmatch(name):
            return True
        if (by_name := by_last.get(name)) is not None and by_name.fullmatch(path):
            return True
        return bool(rest and rest.fullmatch(path))


# A private key in its first bytes: PEM ("-----BEGIN RSA PRIVATE KEY-----", "... OPENSSH PRIVATE KEY",
# "... ENCRYPTED PRIVATE KEY", "... PGP PRIVATE KEY BLOCK"), PuTTY's .ppk, SSH.com's format, or DER
# (a SEQUENCE opening with INTEGER 0 or 1, where a certificate opens with another SEQUENCE).
PRIVATE_KEY_HEAD = 16 * 1024  # bytes read: a key sits at the top, or after a certificate or two
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|PuTTY-User-Key-File-[0-9]+:"
                          rb"|---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----")
_DER_PRIVATE_KEY = re.compile(rb"\x30(?:[\x00-\x7f]|\x81.|\x82..|\x83...)\x02\x01[\x00\x01]", re.S)
PACKAGE_DIRS = ("site-packages", "dist-packages")  # installed Python packages: public files, test keys


def holds_private_key(head: bytes) -> bool:
    """Whether the first bytes of a file hold a private key (certificates and CA bundles do not)."""
    return bool(_PRIVATE_KEY.search(head) or _DER_PRIVATE_KEY.match(head))


class SecretRules:
    """Which paths of a box are credentials, left out of snapshots.

    `names` are globs; one ending in "/" is meant for directories and leaves out a directory with
    everything below it ("/root/.docker/", ".ssh/"); any other leaves out only a regular file
    (".env", "*_history", "id_rsa"): a venv called .env or a chat_history/ directory is content.
    `private_keys` are globs of regular files that are secrets only when their first bytes hold a
    private key ("*.pem", "*.key": a CA bundle is kept); they never apply inside site-packages."""

    def __init__(self, names: Iterable[str] = (), private_keys: Iterable[str] = ()):
        names = [n for n in names if n]
        self.names = names
        self.private_keys = [k for k in private_keys if k]
        self._dirs = PathSet([n.rstrip("/") for n in names if n.endswith("/")])
        self._files = PathSet([n for n in names if not n.endswith("/")], below=False)
        self._keys = PathSet(self.private_keys, below=False)
        # A scan asks about every file of a directory in a row: its verdict is asked for once.
        self._in_secret_dir = lru_cache(maxsize=256)(self._dirs.match)

    def under_secret_dir(self, path: str) -> bool:
        """`path` lies in a directory the rules leave out (or is one, if it is a directory)."""
        return self._dirs.match(path)

    def is_secret(self, path: str, is_dir: bool, is_file: bool, read_head: Callable[[int], bytes]) -> bool:
        """Whether the box path `path` (of the given kind) is a secret; `read_head(n)` reads the first
        n bytes of a regular file, and is called only for a private-key candidate."""
        if is_dir:
            return self._dirs.match(path)
        if self._in_secret_dir(path.rpartition("/")[0]):
            return True
        if not is_file:
            return False  # a symlink or device holds no secret of its own
        if self._files.match(path):
            return True
        if not self._keys.match(path) or any(d in path.split("/") for d in PACKAGE_DIRS):
            return False
        try:
            return holds_private_key(read_head(PRIVATE_KEY_HEAD))
        except PermissionError:
            return True  # unreadable to us, as private keys are to all but their owner


@dataclass
class LayerRule:
    name: str
    paths: PathSet = field(default_factory=lambda: PathSet([]))
    venv: bool = False  # any directory holding pyvenv.cfg belongs here
    min_size: Optional[int] = None  # any regular file at least this big belongs here
    extensions: tuple[str, ...] = ()
    compression: str = "zstd"
    # Weight handling: a file at least `file_layer_min` big gets a layer of its own; the layer's
    # other files are bundled into layers of at most `bundle_max` bytes (stable when one is added).
    file_layer_min: Optional[int] = None
    bundle_max: Optional[int] = None

    @property
    def weights(self) -> bool:
        """A weights layer (single-file layers and bundles): committed last, so that a restore can
        start the app (`--then`) while these still arrive."""
        return self.file_layer_min is not None or self.bundle_max is not None


@dataclass
class Profile:
    name: str
    layers: list[LayerRule]
    exclude: PathSet
    secrets: SecretRules
    include_secrets: bool = False
    zstd_level: int = 3
    # `--base scratch` captures only these root-relative paths (with their parent directories);
    # empty: the whole root. Ignored with a real base, whose diff already says what changed.
    include: tuple[str, ...] = ()

    @property
    def layer_names(self) -> list[str]:
        return [r.name for r in self.layers]

    def leaves_out(self, path: str) -> bool:
        """A path never captured whatever it holds: excluded, or in (or being) a secret directory
        (unless the profile keeps secrets). Secret files are told by their kind and content."""
        return self.exclude.match(path) or (not self.include_secrets and self.secrets.under_secret_dir(path))

    def is_secret(self, path: str, is_dir: bool, is_file: bool, read_head: Callable[[int], bytes]) -> bool:
        """A secret this profile leaves out (see SecretRules)."""
        return not self.include_secrets and self.secrets.is_secret(path, is_dir, is_file, read_head)

    def classify(self, path: str, size: int, is_file: bool, venv_roots: "VenvRoots") -> str:
        """The layer a path goes to: the first rule that claims it, else `rest`."""
        for rule in self.layers:
            if rule.name == REST:
                continue
            if rule.venv and venv_roots.contains(path):
                return rule.name
            if rule.paths.match(path):
                return rule.name
            if is_file and rule.min_size is not None and size >= rule.min_size:
                return rule.name
            if is_file and rule.extensions and path.lower().endswith(rule.extensions):
                return rule.name
        return REST


class VenvRoots:
    """Directories that hold a pyvenv.cfg, i.e. Python virtual environments."""

    def __init__(self, roots: Iterable[str] = ()):
        self.roots = set(roots)
        self._dirs: dict[str, bool] = {}  # directory -> in a venv: a plan asks for every file of a dir

    def add(self, root: str) -> None:
        self.roots.add(root)
        self._dirs.clear()

    def contains(self, path: str) -> bool:
        if path in self.roots:
            return True
        # Up to the nearest directory already answered (a loop: a box may be thousands deep), then
        # the directories on the way get that answer.
        todo = []
        d = path.rpartition("/")[0]
        while d and d not in self._dirs and d not in self.roots:
            todo.append(d)
            d = d.rpartition("/")[0]
        found = bool(d) and (d in self.roots or self._dirs[d])
        for t in todo:
            self._dirs[t] = found
        return found


def available_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("snapshotter.layers").iterdir() if p.name.endswith(".yaml"))


PROFILE_MAX = 1 << 20  # bytes of a profile file: the shipped ones are under 4 KiB


def load_profile(name_or_path: str = "default") -> Profile:
    """Load a profile by name (a file in layers/) or by path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not path.is_file():  # a directory or a device (/dev/zero: read without end) is no profile
            what = "is not a regular file" if os.path.lexists(path) else "does not exist"
            raise UsageError(f"profile file {name_or_path!r} {what}")
        if path.stat().st_size > PROFILE_MAX:  # a profile is a few KiB: parsing MBs of YAML took 100s of MB
            raise UsageError(f"profile file {name_or_path!r} is {path.stat().st_size:,} bytes: over the "
                             f"{PROFILE_MAX // 1024} KiB a profile may be")
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read profile file {name_or_path!r}: {getattr(e, 'strerror', None) or e.reason}")
    else:
        res = resources.files("snapshotter.layers") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise UsageError(f"no profile named {name_or_path!r}", f"known profiles: {', '.join(available_profiles())}")
        text, source = res.read_text(), f"layers/{name_or_path}.yaml"
    return parse_profile(text, source)


@lru_cache(maxsize=None)
def _default_text() -> str:
    return (resources.files("snapshotter.layers") / "default.yaml").read_text()


def parse_profile(text: str, source: str = "<profile>") -> Profile:
    doc = _yaml_document(text, source)
    if not isinstance(doc, dict):
        raise UsageError(f"profile {source} must be a YAML mapping with a 'layers' list")
    unknown = set(doc) - {"name", "description", "extends", "layers", "exclude", "secrets", "private_keys",
                          "include_secrets", "zstd_level", "include"}
    if unknown:
        raise UsageError(f"profile {source}: unknown key(s) {', '.join(sorted(unknown))}")
    base: dict = {}
    if doc.get("extends"):
        if doc["extends"] != "default":
            raise UsageError(f"profile {source}: only 'extends: default' is supported")
        base = _yaml_document(_default_text(), "layers/default.yaml")
    layers_doc = doc.get("layers", base.get("layers"))
    if not isinstance(layers_doc, list) or not layers_doc:
        raise UsageError(f"profile {source}: 'layers' must be a non-empty list")
    rules: list[LayerRule] = []
    for i, item in enumerate(layers_doc):
        rules.append(_parse_rule(item, f"{source}: layers[{i}]"))
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise UsageError(f"profile {source}: layer names must be unique")
    if REST not in names:
        rules.append(LayerRule(REST))
    def both(key: str) -> list[str]:  # the base's list, then this profile's
        return _str_list(base.get(key, []), source, key) + _str_list(doc.get(key, []), source, key)

    exclude, secrets, keys = both("exclude"), both("secrets"), both("private_keys")
    level = doc.get("zstd_level", base.get("zstd_level", 3))
    if not isinstance(level, int) or not 1 <= level <= 19:
        raise UsageError(f"profile {source}: zstd_level must be an integer from 1 to 19")
    return Profile(
        name=str(doc.get("name", Path(source).stem)),
        layers=rules,
        exclude=PathSet(exclude),
        secrets=SecretRules(secrets, keys),
        include_secrets=bool(doc.get("include_secrets", False)),
        zstd_level=level,
        include=tuple(include_path(p, f"profile {source}: include")
                      for p in _str_list(doc.get("include", []), source, "include")),
    )


def include_path(path: str, where: str = "--include") -> str:
    """An included path (/home/ubuntu/ComfyUI, as on the box) as a root-relative path."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or "\0" in path:
        raise UsageError(f"{where} {path!r} is not a path inside the root",
                         "write it as on the box, e.g. /home/ubuntu/ComfyUI")
    return "/".join(parts)


def _parse_rule(item, where: str) -> LayerRule:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise UsageError(f"profile {where}: each layer needs a 'name'")
    unknown = set(item) - {"name", "paths", "venv", "min_size", "extensions", "compression", "file_layer_min",
                           "bundle_max"}
    if unknown:
        raise UsageError(f"profile {where}: unknown key(s) {', '.join(sorted(unknown))}")
    name = item["name"]
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,40}", name):
        raise UsageError(f"profile {where}: layer name {name!r} must be lowercase letters, digits, - or _")
    compression = item.get("compression", "zstd")
    if compression not in COMPRESSIONS:
        raise UsageError(f"profile {where}: compression must be one of {', '.join(COMPRESSIONS)}")
    exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}"
                 for e in _str_list(item.get("extensions", []), where, "extensions"))
    return LayerRule(
        name=name,
        paths=PathSet(_str_list(item.get("paths", []), where, "paths")),
        venv=bool(item.get("venv", False)),
        min_size=parse_size(item["min_size"]) if item.get("min_size") is not None else None,
        extensions=exts,
        compression=compression,
        file_layer_min=parse_size(item["file_layer_min"]) if item.get("file_layer_min") is not None else None,
        bundle_max=parse_size(item["bundle_max"]) if item.get("bundle_max") is not None else None,
    )


def _str_list(value, where: str, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"profile {where}: '{key}' must be a list of strings")
    return value


# Parsed profiles kept in the state dir, so that a command whose profile was read before does not
# import PyYAML (~10 ms of CPU a command, ~2% of a nothing-changed commit of a 36k-path venv). One
# file (state.write_marshalled): {sha256 of a profile's text: its document}.
_PARSED = "parsed-profiles"
_PARSED_KEEP = 16  # the texts parsed last are kept (a profile edited often leaves no trail)
_PARSED_FORMAT = 1


def _yaml_document(text: str, source: str):
    """The YAML document of a profile's `text`: as the state dir keeps it, else parsed by PyYAML's
    safe loader (libyaml's where PyYAML was built with it) and kept there."""
    # surrogatepass: one key per text (surrogateescape would give a lone surrogate another text's)
    key = hashlib.sha256(f"{_PARSED_FORMAT}\0{__version__}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
    kept = _read_parsed()
    if key in kept:
        return kept[key]
    import yaml  # only here: most commands find their profile kept

    try:
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"profile {source} is not valid YAML{where}")
    _keep_parsed(kept, key, doc)
    return doc


def _parsed_path() -> Optional[str]:
    """Where the parsed profiles are kept; None unless the state dir is already snap's (marked): none
    is made, claimed or tightened for them. It is checked as ours (state_dir) before anything in it
    is read: a profile decides what is captured."""
    marked = os.path.lexists(os.path.join(configured_state_dir(), MARKER))
    return os.path.join(state_dir(), _PARSED) if marked else None


def _read_parsed() -> dict:
    """What the state dir keeps ({} when it keeps nothing whole, or has no state dir yet)."""
    try:
        path = _parsed_path()
    except (OSError, SnapError):  # not snap's to read (its commands say why), or unreadable
        return {}
    kept, _ = read_marshalled(path) if path is not None else (None, None)
    return kept if type(kept) is dict else {}


def _keep_parsed(kept: dict, key: str, doc) -> None:
    """Add `doc` to what the state dir keeps, if there is a state dir."""
    kept = {k: v for k, v in kept.items() if k != key}
    kept[key] = doc
    try:
        path = _parsed_path()
        if path is not None:
            write_marshalled(path, dict(list(kept.items())[-_PARSED_KEEP:]))
    except (OSError, ValueError, SnapError):  # a document marshal cannot hold (a YAML date), a read-only dir
        pass
