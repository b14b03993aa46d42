"""Markdown and self-contained HTML from one document."""

import base64

import numpy as np

from nsa_eval.report.document import Document
from nsa_eval.report.figures import length_label, niah_heatmap


def test_markdown_and_html_show_the_same_content(tmp_path):
    png = niah_heatmap(np.array([[1.0, np.nan], [0.5, 0.0]]), [1024, 2048], [0, 100], "m", tmp_path / "h.png")
    doc = Document("T")
    doc.heading("Scores")
    doc.para("Uses `code` and **bold** <script>")
    doc.table(["task", "a|b"], [["x", "0.500"]], "caption")
    doc.images([(png, "NIAH m")])
    md = doc.markdown(tmp_path)
    assert "| task | a\\|b |" in md and "![NIAH m](h.png)" in md
    html = doc.html()
    assert "<code>code</code>" in html and "<b>bold</b>" in html and "&lt;script&gt;" in html
    inline = html.split('src="data:image/png;base64,', 1)[1].split('"', 1)[0]
    assert base64.b64decode(inline) == png.read_bytes()  # the figure travels inside the HTML


def test_length_labels():
    assert [length_label(n) for n in (1024, 4096, 65536, 1000, 192)] == ["1k", "4k", "64k", "1000", "192"]
