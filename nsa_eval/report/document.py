"""A report as a list of blocks, rendered to markdown (figures as files) and to one self-contained
HTML file (figures inlined as base64, no external resources)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Document:
    title: str
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(("heading", level, text))

    def para(self, text: str) -> None:
        self.blocks.append(("para", text))

    def bullets(self, items: list[str]) -> None:
        self.blocks.append(("bullets", items))

    def table(self, header: list[str], rows: list[list[str]], caption: str = "") -> None:
        self.blocks.append(("table", header, rows, caption))

    def image(self, path: Path, alt: str) -> None:
        self.blocks.append(("image", Path(path), alt))

    def images(self, paths: list[tuple[Path, str]]) -> None:
        self.blocks.append(("images", [(Path(p), alt) for p, alt in paths]))

    # ------------------------------------------------------------ markdown

    def markdown(self, base: Path) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            kind = block[0]
            if kind == "heading":
                out += [f"{'#' * block[1]} {block[2]}", ""]
            elif kind == "para":
                out += [block[1], ""]
            elif kind == "bullets":
                out += [f"- {item}" for item in block[1]] + [""]
            elif kind == "table":
                _, header, rows, caption = block
                if caption:
                    out += [caption, ""]
                out.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
                out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
                out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
                out.append("")
            elif kind == "image":
                out += [f"![{block[2]}]({_relative(block[1], base)})", ""]
            elif kind == "images":
                out += [" ".join(f"![{alt}]({_relative(p, base)})" for p, alt in block[1]), ""]
        return "\n".join(out)

    # ------------------------------------------------------------ html

    def html(self) -> str:
        body = [f"<h1>{_e(self.title)}</h1>"]
        for block in self.blocks:
            kind = block[0]
            if kind == "heading":
                body.append(f"<h{block[1]}>{_e(block[2])}</h{block[1]}>")
            elif kind == "para":
                body.append(f"<p>{_inline(block[1])}</p>")
            elif kind == "bullets":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block[1]) + "</ul>")
            elif kind == "table":
                _, header, rows, caption = block
                cap = f"<caption>{_inline(caption)}</caption>" if caption else ""
                head = "".join(f"<th>{_inline(h)}</th>" for h in header)
                trs = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>"
                              for row in rows)
                body.append(f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
            elif kind == "image":
                body.append(_figure(block[1], block[2]))
            elif kind == "images":
                body.append('<div class="figures">' + "".join(_figure(p, a) for p, a in block[1]) + "</div>")
        return HTML_PAGE.format(title=_e(self.title), style=STYLE, body="\n".join(body))


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


def _e(text: str) -> str:
    return html.escape(str(text))


def _inline(text: str) -> str:
    """Escape, then turn markdown `code` and **bold** into tags (the only inline markup used)."""
    import re

    text = _e(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


def _figure(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img class="figure" alt="{_e(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(alt)}</figcaption></figure>")


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f2f2f2; }
caption { caption-side: top; text-align: left; padding-bottom: 0.3em; color: #555; }
code { background: #f4f4f4; padding: 0 0.2em; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0.5em 0; }
figcaption { font-size: 0.8em; color: #555; }
img.figure { max-width: 100%; }
"""

HTML_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""
