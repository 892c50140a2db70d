"""README.md and docs/*.md against the code: every `snap ...` command line in their code blocks
parses with the CLI's real options (the click command typer builds), and every relative link names
a file that exists and, with a #anchor, a heading of that file."""
import importlib
import os
import re
import shlex

import pytest
import typer

from snapshotter.cli import app

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs"))
                               if n.endswith(".md"))
PROGRAMS = ("snap", "boxsnap")


def click_of(command) -> object:
    """The exceptions of the click a command is made with: click's, or those of the copy newer typers
    carry (typer._click)."""
    for cls in type(command).__mro__:
        if cls.__name__ == "Command" and cls.__module__.endswith(".core"):
            return importlib.import_module(cls.__module__.rpartition(".")[0] + ".exceptions")
    raise AssertionError(f"no click Command under {type(command)}")


def read(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the code in a markdown page: fenced blocks and blocks indented by 4
    spaces after a blank line (list continuations are prose), with `\\` continuations joined."""
    out, lines, fence, indented = [], text.split("\n"), None, False
    for n, line in enumerate(lines, 1):
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            else:
                out.append((n, line))
            continue
        if line.strip().startswith(("```", "~~~")):
            fence = line.strip()[:3]
            continue
        if line.startswith("    ") and (indented or (n >= 2 and not lines[n - 2].strip())):
            indented = True
            out.append((n, line[4:]))
        elif line.strip():
            indented = False
    joined, pending = [], None
    for n, line in out:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (n, line)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
        else:
            joined.append(pending)
            pending = None
    return joined


def snap_invocations(line: str) -> list[list[str]]:
    """The argument lists of every snap (or boxsnap) run on a shell line: the program at a command's
    start (`snap`, `/usr/local/bin/snap`, systemd's `ExecStart=/usr/local/bin/snap`; after variable
    assignments, a cron schedule, `sudo`, `exec` or `flock [-OPTS] FILE`), the words after it up to
    the next `;`, `&`, `|` or redirection. A line that is no shell (a Dockerfile's, YAML) yields
    what shlex makes of it: `ln -s .../bin/snap` or an image called `.../snap` is no run of snap."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: not a shell line
        return []
    runs, start = [], 0
    for i, word in enumerate(words):
        if is_operator(word):
            start = i + 1
            continue
        program = re.sub(r"^Exec\w*=", "", word) if i == start else word
        if (program in PROGRAMS or re.fullmatch(r"/\S*/(snap|boxsnap)", program)) and only_wrappers(words[start:i]):
            args = []
            for w in words[i + 1:]:
                if is_operator(w):
                    break
                args.append(w)
            runs.append(args)
    return runs


def is_operator(word: str) -> bool:
    return bool(word) and all(c in "();<>|&" for c in word)


def only_wrappers(prefix: list[str]) -> bool:
    """Whether the words before a program leave it a command's program (not an argument)."""
    if len(prefix) >= 5 and all(re.fullmatch(r"[0-9*/,-]+", w) for w in prefix[:5]):
        prefix = prefix[5:]  # a crontab line's schedule
    while prefix:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", prefix[0]) or prefix[0] in ("sudo", "exec", "nohup"):
            prefix = prefix[1:]
        elif prefix[0] == "flock":
            rest = prefix[1:]
            while rest and rest[0].startswith("-"):
                rest = rest[1:]
            prefix = rest[1:]
        else:
            return False
    return True


def commands() -> list:
    found = []
    for page in PAGES:
        for n, line in code_lines(read(page)):
            for args in snap_invocations(line):
                found.append(pytest.param(args, id=f"{page}:{n}: snap {' '.join(args)}"[:150]))
    return found


def test_the_pages_hold_commands():
    """The scan itself works: the README and the provider recipes hold many commands (systemd and
    cron lines included), so a parser that finds none fails here, not silently."""
    by_page = {}
    for param in commands():
        page = param.id.split(":", 1)[0]
        by_page[page] = by_page.get(page, 0) + 1
    assert by_page.get("README.md", 0) >= 15 and by_page.get(os.path.join("docs", "providers.md"), 0) >= 5, by_page


@pytest.mark.parametrize("args", commands())
def test_command_line_parses(args):
    """Every option exists for its subcommand and takes the value given (ints, choices), every
    required argument is there, nothing is left over. Placeholders (REGISTRY, $BOX) are fine as
    arguments: they are strings to the parser."""
    group = typer.main.get_command(app)
    if not args or args[0] in ("--help", "-h"):
        return
    if args[0].startswith("-"):  # an option of snap itself (--version): it stands alone
        own = {opt for param in group.params for opt in param.opts}
        assert args[0] in own and len(args) == 1, f"snap has no option {args[0]!r} alone (its options: {sorted(own)})"
        return
    assert args[0] in group.commands, f"snap has no command {args[0]!r} (commands: {sorted(group.commands)})"
    command, exceptions = group.commands[args[0]], click_of(group)
    parent = group.context_class(group, info_name="snap")
    try:
        command.make_context(args[0], list(args[1:]), parent=parent, resilient_parsing=False)
    except exceptions.ClickException as e:
        pytest.fail(f"snap {' '.join(args)}: {e.format_message()}")
    except Exception as e:  # --help ends parsing with Exit(0): click's, or typer's own in newer typers
        if type(e).__name__ != "Exit" or getattr(e, "exit_code", None) != 0:
            raise


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: str) -> set[str]:
    seen, out = {}, set()
    in_fence = False
    for line in read(page).split("\n"):
        if line.strip().startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,6} ", line):
            s = slug(line)
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(page: str) -> list[tuple[str, str]]:
    """(link text, target) of the markdown links in a page's prose (not in code)."""
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)
    text = "\n".join(line for line in text.split("\n") if not line.startswith("    "))
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\[([^\]\n]*)\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    bad = []
    for text, target in links(page):
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(REPO, dest)):
            bad.append(f"[{text}]({target}): no file {dest}")
        elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
            bad.append(f"[{text}]({target}): no heading #{anchor} in {dest}")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t.partition("#")[0]) for _, t in links("README.md")}
    assert not [p for p in PAGES[1:] if p not in linked]


def unit_block(page: str, name: str) -> dict[str, str]:
    """The settings of the systemd unit `name` in a page's indented blocks (`# /etc/systemd/system/NAME`)."""
    lines = read(page).split("\n")
    at = next(i for i, line in enumerate(lines) if line.strip() == f"# /etc/systemd/system/{name}")
    settings = {}
    for line in lines[at + 1:]:
        if (line and not line.startswith("    ")) or line.strip().startswith("# /etc/"):
            break
        key, eq, value = line.strip().partition("=")
        if eq and not key.startswith("#"):
            settings[key] = value
    return settings


def test_the_vm_recipe_starts_a_watcher_that_died_again():
    """A watcher that died (killed, out of memory, a bug) left the VM unprotected until the next boot:
    systemd starts it again, and the restore's failure never keeps it from starting (Wants=)."""
    watch = unit_block(os.path.join("docs", "providers.md"), "snap-watch.service")
    assert watch.get("Restart") == "on-failure" and float(watch.get("RestartSec", "0")) > 0, watch
    assert "snap-restore.service" in watch.get("Wants", "") and "Requires" not in watch, watch
