"""A griffe extension: the package's docstrings, written for Sphinx, as mkdocstrings reads them.

The docstrings are Google style (``Args:``, ``Raises:``) with Sphinx markup in
their text. mkdocstrings renders Markdown and its Google parser knows one name
per parameter, so before it parses a docstring this rewrites, in every object
of the package:

* roles (:class:`~dcpstore.X`, :meth:`from_bridge`, :mod:`.fsdp`, ...) into
  optional cross-references: a link where the target is documented on the
  site, plain code where it is not (``_impl`` internals), never a warning;
* ``a, b, c: text`` items of a parameter section (names given one meaning
  together, also over several lines) into one item per name, the first with
  the text and the rest pointing at it;
* a paragraph ending ``::`` (a reST literal block follows) into one ending
  ``:`` -- the indented block is a Markdown code block as it stands.

Source files are not changed; ``mkdocs build --strict`` fails on any warning
griffe still gives.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|data|attr|exc|mod|obj|const):`(~?)([^`<>]+)`")
SECTION = re.compile(
    r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Attributes"
    r"|Raises|Exceptions|Warns|Warnings):\s*$"
)
#: Sections whose grouped items each get the whole text (an exception's "when" reads alone).
REPEATED = {"Raises", "Exceptions", "Warns", "Warnings"}
#: An item's head: "name:" or "name (type):".
ITEM = re.compile(r"^\*{0,2}[\w.]+\s*(\([^)]*\))?\s*:")
NAME_LIST = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(?:,\s*(\*{0,2}[A-Za-z_]\w*))*$")


def _role(obj: griffe.Object, match: re.Match[str]) -> str:
    kind, tilde, target = match.groups()
    target = target.strip().rstrip("()")
    title = target.rsplit(".", 1)[-1] if tilde else target.lstrip(".")
    module = obj if obj.is_module else obj.module
    if target.startswith("."):  # relative to the module: :mod:`.fsdp`
        identifier = f"{module.path}{target}"
    elif target.startswith("dcpstore."):
        identifier = target
    else:  # a name in scope: this class's method, a name the module defines or imports
        identifier = target
        first, _, rest = target.partition(".")
        scopes = [s for s in (obj if obj.is_class else obj.parent, module) if s is not None]
        for scope in scopes:
            try:
                identifier = scope.resolve(first) + (f".{rest}" if rest else "")
                break
            except griffe.NameResolutionError:
                continue
    return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'


def _split_groups(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_section = False
    repeat = False
    item_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        section = SECTION.match(line)
        if section:
            in_section, item_indent, repeat = True, None, section.group(2) in REPEATED
            out.append(line)
            i += 1
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if in_section and stripped:
            if item_indent is None:
                item_indent = indent
            if indent < item_indent:
                in_section = False
        if in_section and stripped and indent == item_indent:
            # Gather the item's head: the names up to the first ':' (they may span lines).
            head, j = stripped, i
            while ":" not in head and j + 1 < len(lines) and lines[j + 1].strip():
                j += 1
                head += " " + lines[j].strip()
            names_part, sep, rest = head.partition(":")
            names = [n.strip() for n in names_part.split(",") if n.strip()]
            if sep and len(names) > 1 and NAME_LIST.match(", ".join(names)):
                pad = " " * indent
                # the description's further lines follow, indented deeper
                more, k = [], j + 1
                while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
                    if not lines[k].strip():
                        # a blank line ends the item unless the next text is deeper
                        nxt = next((line for line in lines[k + 1 :] if line.strip()), "")
                        if len(nxt) - len(nxt.lstrip()) <= indent:
                            break
                    more.append(lines[k])
                    k += 1
                for n, name in enumerate(names):
                    if n == 0 or repeat:
                        out.append(f"{pad}{name}:{rest}".rstrip())
                        out.extend(more)
                    else:
                        out.append(f"{pad}{name}: as `{names[0]}`.")
                i = k
                continue
            if not ITEM.match(stripped):  # a continuation written at the item's indent
                out.append("    " + line)
                i += 1
                continue
        out.append(line)
        i += 1
    return out


def _literal_blocks(lines: list[str]) -> list[str]:
    out = []
    for n, line in enumerate(lines):
        following_blank = n + 1 < len(lines) and not lines[n + 1].strip()
        if line.rstrip().endswith("::") and following_blank:
            line = line.rstrip()[:-2].rstrip()
            line = line + ":" if line.strip() else line
        out.append(line)
    return out


def rewrite(obj: griffe.Object, text: str) -> str:
    lines = _literal_blocks(_split_groups(text.splitlines()))
    return ROLE.sub(lambda m: _role(obj, m), "\n".join(lines))


class SphinxMarkup(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()

        def visit(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)  # type: ignore[arg-type]

        visit(pkg)
